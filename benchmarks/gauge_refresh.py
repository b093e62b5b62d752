"""What orchd's periodic gauge refresh costs the decide loop: the whole refresh against its longest slice.

    python benchmarks/gauge_refresh.py --nodes 10000 --json

Builds the state of N nodes in N/8 running jobs with the core (``benchmarks/core_decide.py``'s builder),
each node with ``--gpus`` GPU readings (what agents with NVML send; 0: none), then, --rounds times:
``gauges.refresh_gauges`` at once (what held the loop before it was sliced), and
``gauges.refresh_gauge_slices`` slice by slice, timing each slice (the longest is the longest a notice
waits behind the refresh now), and one render of ``/metrics`` as orchd serves it
(``metrics_http.Renderer``, OpenMetrics as Prometheus asks) and one by prometheus_client's encoder alone
(what orchd served before): what a Prometheus scrape costs orchd's process, in a thread that shares the
interpreter lock. CPU times (``time.process_time``), medians over the rounds. Prints ``refresh_ms``,
``longest_slice_ms``, ``slices``, ``slice_over_refresh``, ``scrape_ms``, ``scrape_encoder_ms``,
``scrape_over_encoder``, ``series`` and ``scrape_mb``.
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
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

import wire as ev
from orchestrator.daemon.gauges import refresh_gauge_slices, refresh_gauges
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.metrics_http import Renderer
from orchestrator.daemon.observe import MetricsObserver


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--gpus", type=int, default=0, help="GPU readings per node (0: none)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    state, _ = core_decide.build(args.nodes, 8)
    metrics = Metrics()
    # what the refresh reads of a Daemon
    d: Any = SimpleNamespace(state=state, metrics=metrics, fencing_token=1, observer=MetricsObserver(metrics))
    readings = tuple(ev.GpuStats(index=g, util_pct=50.0, mem_used_mib=1.0, mem_total_mib=2.0, temp_c=60.0)
                     for g in range(args.gpus))

    def heartbeats() -> None:  # fresh readings, as from agents heartbeating (older than 10 s: dropped)
        for nid in state.nodes if readings else ():
            d.observer.gpus[nid] = (time.time(), readings)

    heartbeats()
    refresh_gauges(d)  # the series exist, as in a daemon that has refreshed before
    renderer = Renderer(metrics)
    prometheus = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
    whole, longest, n_slices, scrape, encoder = [], [], 0, [], []
    size = 0
    for _ in range(args.rounds):
        heartbeats()
        t = time.process_time()
        refresh_gauges(d)
        whole.append(time.process_time() - t)
        slices = []
        heartbeats()
        t = time.process_time()
        for _ in refresh_gauge_slices(d):
            now = time.process_time()
            slices.append(now - t)
            t = now
        slices.append(time.process_time() - t)
        longest.append(max(slices))
        n_slices = len(slices)
        t = time.process_time()
        size = len(renderer.render(prometheus)[0])
        scrape.append(time.process_time() - t)
        t = time.process_time()
        openmetrics_latest(metrics.registry)
        encoder.append(time.process_time() - t)
    refresh_ms, slice_ms = statistics.median(whole) * 1000, statistics.median(longest) * 1000
    out = {"nodes": args.nodes, "jobs": len(state.jobs), "rounds": args.rounds, "refresh_ms": round(refresh_ms, 1),
           "longest_slice_ms": round(slice_ms, 1), "slices": n_slices,
           "slice_over_refresh": round(slice_ms / refresh_ms, 3) if refresh_ms else None,
           "scrape_ms": round(statistics.median(scrape) * 1000, 1),
           "scrape_encoder_ms": round(statistics.median(encoder) * 1000, 1),
           "scrape_over_encoder": round(statistics.median(scrape) / statistics.median(encoder), 3),
           "series": sum(len(f.samples) for f in metrics.registry.collect()), "scrape_mb": round(size / 1e6, 2),
           "gpus": args.gpus,
           "load_average": os.getloadavg()[0]}
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
