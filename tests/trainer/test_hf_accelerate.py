"""A plain Accelerate loop (examples/hf_accelerate/train.py, ``SpotAccelerate``) as a spot job: 2 real gloo ranks
(Accelerate's multi-process CPU mode: DDP) on "node A" are noticed mid-epoch and checkpoint within the notice to
ORCH_CKPT_URL; node A's work directory is deleted; "node B", in another work directory, resumes from the checkpoint
root alone and finishes. Beside them an uninterrupted run of the same job: the trajectory that counts has every
step once, every sample of both epochs once (the shuffled order replayed across the epoch boundary), and the
uninterrupted run's batches and losses, bitwise."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.extras import needs
from tests.trainer.forked import ForkedGeneration, assert_exactly_once, notice_and_resume_elsewhere
from tests.trainer.helpers import REPO, step_records, trainer_env

# real multi-process generations (run in CI too)
pytestmark = [pytest.mark.slow, needs("transformers", "accelerate")]

SAMPLES, BATCH, RANKS = 24, 2, 2
TOTAL = 2 * SAMPLES // (BATCH * RANKS)  # two full epochs of 6 steps: 12 steps
CMD = [sys.executable, str(REPO / "examples" / "hf_accelerate" / "train.py"), "--samples", str(SAMPLES),
       "--batch", str(BATCH)]


def test_accelerate_loop_noticed_resumed_elsewhere_exactly(tmp_path: Path) -> None:
    (tmp_path / "ref").mkdir()
    g_ref = ForkedGeneration(CMD, RANKS, trainer_env(tmp_path / "ref", total_steps=TOTAL, args={}))
    run = notice_and_resume_elsewhere(lambda work: CMD, tmp_path, RANKS, TOTAL, at_step=2, tell=[0])
    assert g_ref.wait() == [0] * RANKS, g_ref.log()
    assert any("DistributedType.MULTI_CPU" in ln for ln in run.resumed.ranks[0].lines), run.resumed.log()  # DDP
    assert_exactly_once(run.counted, TOTAL, SAMPLES, BATCH)
    want = {(r.step, r.rank): (r.loss, r.sample_ids) for r in step_records(tmp_path / "ref" / "steps.jsonl")}
    got = {(r.step, r.rank): (r.loss, r.sample_ids) for r in run.counted}
    assert got == want  # the uninterrupted run's batches in its order, and its losses bitwise
    assert len({loss for loss, _ in want.values()}) > TOTAL // 2  # it trains, not a constant
