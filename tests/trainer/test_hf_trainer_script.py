"""An existing Hugging Face ``Trainer`` script (examples/hf_trainer/train.py, one added line) as a spot job:
2 real gloo ranks on "node A" are noticed and checkpoint within the notice to ORCH_CKPT_URL; node A's work
directory (its output_dir, its cwd) is deleted; "node B", in another work directory, resumes from the
checkpoint root alone and finishes. Every step ran once in the trajectory that counts, and over the two
full epochs every sample was fed exactly once per epoch: none twice, none skipped."""

from __future__ import annotations

import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.extras import needs
from tests.trainer.forked import ForkedGeneration
from tests.trainer.helpers import REPO, step_records, trainer_env
from trainer import contract

# real multi-process generations (run in CI too)
pytestmark = [pytest.mark.slow, needs("transformers", "accelerate")]

SAMPLES, BATCH, RANKS = 24, 2, 2
TOTAL = 2 * SAMPLES // (BATCH * RANKS)  # two full epochs: 12 steps


def _cmd(work: Path) -> list[str]:
    return [sys.executable, str(REPO / "examples" / "hf_trainer" / "train.py"), "--output-dir", str(work / "out"),
            "--samples", str(SAMPLES), "--batch", str(BATCH), "--epochs", "10"]


def test_hf_trainer_script_noticed_and_resumed_elsewhere(tmp_path: Path) -> None:
    root = f"file://{tmp_path / 'store' / 'ckpt'}"
    node_a, node_b = tmp_path / "node-a", tmp_path / "node-b"
    node_a.mkdir()
    node_b.mkdir()
    g = ForkedGeneration(_cmd(node_a), RANKS, trainer_env(node_a, total_steps=TOTAL, args={}, ckpt_url=root))
    g.wait_step(4, timeout=120)
    g.request_checkpoint(node_a / "control0", ranks=[1], deadline_s=20.0)  # one rank told is enough
    assert g.wait() == [contract.EXIT_PREEMPTED] * RANKS, g.log()
    (r0, r1) = [r for r in g.reports(contract.CheckpointReport) if r.emergency]
    assert r0.step == r1.step and 4 <= r0.step < TOTAL
    assert r0.deadline_margin_s is not None and r0.deadline_margin_s > 0  # committed within the notice
    records = step_records(node_a / "steps.jsonl")
    shutil.rmtree(node_a)  # node A is gone with everything it wrote locally

    g = ForkedGeneration(_cmd(node_b), RANKS, trainer_env(node_b, total_steps=TOTAL, args={}, ckpt_url=root,
                                                    resume="latest", generation=1))
    assert g.wait() == [0] * RANKS, g.log()
    assert any(f"resumed_from dir={root}/step_{r0.step:09d} step={r0.step}" in ln for ln in g.ranks[0].lines), g.log()
    records += step_records(node_b / "steps.jsonl")

    # the trajectory that counts: the generation that committed past a step (gen 0 up to its commit)
    counted = [r for r in records if (r.generation == 0 and r.step <= r0.step) or r.generation == 1]
    steps = Counter((r.step, r.rank) for r in counted)
    assert sorted({s for s, _ in steps}) == list(range(1, TOTAL + 1)) and set(steps.values()) == {1}, steps
    fed = Counter(i for r in counted for i in r.sample_ids)
    assert all(len(r.sample_ids) == BATCH for r in counted)
    assert set(fed) == set(range(2 * SAMPLES)) and set(fed.values()) == {1}, fed  # (epoch, index) exactly once
    assert [r.step for r in records if r.generation == 0 and r.step > r0.step] == []  # nothing ran past the stop
