"""An existing Hugging Face ``Trainer`` script (examples/hf_trainer/train.py, one added line) as a spot job:
2 real gloo ranks on "node A" are noticed and checkpoint within the notice to ORCH_CKPT_URL; node A's work
directory (its output_dir, its cwd) is deleted; "node B", in another work directory, resumes from the
checkpoint root alone and finishes. Every step ran once in the trajectory that counts, and over the two
full epochs every sample was fed exactly once per epoch: none twice, none skipped."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.extras import needs
from tests.trainer.forked import assert_exactly_once, notice_and_resume_elsewhere
from tests.trainer.helpers import REPO

# real multi-process generations (run in CI too)
pytestmark = [pytest.mark.slow, needs("transformers", "accelerate")]

SAMPLES, BATCH, RANKS = 24, 2, 2
TOTAL = 2 * SAMPLES // (BATCH * RANKS)  # two full epochs: 12 steps


def _cmd(work: Path) -> list[str]:
    return [sys.executable, str(REPO / "examples" / "hf_trainer" / "train.py"), "--output-dir", str(work / "out"),
            "--samples", str(SAMPLES), "--batch", str(BATCH), "--epochs", "10"]


def test_hf_trainer_script_noticed_and_resumed_elsewhere(tmp_path: Path) -> None:
    run = notice_and_resume_elsewhere(_cmd, tmp_path, RANKS, TOTAL, at_step=4, tell=[1])  # one rank told is enough
    assert_exactly_once(run.counted, TOTAL, SAMPLES, BATCH)  # sample ids: (epoch, index)
