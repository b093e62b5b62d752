"""What orchd's periodic gauge refresh costs the decide loop: the whole refresh against its longest slice.

    python benchmarks/gauge_refresh.py --nodes 10000 --json

Builds the state of N nodes in N/8 running jobs with the core (``benchmarks/core_decide.py``'s builder),
then, --rounds times: ``state.refresh_gauges`` at once (what held the loop before it was sliced), and
``state.refresh_gauge_slices`` slice by slice, timing each slice (the longest is the longest a notice
waits behind the refresh now), and one render of ``/metrics`` (what a Prometheus scrape costs orchd's
process, in a thread that shares the interpreter lock). CPU times (``time.process_time``), medians over
the rounds. Prints ``refresh_ms``, ``longest_slice_ms``, ``slices``, ``slice_over_refresh`` and
``scrape_ms``, ``scrape_mb``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import core_decide  # benchmarks/core_decide.py, beside this script
from prometheus_client import generate_latest

from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.observe import MetricsObserver
from orchestrator.daemon.state import refresh_gauge_slices, refresh_gauges


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    state, _ = core_decide.build(args.nodes, 8)
    metrics = Metrics()
    # what the refresh reads of a Daemon
    d: Any = SimpleNamespace(state=state, metrics=metrics, fencing_token=1, observer=MetricsObserver(metrics))
    refresh_gauges(d)  # the series exist, as in a daemon that has refreshed before
    whole, longest, n_slices, scrape = [], [], 0, []
    size = 0
    for _ in range(args.rounds):
        t = time.process_time()
        refresh_gauges(d)
        whole.append(time.process_time() - t)
        slices = []
        t = time.process_time()
        for _ in refresh_gauge_slices(d):
            now = time.process_time()
            slices.append(now - t)
            t = now
        slices.append(time.process_time() - t)
        longest.append(max(slices))
        n_slices = len(slices)
        t = time.process_time()
        size = len(generate_latest(metrics.registry))
        scrape.append(time.process_time() - t)
    refresh_ms, slice_ms = statistics.median(whole) * 1000, statistics.median(longest) * 1000
    out = {"nodes": args.nodes, "jobs": len(state.jobs), "rounds": args.rounds, "refresh_ms": round(refresh_ms, 1),
           "longest_slice_ms": round(slice_ms, 1), "slices": n_slices,
           "slice_over_refresh": round(slice_ms / refresh_ms, 3) if refresh_ms else None,
           "scrape_ms": round(statistics.median(scrape) * 1000, 1), "scrape_mb": round(size / 1e6, 2),
           "load_average": os.getloadavg()[0]}
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
