"""The trainer of the partition drills: a ``trainer.command`` program without torch, run by orch-agent.

``python -m simulations.chaos.parttrainer`` - started by orch-agent as each rank of a generation, with the
contract's environment (trainer/contract.py). It follows the contract at every edge the agent sees:

- a ``StepReport`` line per step (``step_time_s`` of ORCH_TRAINER_ARGS, default 0.05 s): the agent's
  heartbeats carry the step;
- a checkpoint every ORCH_CKPT_INTERVAL_S seconds, and on a checkpoint request (SIGUSR1 with the request
  file in ORCH_CONTROL_DIR, or SIGTERM) after the current step, then ``ExitReport`` and exit
  ``EXIT_PREEMPTED``; the final checkpoint at ORCH_TOTAL_STEPS, exit ``EXIT_COMPLETED``;
- a checkpoint is the directory ``<ORCH_CKPT_URL>/step_<N>``: this rank's state file
  ``rank<R>-g<G>-<node>.json`` (who wrote it, when, at which step and generation: what the drills score),
  then the commit marker ``COMMITTED`` (``{"step": N, ...}``, written to a temporary name and renamed, so
  it is whole or absent); a ``CheckpointReport`` names the directory;
- resuming: the step of ORCH_RESUME_FROM's commit marker; no marker (or a bad one): exit
  ``EXIT_NO_CHECKPOINT`` having trained nothing.

Ranks do not talk to each other (each keeps the whole, replicated state, as data-parallel ranks do), so a
rank cut off from its peers keeps training: unlike real ranks, which would block in a collective.

``CHAOS_NODE_ID`` (set by ``realhost`` on the agent, inherited by its ranks) names the node in the state
files; ``CHAOS_JOURNAL`` is a file this process appends ``start`` / ``ckpt`` / ``exit`` lines to (one JSON
object each), read by ``realhost`` for the drills' records.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

from trainer import contract

STATE_FILE = "rank{rank}-g{generation}-{node}.json"


def _journal(path: str, **fields: Any) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"t": time.time(), "pid": os.getpid(), **fields}) + "\n")


def resume_step(resume_from: str) -> int | None:
    """0 for a fresh start; the step of the commit marker under ``resume_from``; None: no usable marker."""
    if not resume_from:
        return 0
    try:
        with open(os.path.join(resume_from.removeprefix("file://"), contract.CHECKPOINT_COMMIT_MARKER), "rb") as f:
            return contract.commit_marker_step(f.read(1 << 16))
    except OSError:
        return None


def save(root: str, *, step: int, rank: int, generation: int, node: str, job: str) -> str:
    """Write this rank's checkpoint of ``step`` and commit it; returns the checkpoint's URL."""
    path = os.path.join(root, f"step_{step:09d}")
    os.makedirs(path, exist_ok=True)
    record = {"step": step, "rank": rank, "generation": generation, "node_id": node, "job_id": job, "t": time.time()}
    with open(os.path.join(path, STATE_FILE.format(rank=rank, generation=generation, node=node)), "w") as f:
        f.write(json.dumps(record))
    tmp = os.path.join(path, f".{contract.CHECKPOINT_COMMIT_MARKER}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(json.dumps(record))
    os.replace(tmp, os.path.join(path, contract.CHECKPOINT_COMMIT_MARKER))
    return f"file://{path}"


def main() -> int:
    pending: list[str] = []
    signal.signal(signal.SIGUSR1, lambda _s, _f: pending.append("request"))  # before anything else
    signal.signal(signal.SIGTERM, lambda _s, _f: pending.append("sigterm"))
    env = os.environ
    rank, gen = int(env["RANK"]), int(env[contract.ENV_GENERATION])
    job, total = env.get(contract.ENV_JOB_ID, "job"), int(env[contract.ENV_TOTAL_STEPS])
    root = env[contract.ENV_CKPT_URL].removeprefix("file://")
    node, journal = env.get("CHAOS_NODE_ID", "node"), env.get("CHAOS_JOURNAL", "")
    control = env.get(contract.ENV_CONTROL_DIR, "")
    step_time = float(json.loads(env.get(contract.ENV_TRAINER_ARGS) or "{}").get("step_time_s", 0.05))
    interval = float(env.get(contract.ENV_CKPT_INTERVAL_S) or 0) or None
    resume = env.get(contract.ENV_RESUME_FROM, "")

    def report(r: Any) -> None:
        print(contract.encode_report(r), flush=True)

    def end(code: int, reason: str, step: int) -> int:
        report(contract.ExitReport(rank=rank, generation=gen, exit_code=code, reason=reason, last_step=step,
                                   ts=time.time()))
        _journal(journal, kind="exit", node_id=node, job_id=job, generation=gen, rank=rank, step=step, code=code)
        return code

    start = resume_step(resume)
    _journal(journal, kind="start", node_id=node, job_id=job, generation=gen, rank=rank, resume_from=resume,
             step=start)
    if start is None:
        return end(contract.EXIT_NO_CHECKPOINT, f"no commit marker under {resume}", 0)
    step, last_save = start, time.monotonic()

    def checkpoint(emergency: bool, reason: str) -> None:
        t0 = time.time()
        url = save(root, step=step, rank=rank, generation=gen, node=node, job=job)
        now = time.time()
        report(contract.CheckpointReport(rank=rank, generation=gen, step=step, checkpoint_id=f"step_{step:09d}",
                                         url=url, save_s=now - t0, emergency=emergency, deadline_margin_s=None,
                                         reason=reason, ts=now))
        _journal(journal, kind="ckpt", node_id=node, job_id=job, generation=gen, rank=rank, step=step, url=url)

    while step < total:
        t0 = time.time()
        time.sleep(step_time)
        step += 1
        report(contract.StepReport(rank=rank, generation=gen, step=step, loss=1.0 / step, step_time_s=time.time() - t0,
                                   tokens_per_s=1000.0, ts=time.time()))
        if pending:
            req = contract.read_checkpoint_request(control) if control and pending[0] == "request" else None
            checkpoint(True, req.reason if req else pending[0])
            return end(contract.EXIT_PREEMPTED, "emergency_checkpoint", step)
        if interval is not None and time.monotonic() - last_save >= interval and step < total:
            checkpoint(False, "periodic")
            last_save = time.monotonic()
    checkpoint(False, "final")
    return end(contract.EXIT_COMPLETED, "completed", step)


if __name__ == "__main__":
    sys.exit(main())
