"""A rank of the built-in GPT trainer whose replicas go on and off in blocks of steps (benchmarks/replicas.py).

    python benchmarks/replica_blocks.py      (as a rank: the launcher's environment, ORCH_REPLICA_* set)
    BENCH_BLOCK=8: steps 1-8 without replicas, 9-16 with them every k (ORCH_REPLICA_EVERY), and so on

The trainer's own pieces (trainer.gpt: session, model, step with its agreement and end_step), only the
replicator's k switched per block, so that the steps with and without replicas run in the same processes
and the same minutes of a shared machine: each block with replicas is compared with the blocks on both
sides of it. Prints one line per step, ``bench_step {"step", "on", "wall_s", "cpu_s"}``: the wall time from
this step's start to the next one's (a replica's copy is taken at the end of its step and sent while the
next step runs) and this process's CPU time over the same span (both threads).
"""

from __future__ import annotations

from trainer.signals import install_early

install_early()

import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

from trainer import gpt  # noqa: E402

OFF = 1 << 30  # a k no step reaches


def main() -> None:
    args = gpt.parse_args([])
    sess = gpt.make_session(args)
    block = int(os.environ.get("BENCH_BLOCK", "8"))
    with sess.guard():
        b = gpt.build(args, sess)
        if sess.replicas is None:
            raise SystemExit("replica_blocks: ORCH_REPLICA_HOLDER, ORCH_REPLICA_KEY and ORCH_REPLICA_EVERY are needed")
        k = sess.replicas.every
        last: tuple[int, bool, float, float] | None = None
        for step in sess.steps(b.model, b.opt, scheduler=b.sched, sampler=b.sampler):
            on = ((step - 1) // block) % 2 == 1
            sess.replicas.every = k if on else OFF
            t, c = time.monotonic(), time.process_time()
            if last is not None:
                print("bench_step " + json.dumps({"step": last[0], "on": last[1], "wall_s": t - last[2],
                                                  "cpu_s": c - last[3]}), flush=True)
            last = (step, on, t, c)
            gpt.train_step(sess, b, args, step)


if __name__ == "__main__":
    main()
