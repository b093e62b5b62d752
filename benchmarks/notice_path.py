"""Micro-benchmark of orchd's own work per preemption notice, without the bus: CPU seconds per notice
through the decide stage of a batch (``pipeline.decide_batch``: decode, screen, trust gate, core, the
outbox keys and audit entries, and the daemon's log line and ``orchctl events`` entry per command,
written as JSON to /dev/null as orchd writes them at level info), at N nodes in jobs of 8, every node
training (the fleet of ``benchmarks/core_decide.py``). The notices come zone by zone and job by job, in
batches of ``--batch`` (a zone going away, as ``benchmarks/control_plane.py --notice-burst`` sends
them): the first notice of a job orders its checkpoint and a replacement, the last the rest.

    python benchmarks/notice_path.py --json     # {"shell_us_per_notice": ..., "core_us_per_notice": ...}

``core_us_per_notice``: ``decide`` alone over the same notices, the anchor measured beside it. What it
leaves out, and ``benchmarks/control_plane.py`` measures: nats-py, the persist's writes, the commands'
sends. CPU time (``time.process_time``), the median of ``--repeat`` runs: comparable across trees on a
busy machine (the script imports the tree it lies in: copy it into the other tree's benchmarks/ and run
it there).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import core_decide  # benchmarks/core_decide.py, beside this script

import wire as ev
from orchestrator.core import decide
from orchestrator.daemon import pipeline
from orchestrator.daemon.coreapi import default_core
from orchestrator.daemon.loop import Daemon
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.records import Batch
from orchestrator.settings import Settings
from wire.logs import configure


@dataclass
class _Meta:
    num_delivered: int = 1
    timestamp: datetime.datetime = field(default_factory=lambda: datetime.datetime.now(datetime.UTC))


@dataclass
class _Msg:
    """What the pipeline reads of a nats-py JetStream message."""

    subject: str
    data: bytes
    metadata: _Meta = field(default_factory=_Meta)


def run(nodes: int, notices: int, batch: int) -> dict:
    state, now = core_decide.build(nodes, 8)
    gc.collect()  # the collector as orchd's process sets it once its state is loaded (daemon/run.py)
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)
    ids = sorted(state.nodes, key=lambda n: (state.nodes[n].pool.zone, state.nodes[n].job_id, n))[:notices]
    events = [ev.PreemptionNotice(id=f"burst-{n}", node_id=ev.NodeId(n), cloud="aws", deadline_ts=now + 120,
                                  observed_ts=now) for n in ids]
    msgs = [_Msg(ev.subject_notice("aws", e.node_id), ev.encode(e)) for e in events]
    core = default_core(Settings())
    daemon = Daemon(Settings(), {}, core, Metrics())
    clock = time.process_time

    t0 = clock()
    s, commands = state, 0
    for e in events:
        d = decide(s, e, now + 1)
        s, commands = d.state, commands + len(d.commands)
    core_s = clock() - t0

    t0 = clock()
    s = state
    for k in range(0, len(msgs), batch):
        decider = pipeline.Decider(core, s, metrics=daemon.metrics, on_decision=daemon.events.decision,
                                   clock=lambda: now + 1)
        s = pipeline.decide_batch(Batch([("events", m) for m in msgs[k:k + batch]], [], []),  # type: ignore[misc]
                                  decider).state
    shell_s = clock() - t0
    return {"notices": len(events), "commands": commands, "shell_us_per_notice": round(shell_s / len(events) * 1e6, 2),
            "core_us_per_notice": round(core_s / len(events) * 1e6, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=10_000)
    p.add_argument("--notices", type=int, default=1000)
    p.add_argument("--batch", type=int, default=50, help="notices per batch")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with open(os.devnull, "w") as sink:
        configure("info", "json", stream=sink)  # orchd's log configuration, the lines thrown away
        runs = [run(args.nodes, args.notices, args.batch) for _ in range(args.repeat)]
    out = {"nodes": args.nodes, "notices": runs[0]["notices"], "batch": args.batch, "commands": runs[0]["commands"],
           "shell_us_per_notice": statistics.median(r["shell_us_per_notice"] for r in runs),
           "core_us_per_notice": statistics.median(r["core_us_per_notice"] for r in runs),
           "runs_us": [r["shell_us_per_notice"] for r in runs],
           "load_average": round(os.getloadavg()[0], 2), "tree": str(Path(pipeline.__file__).resolve().parents[2])}
    out["shell_over_core"] = round(out["shell_us_per_notice"] / out["core_us_per_notice"], 3)
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
