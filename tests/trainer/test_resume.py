"""Real rank processes (gloo, CPU, tiny GPT): exact resume, resharding, corruption fallback, peer loss."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.trainer.helpers import GPT_CMD, Generation, flatten, load_checkpoint_tensors, step_records, trainer_env
from trainer import contract, store

pytestmark = pytest.mark.slow  # real multi-process generations (run in CI too)

ARGS = {"size": "tiny", "seq_len": 32, "global_batch": 6, "micro_batch": 2, "lr": 3e-3, "warmup_steps": 3, "seed": 7}


def _final_dir(tmp: Path, step: int) -> Path:
    return tmp / "ckpt" / f"step_{step:09d}"


def test_emergency_resume_is_bitwise_identical(tmp_path: Path) -> None:
    total = 24
    ref = tmp_path / "ref"
    ref.mkdir()
    g = Generation(GPT_CMD, 2, trainer_env(ref, total_steps=total, args=ARGS))
    assert g.wait() == [0, 0], g.log()

    # Interrupted run: two emergency checkpoints at random steps (SIGUSR1 + request file, then SIGTERM),
    # each resumed in new processes. It starts with micro_batch 8 and a simulated OOM above 2: every
    # generation halves down to the reference's micro-batch without changing the math.
    run = tmp_path / "run"
    run.mkdir()
    rng = random.Random()
    args = {**ARGS, "micro_batch": 8, "debug_oom_above_micro": 2, "ckpt_every": 3}
    resume, stops = "", []
    for gen, sig in enumerate([signal.SIGUSR1, signal.SIGTERM]):
        g = Generation(GPT_CMD, 2, trainer_env(run, total_steps=total, args=args, resume=resume, generation=gen))
        at = (stops[-1] if stops else 0) + rng.randint(1, 6)
        g.wait_step(at)
        g.request_checkpoint(run / f"control{gen}", sig=sig)
        assert g.wait() == [contract.EXIT_PREEMPTED] * 2, g.log()
        emergency = [r for r in g.reports(contract.CheckpointReport) if r.emergency]
        assert len(emergency) == 2 and emergency[0].step == emergency[1].step, g.log()
        assert emergency[0].deadline_margin_s is not None and emergency[0].deadline_margin_s > 0
        assert emergency[0].reason == ("sigterm" if sig == signal.SIGTERM else "preemption_notice")
        assert any("oom_retry" in line for line in g.ranks[0].lines)
        stops.append(emergency[0].step)
        resume = "latest"
    g = Generation(GPT_CMD, 2, trainer_env(run, total_steps=total, args=args, resume=resume, generation=2))
    assert g.wait() == [0, 0], g.log()
    assert stops[0] < stops[1] < total

    a = flatten(load_checkpoint_tensors(_final_dir(ref, total), tmp_path / "a.pt"))
    b = flatten(load_checkpoint_tensors(_final_dir(run, total), tmp_path / "b.pt"))
    assert a.keys() == b.keys()
    tensors = [k for k, v in a.items() if isinstance(v, torch.Tensor)]
    assert any(k.startswith("model.") for k in tensors) and any(k.startswith("optim.") for k in tensors)
    for k in tensors:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume (stops at {stops})"

    # every step ran exactly once in the interrupted run, with the same losses as the reference
    ref_loss = {r.step: r.loss for r in step_records(ref / "steps.jsonl") if r.rank == 0}
    run_loss = [(r.step, r.loss) for r in step_records(run / "steps.jsonl") if r.rank == 0]
    assert [s for s, _ in run_loss] == list(range(1, total + 1))
    assert all(ref_loss[s] == loss for s, loss in run_loss)


def test_reshard_2_3_1_consumes_every_sample_once(tmp_path: Path) -> None:
    total, B = 12, ARGS["global_batch"]
    args = {**ARGS, "ckpt_every": 2}  # a periodic save is often in flight when the request lands
    resume = ""
    plan = [(2, 3), (3, 8), (1, None)]  # (world size, stop at or after this step)
    for gen, (ws, at) in enumerate(plan):
        g = Generation(GPT_CMD, ws, trainer_env(tmp_path, total_steps=total, args=args, resume=resume, generation=gen))
        if at is not None:
            g.wait_step(at)
            g.request_checkpoint(tmp_path / f"control{gen}", ranks=[ws - 1])  # one rank asked: all agree
            assert g.wait() == [contract.EXIT_PREEMPTED] * ws, g.log()
        else:
            assert g.wait() == [0] * ws, g.log()
        resume = "latest"
        if gen > 0:
            assert any("resumed_from" in line for line in g.ranks[0].lines), g.log()

    records = step_records(tmp_path / "steps.jsonl")
    by_step: dict[int, list[int]] = {}
    sizes = set()
    for r in records:
        by_step.setdefault(r.step, []).extend(r.sample_ids)
        sizes.add((r.generation, r.world_size))
    assert sizes == {(0, 2), (1, 3), (2, 1)}
    assert sorted(by_step) == list(range(1, total + 1))
    for step, ids in by_step.items():
        assert sorted(ids) == list(range((step - 1) * B, step * B)), (step, ids)  # fixed global batch, in order
    fed = [i for ids in by_step.values() for i in ids]
    assert len(fed) == len(set(fed)) == total * B
    # whatever was in flight was finished or abandoned: every committed checkpoint verifies
    entries = store.list_checkpoints(f"file://{tmp_path / 'ckpt'}")
    assert [s for s, _, c in entries if c][-1] == total
    assert all(store.verify(d) is None for _, d, c in entries if c)


def test_corrupt_checkpoint_falls_back_to_previous(tmp_path: Path) -> None:
    args = {**ARGS, "ckpt_every": 2}
    g = Generation(GPT_CMD, 1, trainer_env(tmp_path, total_steps=4, args=args))
    assert g.wait() == [0], g.log()
    committed = [e for e in store.list_checkpoints(f"file://{tmp_path / 'ckpt'}") if e[2]]
    assert [s for s, _, _ in committed] == [2, 4]
    shard = _final_dir(tmp_path, 4) / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])  # truncated shard in the newest checkpoint

    # the survivor generation also switches FSDP -> DDP with activation checkpointing: same checkpoint
    ddp = {**args, "mode": "ddp", "activation_checkpointing": True}
    g = Generation(GPT_CMD, 2, trainer_env(tmp_path, total_steps=5, args=ddp, resume="latest", generation=1))
    assert g.wait() == [0, 0], g.log()
    out = "\n".join(g.ranks[0].lines)
    assert "checkpoint_fallback" in out and "__0_0.distcp" in out
    assert "resumed_from" in out and "step=2 " in out
    first = min(r.step for r in step_records(tmp_path / "steps.jsonl") if r.generation == 1)
    assert first == 3


def test_vanished_peer_does_not_hang_survivor(tmp_path: Path) -> None:
    env = trainer_env(tmp_path, total_steps=100000, args=ARGS, extra={contract.ENV_COLLECTIVE_TIMEOUT_S: "5"})
    g = Generation(GPT_CMD, 2, env)
    g.wait_step(2)
    t0 = time.monotonic()
    g.ranks[1].proc.kill()
    codes = g.wait(timeout=30)
    assert codes[0] == contract.EXIT_PEER_LOST, g.log()
    assert time.monotonic() - t0 < 15
    exits = [r for r in g.ranks[0].reports() if isinstance(r, contract.ExitReport)]
    assert exits and exits[0].reason


def test_request_during_startup_is_kept(tmp_path: Path) -> None:
    """SIGUSR1 while the rank is still importing torch: recorded, honoured after the first step."""
    g = Generation(GPT_CMD, 1, trainer_env(tmp_path, total_steps=1000, args=ARGS))
    pid, deadline = g.ranks[0].proc.pid, time.monotonic() + 30
    while time.monotonic() < deadline:  # wait until SIGUSR1 is caught (SigCgt), i.e. the early handler is in
        status = Path(f"/proc/{pid}/status").read_text()
        caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
        if caught & (1 << (signal.SIGUSR1 - 1)):
            break
        time.sleep(0.002)
    assert not any(isinstance(r, contract.StepReport) for r in g.ranks[0].reports())
    g.request_checkpoint(tmp_path / "control0")
    assert g.wait() == [contract.EXIT_PREEMPTED], g.log()
    (report,) = [r for r in g.reports(contract.CheckpointReport) if r.emergency]
    assert report.step <= 2 and report.save_s > 0


def test_launcher_forwards_sigterm(tmp_path: Path) -> None:
    """python -m trainer.launch: ranks get the torch variables, SIGTERM reaches both, exit code 75."""
    import os
    import subprocess
    import sys

    from tests.trainer.helpers import REPO

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           **trainer_env(tmp_path, total_steps=100000, args=ARGS)}
    argv = [sys.executable, "-m", "trainer.launch", "--nproc", "2", "--", sys.executable, "-m", "trainer"]
    proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith('{"orch":"step"'):
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=120)
    out = "".join(lines) + rest
    assert proc.returncode == contract.EXIT_PREEMPTED, out
    reports = [r for r in map(contract.parse_report, out.splitlines()) if isinstance(r, contract.CheckpointReport)]
    assert sorted(r.rank for r in reports if r.emergency) == [0, 1] and all(r.reason == "sigterm" for r in reports)
