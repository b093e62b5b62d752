"""How the agent names a generation's end and the step it resumes from (trainer exit codes 76/78, markers)."""

from __future__ import annotations

import json
from pathlib import Path

from agent.ranks import classify, resume_step
from trainer import contract


def test_no_usable_checkpoint_and_storage_error_are_reported_as_such() -> None:
    assert classify([78, 78]) == ("no_usable_checkpoint", contract.EXIT_NO_CHECKPOINT)
    assert classify([76, 76]) == ("checkpoint_failed", contract.EXIT_CHECKPOINT_FAILED)
    assert classify([76, 76], storage_error=True) == ("storage_error", contract.EXIT_CHECKPOINT_FAILED)
    assert classify([1, 0], storage_error=True) == ("failed", 1)  # only a 76 becomes storage_error
    assert classify([77, 78]) == ("peer_lost", contract.EXIT_PEER_LOST)
    # orchd refuses the replica step only for this reason (it used to arrive as "failed", counted and held)
    assert classify([79, 79]) == ("replica_unusable", contract.EXIT_REPLICA_UNUSABLE)
    assert classify([77, 79])[0] == "peer_lost"  # a rank died during the recovery: a peer is gone


def test_resume_step_comes_from_the_commit_marker_not_the_name(tmp_path: Path) -> None:
    d = tmp_path / "step_000000123"
    d.mkdir()
    assert resume_step(f"file://{d}") is None  # no marker: unknown, whatever the name says
    for bad in ([], "x", {}, {"step": "123"}):
        (d / contract.CHECKPOINT_COMMIT_MARKER).write_text(json.dumps(bad))
        assert resume_step(f"file://{d}") is None, bad
    (d / contract.CHECKPOINT_COMMIT_MARKER).write_text(json.dumps({"step": 120, "files": {}}))
    assert resume_step(f"file://{d}") == 120 and resume_step(str(d)) == 120
    assert resume_step("") == 0
    assert resume_step("latest") is None and resume_step("s3://bucket/job/step_000000123") is None
