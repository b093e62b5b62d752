"""``orchctl checkpoint owner`` / ``take-over``: an operator gives a checkpoint root to its job under a new
cluster identity after a lost state; the marker keeps who owned it before, who took it over, when and why,
and the job of the new cluster may then claim the root, no one else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.cli import main as cli
from trainer import rootowner


def _ctl(*argv: str) -> tuple[int, str, str]:
    out: list[str] = []
    err: list[str] = []
    code = cli.main(list(argv), out=out.append, err=err.append)
    return code, "".join(out), "".join(err)


def test_take_over_is_explicit_and_recorded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = (tmp_path / "ckpt").as_uri()
    rootowner.claim(root, "demo", "orch-lost-cluster")
    with pytest.raises(rootowner.RootOwned, match="owned by job demo of cluster orch-lost-cluster"):
        rootowner.claim(root, "demo", "orch-new-cluster")
    assert _ctl("checkpoint", "take-over", root, "--job", "demo", "--cluster", "orch-new-cluster")[0] == 2
    capsys.readouterr()
    code, _out, _err = _ctl("checkpoint", "take-over", root, "--job", "demo", "--cluster", "orch-new-cluster",
                            "--reason", "orchd's state was lost", "--operator", "alice")
    assert code == 0
    marker = json.loads(capsys.readouterr().out)
    assert (marker["job_id"], marker["cluster_id"]) == ("demo", "orch-new-cluster")
    assert marker["history"][-1] | {"taken_over_ts": 0} == {
        "job_id": "demo", "cluster_id": "orch-lost-cluster", "claimed_ts": marker["history"][-1]["claimed_ts"],
        "taken_over_ts": 0, "operator": "alice", "reason": "orchd's state was lost"}
    assert rootowner.claim(root, "demo", "orch-new-cluster").cluster_id == "orch-new-cluster"
    with pytest.raises(rootowner.RootOwned):
        rootowner.claim(root, "demo", "orch-lost-cluster")  # the old cluster may no longer write there
    assert _ctl("checkpoint", "owner", root)[0] == 0
    assert json.loads(capsys.readouterr().out)["cluster_id"] == "orch-new-cluster"
    assert _ctl("checkpoint", "owner", (tmp_path / "none").as_uri())[0] == 66
