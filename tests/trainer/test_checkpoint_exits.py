"""Checkpoint safety with real trainer processes (gloo ranks on CPU, like the agent runs them): malformed
markers fall back, another job's checkpoint is refused, no usable checkpoint exits EXIT_NO_CHECKPOINT (and
the agent reports it as such), a full disk during a save exits EXIT_CHECKPOINT_FAILED with a storage_error
reason (and the agent reports storage_error)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agent.ranks import classify
from tests.trainer.helpers import GPT_CMD, REPO, Generation, trainer_env
from trainer import contract, store

pytestmark = pytest.mark.slow  # real multi-process generations (run in CI too)

ARGS = {"size": "tiny", "seq_len": 32, "global_batch": 4, "micro_batch": 2, "seed": 3, "async_ckpt": "off"}
FULL_DISK_CMD = [sys.executable, str(REPO / "tests" / "trainer" / "scripts" / "full_disk.py")]


def _exits(g: Generation) -> list[contract.ExitReport]:
    return g.reports(contract.ExitReport)


def _job(job_id: str) -> dict[str, str]:
    return {contract.ENV_JOB_ID: job_id}


def test_markers_fall_back_refuse_other_jobs_and_fail_explicitly(tmp_path: Path) -> None:
    g = Generation(GPT_CMD, 1, trainer_env(tmp_path, total_steps=4, args={**ARGS, "ckpt_every": 2},
                                           extra=_job("job-a")))
    assert g.wait() == [0], g.log()
    root = tmp_path / "ckpt"
    assert [s for s, _, c in store.list_checkpoints(f"file://{root}") if c] == [2, 4]
    assert json.loads((root / "step_000000004" / store.COMMIT_MARKER).read_text())["job_id"] == "job-a"

    # another job pointed at this root: refused, explicitly, by the root's owner marker before anything is read
    g = Generation(GPT_CMD, 1, trainer_env(tmp_path, total_steps=6, args=ARGS, resume="latest", generation=1,
                                           extra=_job("job-b")))
    assert g.wait() == [contract.EXIT_FAILED], g.log()
    assert _exits(g)[0].reason == (f"{contract.ROOT_OWNED_REASON}: checkpoint root file://{root} owned by job job-a "
                                   "of cluster (none)") and not g.reports(contract.StepReport)

    # a malformed newest marker ({"files": []}): the previous checkpoint
    (root / "step_000000004" / store.COMMIT_MARKER).write_text(json.dumps({"files": []}))
    url4 = f"file://{root}/step_000000004"
    g = Generation(GPT_CMD, 1, trainer_env(tmp_path, total_steps=3, args=ARGS, resume=url4, generation=2,
                                           extra=_job("job-a")))
    assert g.wait() == [0], g.log()
    out = "\n".join(g.ranks[0].lines)
    assert "checkpoint_fallback" in out and "resumed_from" in out and "step=2 " in out
    assert min(r.step for r in g.reports(contract.StepReport)) == 3

    # every marker malformed (step 3's final save too): no silent restart at step 1, on every rank
    for step, bad in ((2, []), (3, "x"), (4, {})):
        (root / f"step_{step:09d}" / store.COMMIT_MARKER).write_text(json.dumps(bad))
    g = Generation(GPT_CMD, 2, trainer_env(tmp_path, total_steps=6, args=ARGS, resume="latest", generation=3,
                                           extra=_job("job-a")))
    codes = g.wait()
    assert codes == [contract.EXIT_NO_CHECKPOINT] * 2, g.log()
    assert all(e.reason.startswith("no_usable_checkpoint") for e in _exits(g)) and len(_exits(g)) == 2
    assert not g.reports(contract.StepReport)
    assert classify(codes) == ("no_usable_checkpoint", contract.EXIT_NO_CHECKPOINT)


def _assert_storage_error(g: Generation, codes: list[int], world: int) -> None:
    assert codes == [contract.EXIT_CHECKPOINT_FAILED] * world, g.log()
    exits = _exits(g)
    assert len(exits) == world and all(e.reason.startswith(contract.STORAGE_ERROR_REASON) for e in exits), exits
    assert any("No space left on device" in e.reason for e in exits), exits
    storage_error = any(e.reason.startswith(contract.STORAGE_ERROR_REASON) for e in exits)
    assert classify(codes, storage_error=storage_error) == ("storage_error", contract.EXIT_CHECKPOINT_FAILED)


def test_full_disk_during_the_final_save_is_a_storage_error(tmp_path: Path) -> None:
    g = Generation(FULL_DISK_CMD, 1, trainer_env(tmp_path, total_steps=2, args=ARGS))
    _assert_storage_error(g, g.wait(), 1)
    assert not [c for _, _, c in store.list_checkpoints(f"file://{tmp_path / 'ckpt'}") if c]


def test_full_disk_during_an_async_periodic_save_stops_every_rank(tmp_path: Path) -> None:
    args = {**ARGS, "async_ckpt": "thread", "ckpt_every": 2}
    g = Generation(FULL_DISK_CMD, 2, trainer_env(tmp_path, total_steps=50, args=args))
    _assert_storage_error(g, g.wait(), 2)
    assert max(r.step for r in g.reports(contract.StepReport)) < 10  # stopped at once, not at the end
    assert not [c for _, _, c in store.list_checkpoints(f"file://{tmp_path / 'ckpt'}") if c]
