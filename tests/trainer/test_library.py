"""The library drives a second, non-GPT script: emergency checkpoint to s3:// (moto server) with a
process-based async saver, resume at another world size, exactly-once samples."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.storage_emulators import Store
from tests.trainer.helpers import REPO, Generation, step_records, trainer_env
from trainer import contract, store

pytestmark = pytest.mark.slow  # real multi-process generations (run in CI too)

SCRIPT = [sys.executable, str(REPO / "tests" / "trainer" / "scripts" / "regression.py")]


def test_non_gpt_script_on_s3_with_process_async(tmp_path: Path, object_stores: Callable[[str], Store]) -> None:
    s3 = object_stores("s3")
    moto_s3 = s3.options
    root = s3.url(f"regression-{uuid.uuid4().hex[:8]}")
    total = 30
    # periodic saves timed by orchd's ORCH_CKPT_INTERVAL_S (agreed per step), not by a step count
    args = {"async_mode": "process", "storage_options": moto_s3}
    g = Generation(SCRIPT, 2, trainer_env(tmp_path, total_steps=total, args=args, ckpt_url=root,
                                          extra={contract.ENV_CKPT_INTERVAL_S: "0.01"}))
    g.wait_step(7, timeout=120)
    g.request_checkpoint(tmp_path / "control0")
    assert g.wait() == [contract.EXIT_PREEMPTED] * 2, g.log()
    periodic = [r for r in g.reports(contract.CheckpointReport) if not r.emergency]
    emergency = [r for r in g.reports(contract.CheckpointReport) if r.emergency]
    assert periodic, "a process-based async checkpoint should have committed before the request"
    assert all(r.rank == 0 and r.reason == "periodic" for r in periodic)
    stop = emergency[0].step
    assert store.verify(store.step_dir(root, stop), moto_s3) is None

    g = Generation(SCRIPT, 1, trainer_env(tmp_path, total_steps=total,
                                          args={**args, "async_mode": "thread", "ckpt_every": 3},
                                          ckpt_url=root, resume="latest", generation=1))
    assert g.wait() == [0], g.log()
    records = step_records(tmp_path / "steps.jsonl")
    assert sorted({r.step for r in records}) == list(range(1, total + 1))
    fed = [i for r in records for i in r.sample_ids]
    assert sorted(fed) == list(range(total * 8))
    committed = [s for s, _, c in store.list_checkpoints(root, moto_s3) if c]
    assert committed[-1] == total and len(committed) <= 3
