"""The warm rank pool: a pre-started interpreter becomes the rank (same pid), receives the contract's
environment, reports through the same pipes, and handles a checkpoint request like a fresh process."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import anyio
import msgspec
import pytest

from agent.ranks import RankGroup
from agent.warm import WarmPool, module_of
from tests.agent.helpers import start_cmd
from trainer import contract
from wire import TrainerSpec

pytestmark = pytest.mark.anyio

ROOT = str(Path(__file__).resolve().parents[2])


def test_module_of() -> None:
    assert module_of([sys.executable, "-m", "trainer", "--x"]) == "trainer"
    assert module_of(["/usr/bin/env", "-m", "trainer"]) is None
    assert module_of([sys.executable, "script.py"]) is None


async def test_warm_process_runs_the_generation_and_checkpoints(tmp_path: Path) -> None:
    pool = WarmPool(1, str(tmp_path), preload=("json",), env={**os.environ, "PYTHONPATH": ROOT})
    await pool.refill()
    warm_pid = pool._procs[0].pid
    cmd = start_cmd("n-w", ckpt=str(tmp_path / "ck"), steps=10_000, step_time_s=0.02)
    cmd = msgspec.structs.replace(cmd, trainer=TrainerSpec(
        command=(sys.executable, "-m", "tests.agent.fake_trainer"), args={"step_time_s": 0.02},
        env={"PYTHONPATH": ROOT}))
    reports: list = []
    logs: list[str] = []
    g = RankGroup(cmd=cmd, work_dir=tmp_path, on_report=lambda r, rep: reports.append(rep),
                  on_log=lambda r, s, line: logs.append(line), warm=pool)
    async with anyio.create_task_group() as tg:
        await tg.start(g.run)
        assert g.warm_used == 1 and g.ranks[0].proc.pid == warm_pid
        with anyio.fail_after(10):
            await g.ready.wait()
        g.request_checkpoint(contract.CheckpointRequest(request_id="r", reason="test",
                                                        deadline_ts=time.time() + 30, issued_ts=time.time()))
    assert g.result.reason == "emergency_checkpoint"
    assert any("generation 1 resuming after step 0" in line for line in logs)
    assert any(isinstance(r, contract.CheckpointReport) and r.emergency for r in reports)
    assert pool.take() is None  # used up; the agent refills

