"""Tracking overhead: the time the training thread spends handing a step's metrics to the MLflow logger.

    python benchmarks/tracking.py --json [--steps 100] [--block 10] [--step-ms 100] [--uri http://host:port]

Starts ``mlflow server`` (SQLite, loopback; the full ``mlflow`` package) unless --uri names one, and creates a
run. A training step is real CPU work (float32 matmuls in torch, one thread) sized in this run to take at
least --step-ms; rank 0's per-step metrics (loss, grad norm, tokens/s, step time and two more) are handed to
``trainer.tracking.MetricsLogger`` exactly as ``trainer.lib.Session.end_step`` does. Three kinds of steps,
--steps of each, run in alternating blocks of --block steps (plain, tracked, outage, plain, ...) so that a
shared machine's drifting load hits all three alike:

  plain      the step alone (the anchor: step_s_median)
  tracked    the step + the hand-over; this logger sends to the server in its thread all along
  outage     the same with the server unreachable (a closed port): that logger retries in its thread

Printed figures:

  handover_us_mean / _p99 / _max   time inside ``put`` per step (perf_counter around the call), tracked phase
  handover_ratio                   handover mean / step_s_median (goal <= 0.02)
  handover_ratio_outage            the same in the outage phase
  step_ratio_tracked               median step time of the tracked phase / the plain phase's (the logger's
                                   thread shares the interpreter: what it costs the step beyond the hand-over)
  step_ratio_outage                likewise for the outage phase
  logged, lost                     steps the server holds at the end of the tracked phase / counted lost
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from orchestrator.core.commands import CreateTrackingRun  # noqa: E402
from orchestrator.daemon.tracking import LocalMlflowServer, create_run  # noqa: E402
from trainer.tracking import MetricsLogger  # noqa: E402
from wire import JobId  # noqa: E402


def _work(n: int, reps: int, a: torch.Tensor) -> float:
    x = a
    for _ in range(reps):
        x = torch.tanh(x @ a)
    return float(x[0, 0])


def _calibrate(step_ms: float) -> tuple[int, torch.Tensor]:
    n = 256
    a = torch.randn(n, n) / n**0.5
    reps = 1
    while True:
        t0 = time.perf_counter()
        _work(n, reps, a)
        dt = time.perf_counter() - t0
        if dt * 1000 >= step_ms:
            return reps, a
        reps = max(reps + 1, int(reps * step_ms / max(dt * 1000, 1e-3) * 1.1))


def _phase(steps: int, reps: int, a: torch.Tensor, logger: MetricsLogger | None,
           first_step: int) -> tuple[list[float], list[float]]:
    step_s: list[float] = []
    handover_s: list[float] = []
    for i in range(steps):
        step = first_step + i
        t0 = time.perf_counter()
        loss = _work(a.shape[0], reps, a)
        if logger is not None:
            dt = time.perf_counter() - t0
            metrics = {"loss": loss, "step_time_s": dt, "grad_norm": 1.0, "tokens_per_s": 1e5 / dt, "mfu": 0.4,
                       "generation": 1.0}
            h0 = time.perf_counter()
            logger.put(step, metrics)
            handover_s.append(time.perf_counter() - h0)
        step_s.append(time.perf_counter() - t0)
    return step_s, handover_s


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--step-ms", type=float, default=100.0)
    ap.add_argument("--uri", default="", help="an MLflow server to use (default: start one on loopback)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    server = None
    uri = args.uri
    with tempfile.TemporaryDirectory() as tmp:
        if not uri:
            server = LocalMlflowServer(Path(tmp) / "mlflow").start(timeout_s=300)
            uri = server.uri
        try:
            run_id = create_run(CreateTrackingRun(job_id=JobId(f"bench-{int(time.time())}"), uri=uri,
                                                  experiment="benchmark", run_name="tracking-overhead"))
            reps, a = _calibrate(args.step_ms)
            tracked_logger = MetricsLogger(uri, run_id=run_id)
            outage_logger = MetricsLogger(f"http://127.0.0.1:{_closed_port()}", run_id=run_id, retry_max_s=1.0)
            plain: list[float] = []
            tracked: list[float] = []
            handover: list[float] = []
            outage: list[float] = []
            handover_out: list[float] = []
            for first in range(1, args.steps + 1, args.block):
                n = min(args.block, args.steps + 1 - first)
                plain += _phase(n, reps, a, None, first)[0]
                st, ho = _phase(n, reps, a, tracked_logger, first)
                tracked += st
                handover += ho
                st, ho = _phase(n, reps, a, outage_logger, args.steps + first)
                outage += st
                handover_out += ho
            counts = tracked_logger.close(120)
            outage_logger.close(0)
        finally:
            if server is not None:
                server.stop()
    step_med = statistics.median(plain)
    hs = sorted(handover)
    out = {
        "steps": args.steps,
        "step_s_median": round(step_med, 4),
        "handover_us_mean": round(statistics.fmean(handover) * 1e6, 2),
        "handover_us_p99": round(hs[min(len(hs) - 1, int(0.99 * len(hs)))] * 1e6, 2),
        "handover_us_max": round(hs[-1] * 1e6, 2),
        "handover_ratio": round(statistics.fmean(handover) / step_med, 6),
        "handover_ratio_outage": round(statistics.fmean(handover_out) / step_med, 6),
        "step_ratio_tracked": round(statistics.median(tracked) / step_med, 4),
        "step_ratio_outage": round(statistics.median(outage) / step_med, 4),
        "logged": counts.logged,
        "lost": counts.lost,
        "goal_handover_ratio": 0.02,
    }
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:24s} {v}")


if __name__ == "__main__":
    main()
