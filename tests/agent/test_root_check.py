"""The agent and the checkpoint root: ORCH_CLUSTER_ID reaches the ranks (orchd's, else the agent's own; never the
job's), and a start whose root belongs to another job or cluster is refused before any rank starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.generations import root_problem
from agent.ranks import RankGroup, _Rank
from tests.agent.helpers import start_cmd
from trainer import contract, rootowner

pytestmark = pytest.mark.anyio


def _env(tmp_path: Path) -> dict[str, str]:
    g = RankGroup(cmd=start_cmd("n", ckpt=str(tmp_path)), work_dir=tmp_path, on_report=lambda rank, report: None,
                  on_log=lambda rank, stream, line: None)
    return g._env(_Rank(rank=0, local_rank=0))


def test_cluster_id_reaches_the_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import msgspec

    monkeypatch.delenv(contract.ENV_CLUSTER_ID, raising=False)
    assert _env(tmp_path)[contract.ENV_CLUSTER_ID] == ""
    monkeypatch.setenv(contract.ENV_CLUSTER_ID, "agent-cluster")
    assert _env(tmp_path)[contract.ENV_CLUSTER_ID] == "agent-cluster"
    cmd = start_cmd("n", ckpt=str(tmp_path))
    spec = msgspec.structs.replace(cmd.trainer, env={contract.ENV_CLUSTER_ID: "spoofed"})
    from_orchd = msgspec.structs.replace(cmd, cluster_id="orchd-cluster", trainer=spec)
    g = RankGroup(cmd=from_orchd, work_dir=tmp_path, on_report=lambda rank, report: None,
                  on_log=lambda rank, stream, line: None)
    assert g._env(_Rank(rank=0, local_rank=0))[contract.ENV_CLUSTER_ID] == "orchd-cluster"


async def test_start_on_another_jobs_root_is_refused(tmp_path: Path) -> None:
    import msgspec

    root = tmp_path / "ckpt"
    cmd = msgspec.structs.replace(start_cmd("n", ckpt=str(root)), cluster_id="c1")
    assert await root_problem(cmd) is None  # nobody's yet (the agent only checks; the trainer claims)
    rootowner.claim(f"file://{root}", "other-job", "c1")
    assert await root_problem(cmd) == f"checkpoint root file://{root} owned by job other-job of cluster c1"
    rootowner.take_over(f"file://{root}", "j1", "c2", operator="op", reason="test")
    assert await root_problem(cmd) == f"checkpoint root file://{root} owned by job j1 of cluster c2"
    assert await root_problem(msgspec.structs.replace(cmd, cluster_id="c2")) is None


def test_model_schemes_are_orchds_not_the_jobs_nor_the_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ORCH_MODEL_SCHEMES (where a Hugging Face model or dataset may come from) is orchd's configuration, carried by
    the start command: a job spec's trainer.env cannot set or widen it, the agent's own environment is not read,
    and a start without it (an older orchd's) leaves the trainer's default."""
    import msgspec

    cmd = start_cmd("n", ckpt=str(tmp_path))
    spec = msgspec.structs.replace(cmd.trainer, env={contract.ENV_MODEL_SCHEMES: "file,s3,gs,az,hub,builtin"})
    job = msgspec.structs.replace(cmd, trainer=spec)

    def env(c: object) -> dict[str, str]:
        g = RankGroup(cmd=c, work_dir=tmp_path, on_report=lambda rank, report: None,
                      on_log=lambda rank, stream, line: None)
        return g._env(_Rank(rank=0, local_rank=0))

    monkeypatch.setenv(contract.ENV_MODEL_SCHEMES, "s3")  # a node's old setting: no longer read
    assert env(msgspec.structs.replace(job, model_schemes=("file", "builtin")))[contract.ENV_MODEL_SCHEMES] == \
        "file,builtin"
    assert contract.ENV_MODEL_SCHEMES not in env(job)