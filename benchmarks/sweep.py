"""A sweep of 8 trials x 2 nodes with 3 injected preemptions, with pruning and without: node time compared.

Runs the same sweep twice, with the same seed (the same trial parameters in the same order) and the same
injections: once with the median pruner and once without pruning.

- Default: local nodes (``simulations.sweeps_local``). orchd runs in-process with the local provider, so
  each node is an ``orch-agent`` process running ``simulations.sweep_trainer`` ranks, with embedded NATS,
  Optuna's storage in SQLite and the controller service. 3 preemptions are injected with ``nodes.preempt``
  (a 5 s notice, then the kill).
- ``--simulated``: simulated agents on the fake cloud against an orchd subprocess
  (``simulations.sweeps.run_drill``). This adds kill -9 of orchd with a node vanishing while it is down,
  and a controller restart.

The trials' loss depends on their parameter ``x`` and the step. Node time is sampled from the live nodes.
``steps_run`` is the trials' steps as far as each got.

    python benchmarks/sweep.py                 # local nodes, a table
    python benchmarks/sweep.py --simulated     # simulated agents, orchd killed and restarted
    python benchmarks/sweep.py --json          # {"pruned": {...}, "unpruned": {...}, "node_time_ratio": ...}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulations.sweeps import DrillConfig, run_drill
from simulations.sweeps_local import run_local
from wire.logs import configure

KEYS = ("trials", "complete", "pruned", "failed", "resumed", "node_seconds", "steps_run", "best_value", "seconds")
SIM_KEYS = ("notices", "vanished", "orchd_kills", "controller_restarts")


async def _one(args: argparse.Namespace, pruner: str, work: Path) -> dict[str, Any]:
    if args.simulated:
        cfg = DrillConfig(trials=args.trials, parallelism=args.parallelism, nodes=args.nodes,
                          total_steps=args.steps, pruner=pruner, seed=args.seed, notices=args.preemptions)
        r = asdict(await run_drill(cfg, work))
        return {k: r[k] for k in (*KEYS, *SIM_KEYS, "problems")}
    r = asdict(await run_local(work, trials=args.trials, parallelism=args.parallelism, nodes=args.nodes,
                               steps=args.steps, pruner=pruner, seed=args.seed, preemptions=args.preemptions))
    return {k: r[k] for k in (*KEYS, "preemptions", "problems")}


async def _both(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"nodes": "simulated agents" if args.simulated else "local nodes"}
    for label, pruner in (("pruned", args.pruner), ("unpruned", "none")):
        out[label] = await _one(args, pruner, work / label)
        out[label]["node_hours"] = round(out[label]["node_seconds"] / 3600.0, 5)
    a, b = out["pruned"]["node_seconds"], out["unpruned"]["node_seconds"]
    out["node_time_ratio"] = round(a / b, 3) if b else None
    sa, sb = out["pruned"]["steps_run"], out["unpruned"]["steps_run"]
    out["steps_ratio"] = round(sa / sb, 3) if sb else None
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    out["machine"] = f"{platform.machine()} {os.cpu_count()} cpus"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--simulated", action="store_true", help="simulated agents, orchd killed and restarted")
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--parallelism", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--steps", type=int, default=100, help="steps per trial (0.1 s each)")
    ap.add_argument("--preemptions", type=int, default=3)
    ap.add_argument("--pruner", default="median", choices=("median", "successive_halving"))
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    configure(level="error", stream=sys.stderr)  # the controller's logs: errors only
    with tempfile.TemporaryDirectory(prefix="orch-sweep-bench-") as tmp:
        res = anyio.run(_both, args, Path(tmp), backend="asyncio")
    if args.json:
        print(json.dumps(res))
        return
    print(f"sweep of {args.trials} trials x {args.nodes} {res['nodes']}, {args.steps} steps, {args.preemptions} "
          f"preemptions, pruner {args.pruner} vs none (seed {args.seed}; {res['machine']}, load {res['load_avg_1m']})")
    print(f"{'':>20} {'pruned':>12} {'unpruned':>12}")
    keys = [k for k in res["pruned"] if k != "problems"]
    for k in keys:
        print(f"{k:>20} {res['pruned'][k]!s:>12} {res['unpruned'][k]!s:>12}")
    print(f"{'node time ratio':>20} {res['node_time_ratio']!s:>12}  (with pruning / without)")
    print(f"{'steps ratio':>20} {res['steps_ratio']!s:>12}  (with pruning / without)")
    for label in ("pruned", "unpruned"):
        for p in res[label]["problems"]:
            print(f"problem ({label}): {p}")


if __name__ == "__main__":
    main()
