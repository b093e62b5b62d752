"""A tiny trainer that follows trainer/contract.py without torch: for the agent's rank-runner tests.

One "step" sleeps ``step_time_s`` (ORCH_TRAINER_ARGS), appends a StepRecord to ORCH_STEP_LOG and prints
a StepReport. SIGUSR1 (+ request file) or SIGTERM: checkpoint after the current step (a directory with a
COMMITTED marker under ORCH_CKPT_URL), CheckpointReport + ExitReport, exit EXIT_PREEMPTED. At
ORCH_TOTAL_STEPS: exit EXIT_COMPLETED. ``fail_at_step``: exit EXIT_FAILED there. No collectives: ranks
are independent, which is all the agent needs to be tested against.
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
world = int(env["WORLD_SIZE"])
gen = int(env[contract.ENV_GENERATION])
total = int(env[contract.ENV_TOTAL_STEPS])
root = env[contract.ENV_CKPT_URL].removeprefix("file://")
control = env.get(contract.ENV_CONTROL_DIR, "")
args = json.loads(env.get(contract.ENV_TRAINER_ARGS, "{}"))
step_time = float(args.get("step_time_s", 0.05))
fail_at = int(args.get("fail_at_step", 0))
grace = float(env.get(contract.ENV_SIGTERM_GRACE_S, "30"))
pending: list[contract.CheckpointRequest] = []


def on_usr1(signum, frame):
    req = contract.read_checkpoint_request(control) if control else None
    pending.append(req or contract.CheckpointRequest(request_id="bare", reason="admin", deadline_ts=None,
                                                     issued_ts=time.time()))


def on_term(signum, frame):
    now = time.time()
    pending.append(contract.CheckpointRequest(request_id="sigterm", reason="sigterm", deadline_ts=now + grace,
                                              issued_ts=now))


signal.signal(signal.SIGUSR1, on_usr1)
signal.signal(signal.SIGTERM, on_term)


def latest() -> int:
    best = 0
    if os.path.isdir(root):
        for name in os.listdir(root):
            if name.startswith("step_") and os.path.exists(os.path.join(root, name, "COMMITTED")):
                best = max(best, int(name[5:]))
    return best


resume = env.get(contract.ENV_RESUME_FROM, "")
start = 0 if not resume else latest() if resume == "latest" else int(resume.rstrip("/").rsplit("step_", 1)[1])
print(f"fake trainer rank {rank}/{world} generation {gen} resuming after step {start}", flush=True)
print("a line on stderr", file=sys.stderr, flush=True)


def report(r) -> None:
    print(contract.encode_report(r), flush=True)


def save(step: int, emergency: bool, req: contract.CheckpointRequest | None) -> None:
    t0 = time.time()
    path = os.path.join(root, f"step_{step:09d}")
    os.makedirs(path, exist_ok=True)
    if rank == 0:
        with open(os.path.join(path, "COMMITTED"), "w") as f:
            f.write(json.dumps({"step": step}))  # the agent reports the step the marker names
    now = time.time()
    margin = (req.deadline_ts - now) if req is not None and req.deadline_ts else None
    report(contract.CheckpointReport(rank=rank, generation=gen, step=step, checkpoint_id=f"step_{step:09d}",
                                     url=f"file://{path}", save_s=now - t0, emergency=emergency,
                                     deadline_margin_s=margin, reason=req.reason if req else "final", ts=now))


step = start
for step in range(start + 1, total + 1):
    t0 = time.time()
    time.sleep(step_time)
    if fail_at and step == fail_at:
        print("boom", file=sys.stderr, flush=True)
        sys.exit(contract.EXIT_FAILED)
    loss = 1.0 / step
    if env.get(contract.ENV_STEP_LOG):
        rec = contract.StepRecord(generation=gen, step=step, rank=rank, world_size=world, loss=loss,
                                  sample_ids=(step * world + rank,), ts=time.time())
        with open(env[contract.ENV_STEP_LOG], "ab") as f:
            f.write(json.dumps({k: getattr(rec, k) for k in rec.__struct_fields__}).encode() + b"\n")
    report(contract.StepReport(rank=rank, generation=gen, step=step, loss=loss, step_time_s=time.time() - t0,
                               tokens_per_s=1000.0, ts=time.time()))
    if pending:
        save(step, True, pending[0])
        report(contract.ExitReport(rank=rank, generation=gen, exit_code=contract.EXIT_PREEMPTED,
                                   reason="emergency_checkpoint", last_step=step, ts=time.time()))
        sys.exit(contract.EXIT_PREEMPTED)
save(step, False, None)
report(contract.ExitReport(rank=rank, generation=gen, exit_code=0, reason="completed", last_step=step, ts=time.time()))
sys.exit(contract.EXIT_COMPLETED)
