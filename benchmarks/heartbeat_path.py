"""Micro-benchmark of orchd's own work per heartbeat, without the bus: CPU seconds per heartbeat through
the decide loop's stages for a batch (``pipeline.decide_batch``: decode, screen, trust gate, core;
``LivenessFlusher.settle``; ``MetricsObserver.after_batch``), at N nodes in jobs of 8, every node
training (the fleet of ``benchmarks/core_decide.py``).

    python benchmarks/heartbeat_path.py --json                 # {"shell_us_per_heartbeat": ..., "admit_us": ...}
    python benchmarks/heartbeat_path.py --nodes 10000 --batch 250 --rounds 40

What it leaves out, and ``benchmarks/control_plane.py`` measures: nats-py's receive path (parse, the
message objects, the subscription's callback), the liveness records' writes, gauges, ticks. CPU time
(``time.process_time``) of this process, the median of ``--repeat`` runs: comparable across trees even
on a busy machine (the script imports the tree it lies in: copy it into the other tree's benchmarks/
and run it there).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import core_decide  # benchmarks/core_decide.py, beside this script

import wire as ev
from orchestrator.daemon import admit, pipeline
from orchestrator.daemon.coreapi import default_core
from orchestrator.daemon.liveness import LivenessFlusher
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.observe import MetricsObserver
from orchestrator.daemon.records import Batch
from orchestrator.settings import Settings


@dataclass
class _Msg:
    """What the pipeline reads of a nats-py message."""

    subject: str
    data: bytes


async def _nothing(keys: set[str]) -> None:
    return None


def run(nodes: int, batch: int, rounds: int) -> dict:
    state, now = core_decide.build(nodes, 8)
    gc.collect()  # the collector as orchd's process sets it once its state is loaded (daemon/run.py)
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)
    core = default_core(Settings())
    metrics = Metrics()
    observer = MetricsObserver(metrics)
    liveness = LivenessFlusher(_nothing, 500)
    ids = sorted(state.nodes)
    seq = 0

    def msg(nid: str) -> _Msg:
        node = state.nodes[nid]
        hb = ev.Heartbeat(node_id=ev.NodeId(nid), seq=seq, ts=now, state=ev.AgentState.TRAINING,
                          job_id=ev.JobId(node.job_id), generation=node.generation, step=seq, loss=2.0,
                          tokens_per_s=1e5, step_time_s=1.0, fencing_token=0)
        return _Msg(ev.subject_heartbeat(nid), ev.encode(hb))

    cpu = 0.0
    stages = dict.fromkeys(STAGES, 0.0)
    done = 0
    clock = time.process_time
    for r in range(rounds):
        seq = r + 1
        for k in range(0, len(ids), batch):
            msgs = [msg(nid) for nid in ids[k:k + batch]]
            t1 = clock()
            t = now + seq
            decider = pipeline.Decider(core, state, metrics=metrics, on_decision=lambda e, d: None,
                                       clock=functools.partial(float, t))
            decided = pipeline.decide_batch(Batch([], msgs, []), decider)  # type: ignore[arg-type]
            t2 = clock()
            liveness.settle(decided.liveness, decided.dirty, final=False)
            t3 = clock()
            observer.after_batch(state, decided, t)
            t4 = clock()
            again = [msg(nid) for nid in ids[k:k + batch]]  # the same messages, new objects
            t5 = clock()
            admit.admit_heartbeats(again)  # type: ignore[arg-type]  # the stage alone: not in the total
            t6 = clock()
            cpu += t4 - t1
            for name, dt in zip(STAGES, (t6 - t5, t2 - t1, t3 - t2, t4 - t3), strict=True):
                stages[name] += dt
            state = decided.state
            done += decided.decided
    return {"heartbeats": done, "cpu_s": round(cpu, 3), "shell_us_per_heartbeat": round(cpu / done * 1e6, 2),
            **{f"{name}_us": round(v / done * 1e6, 2) for name, v in stages.items()}}


STAGES = ("admit", "decide_batch", "settle", "after_batch")
"""The stages timed apart (``*_us``, per heartbeat): ``admit`` (decode and screen, ``admit_heartbeats``) is
timed in a pass of its own over the same messages, after the batch, and is also part of ``decide_batch``
(admit, trust gate, core); the total ``shell_us_per_heartbeat`` is ``decide_batch`` + ``settle``
(``LivenessFlusher.settle``) + ``after_batch`` (``MetricsObserver.after_batch``)."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=10_000)
    p.add_argument("--batch", type=int, default=250, help="heartbeats per batch")
    p.add_argument("--rounds", type=int, default=20, help="heartbeats per node")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    runs = [run(args.nodes, args.batch, args.rounds) for _ in range(args.repeat)]
    per = [r["shell_us_per_heartbeat"] for r in runs]
    out = {"nodes": args.nodes, "batch": args.batch, "rounds": args.rounds,
           "shell_us_per_heartbeat": statistics.median(per), "runs_us": per,
           **{f"{name}_us": statistics.median(r[f"{name}_us"] for r in runs) for name in STAGES},
           "load_average": round(os.getloadavg()[0], 2), "tree": str(Path(pipeline.__file__).resolve().parents[2])}
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
