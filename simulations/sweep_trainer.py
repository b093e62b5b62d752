"""A trainer for sweeps on local nodes, without torch: ``python -m simulations.sweep_trainer``.

Follows trainer/contract.py like the built-in trainer does at its edges. Each step sleeps ``step_time_s``
(ORCH_TRAINER_ARGS) and prints a StepReport whose loss is ``simulations.sweeps.trial_loss`` of the trial's
parameters (``x``) and the step. It checkpoints (a step directory with a COMMITTED marker under
ORCH_CKPT_URL) every ORCH_CKPT_INTERVAL_S seconds, and on SIGUSR1 (a checkpoint request) or SIGTERM, after
the current step. After an emergency checkpoint it exits EXIT_PREEMPTED. It resumes after the step of
ORCH_RESUME_FROM, and exits EXIT_COMPLETED at ORCH_TOTAL_STEPS. Ranks do not talk to each other.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

from trainer import contract


def _trial_loss(args: dict[str, Any], step: int) -> float:
    from simulations.sweeps import trial_loss

    return trial_loss(args, step)


def main() -> int:
    env = os.environ
    rank, gen = int(env["RANK"]), int(env[contract.ENV_GENERATION])
    total = int(env[contract.ENV_TOTAL_STEPS])
    root = env[contract.ENV_CKPT_URL].removeprefix("file://")
    control = env.get(contract.ENV_CONTROL_DIR, "")
    args = json.loads(env.get(contract.ENV_TRAINER_ARGS, "{}"))
    step_time = float(args.get("step_time_s", 0.1))
    interval = float(env.get(contract.ENV_CKPT_INTERVAL_S) or 0) or None
    pending: list[contract.CheckpointRequest] = []

    def on_usr1(_s: int, _f: Any) -> None:
        req = contract.read_checkpoint_request(control) if control else None
        pending.append(req or contract.CheckpointRequest(request_id="bare", reason="admin", deadline_ts=None,
                                                         issued_ts=time.time()))

    def on_term(_s: int, _f: Any) -> None:
        pending.append(contract.CheckpointRequest(request_id="sigterm", reason="sigterm", deadline_ts=None,
                                                  issued_ts=time.time()))

    signal.signal(signal.SIGUSR1, on_usr1)
    signal.signal(signal.SIGTERM, on_term)

    def report(r: Any) -> None:
        print(contract.encode_report(r), flush=True)

    def save(step: int, emergency: bool, reason: str) -> None:
        t0 = time.time()
        path = os.path.join(root, f"step_{step:09d}")
        os.makedirs(path, exist_ok=True)
        if rank == 0:
            with open(os.path.join(path, "COMMITTED"), "w") as f:
                f.write(json.dumps({"step": step}))
        now = time.time()
        report(contract.CheckpointReport(rank=rank, generation=gen, step=step, checkpoint_id=f"step_{step:09d}",
                                         url=f"file://{path}", save_s=now - t0, emergency=emergency,
                                         deadline_margin_s=None, reason=reason, ts=now))

    resume = env.get(contract.ENV_RESUME_FROM, "")
    step = int(resume.rstrip("/").rsplit("step_", 1)[1]) if "step_" in resume else 0
    last_save = time.monotonic()
    while step < total:
        t0 = time.time()
        time.sleep(step_time)
        step += 1
        report(contract.StepReport(rank=rank, generation=gen, step=step, loss=_trial_loss(args, step),
                                   step_time_s=time.time() - t0, tokens_per_s=1000.0, ts=time.time()))
        if pending:
            save(step, True, pending[0].reason)
            report(contract.ExitReport(rank=rank, generation=gen, exit_code=contract.EXIT_PREEMPTED,
                                       reason="emergency_checkpoint", last_step=step, ts=time.time()))
            return contract.EXIT_PREEMPTED
        if interval is not None and time.monotonic() - last_save >= interval and step < total:
            save(step, False, "periodic")
            last_save = time.monotonic()
    save(step, False, "final")
    report(contract.ExitReport(rank=rank, generation=gen, exit_code=0, reason="completed", last_step=step,
                               ts=time.time()))
    return contract.EXIT_COMPLETED


if __name__ == "__main__":
    sys.exit(main())
