"""The drill's trainer: follows trainer/contract.py without torch, on a CPU node of the local provider.

One "step" sleeps ``step_time_s`` (ORCH_TRAINER_ARGS) and prints a StepReport; an emergency save takes
``emergency_save_s``. Every ``ckpt_every_s`` it
saves a periodic checkpoint (a directory with a COMMITTED marker under ORCH_CKPT_URL); a save that fails
with an OS error (the store is gone, full, read-only) ends the generation as the contract says: an
ExitReport with the reason ``storage_error: ...`` and EXIT_CHECKPOINT_FAILED. SIGUSR1 (+ request file)
or SIGTERM: checkpoint after the current step, ExitReport, EXIT_PREEMPTED.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from trainer import contract

env = os.environ
rank = int(env["RANK"])
gen = int(env[contract.ENV_GENERATION])
total = int(env[contract.ENV_TOTAL_STEPS])
root = env[contract.ENV_CKPT_URL].removeprefix("file://")
control = env.get(contract.ENV_CONTROL_DIR, "")
args = json.loads(env.get(contract.ENV_TRAINER_ARGS, "{}"))
step_time = float(args.get("step_time_s", 0.1))
ckpt_every = float(args.get("ckpt_every_s", 0.0))
emergency_save = float(args.get("emergency_save_s", 0.0))  # how long an emergency save takes
grace = float(env.get(contract.ENV_SIGTERM_GRACE_S, "30"))
pending: list[contract.CheckpointRequest] = []


def on_usr1(signum: int, frame: object) -> None:
    req = contract.read_checkpoint_request(control) if control else None
    pending.append(req or contract.CheckpointRequest(request_id="bare", reason="admin", deadline_ts=None,
                                                     issued_ts=time.time()))


def on_term(signum: int, frame: object) -> None:
    now = time.time()
    pending.append(contract.CheckpointRequest(request_id="sigterm", reason="sigterm", deadline_ts=now + grace,
                                              issued_ts=now))


signal.signal(signal.SIGUSR1, on_usr1)
signal.signal(signal.SIGTERM, on_term)


def report(r: object) -> None:
    print(contract.encode_report(r), flush=True)  # type: ignore[arg-type]


def save(step: int, emergency: bool, req: contract.CheckpointRequest | None) -> None:
    t0 = time.time()
    path = os.path.join(root, f"step_{step:09d}")
    if emergency:
        time.sleep(emergency_save)
    try:
        os.makedirs(path, exist_ok=True)
        if rank == 0:
            with open(os.path.join(path, "COMMITTED"), "w") as f:
                f.write(json.dumps({"step": step}))
    except OSError as e:
        print(f"checkpoint save failed: {e}", file=sys.stderr, flush=True)
        report(contract.ExitReport(rank=rank, generation=gen, exit_code=contract.EXIT_CHECKPOINT_FAILED,
                                   reason=f"{contract.STORAGE_ERROR_REASON}: {e}", last_step=step, ts=time.time()))
        sys.exit(contract.EXIT_CHECKPOINT_FAILED)
    now = time.time()
    margin = (req.deadline_ts - now) if req is not None and req.deadline_ts else None
    report(contract.CheckpointReport(rank=rank, generation=gen, step=step, checkpoint_id=f"step_{step:09d}",
                                     url=f"file://{path}", save_s=now - t0, emergency=emergency,
                                     deadline_margin_s=margin, reason=req.reason if req else "periodic", ts=now))


resume = env.get(contract.ENV_RESUME_FROM, "")
start = 0 if not resume or resume == "latest" else int(resume.rstrip("/").rsplit("step_", 1)[1])
print(f"drill trainer rank {rank} generation {gen} resuming after step {start}", flush=True)
step = start
last_save = time.monotonic()
for step in range(start + 1, total + 1):
    t0 = time.time()
    time.sleep(step_time)
    report(contract.StepReport(rank=rank, generation=gen, step=step, loss=1.0 / step, step_time_s=time.time() - t0,
                               tokens_per_s=1000.0, ts=time.time()))
    if pending:
        save(step, True, pending[0])
        report(contract.ExitReport(rank=rank, generation=gen, exit_code=contract.EXIT_PREEMPTED,
                                   reason="emergency_checkpoint", last_step=step, ts=time.time()))
        sys.exit(contract.EXIT_PREEMPTED)
    if ckpt_every and time.monotonic() - last_save >= ckpt_every:
        save(step, False, None)
        last_save = time.monotonic()
save(step, False, None)
report(contract.ExitReport(rank=rank, generation=gen, exit_code=0, reason="completed", last_step=step, ts=time.time()))
sys.exit(contract.EXIT_COMPLETED)
