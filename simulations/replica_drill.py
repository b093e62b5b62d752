"""Replica drills with real orch-agent nodes and gloo ranks: nodes killed without notice, one at a time, then
two neighbours at once.

    python -m simulations.replica_drill --json [--steps 160] [--every 1] [--singles 2] [--no-neighbours]
                                        [--gap 10] [--state-dir DIR]

The machinery of ``orchctl demo`` (embedded NATS, orchd with the real core, 3 local orch-agent nodes running
the real tiny GPT trainer on CPU, ``replica_every = k``), with this scenario instead of the demo's:

1. ``--singles`` times: once the job runs on 3 nodes again, kill -9 one node of the running generation
   (its agent, its ranks, its replica holder; no notice). Each recovery must lose <= k + 1 steps, from
   the replicas in the survivors' memory (resharded when the survivors start alone).
2. Unless ``--no-neighbours``, once it runs on 3 nodes again: kill -9 two neighbours at once (node rank 0
   and its buddy, the node orchd told it: rank 0's shard and its only copy go together). The recovery must
   come from the durable checkpoint.

Then the job must finish, every sample once, and the per-step losses must equal an uninterrupted run of
the same seed within LOSS_TOL (as the demo's test; that run goes on beside the drill). Each recovery's
source is read from the next generation's rank logs (``replica_resumed`` or ``resumed_from``). Prints one
JSON object; exit 0 when every check passed. tests/e2e/test_replica_drill.py runs it short.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio

from orchestrator.cli.demo import JOB_ID, DemoOptions, View, _gen_nodes, _wait, run_demo
from orchestrator.cli.demo_report import Injection, load_step_logs, loss_by_step
from orchestrator.core.replicas import buddies
from wire import Market, PoolKey

LOSS_TOL = 1e-4


def _full(view: View, after_gen: int, after_step: int, committed: bool = False) -> Any:
    """Running on 3 nodes again past ``after_step`` (and, ``committed``, with a durable checkpoint to go back to)."""
    return lambda: (view.job.get("phase") == "running" and view.job.get("generation", 0) > after_gen
                    and len(_gen_nodes(view)) == 3 and view.job.get("step", 0) >= after_step
                    and (not committed or int(view.job.get("committed_step") or 0) > 0))


def _buddy_pair(ranked: list[dict[str, Any]]) -> list[str]:
    """Node rank 0 and its buddy (orchd's choice from the nodes' pools, orchestrator.core.replicas.buddies)."""
    pools = []
    for n in ranked:
        cloud, region, zone, rest = str(n["pool"]).split("/", 3)
        itype, market = rest.rsplit("/", 1)
        pools.append(PoolKey(cloud=cloud, region=region, zone=zone, instance_type=itype, market=Market(market)))
    return [ranked[0]["node_id"], ranked[buddies(pools)[0]]["node_id"]]


def scenario(singles: int, neighbours: bool = True, gap: int = 10) -> Any:
    """Kill ``singles`` single nodes, then (``neighbours``) a node and its buddy; each kill ``gap`` steps after
    the job runs on 3 nodes again."""

    async def run(opts: DemoOptions, provider: Any, view: View, injections: list[Injection],
                  finished: anyio.Event) -> None:
        gen, step = 0, gap
        for i in range(singles + (1 if neighbours else 0)):
            if not await _wait(view, finished, _full(view, gen, step, committed=i >= singles)):
                return
            gen, step = view.job["generation"], view.job.get("step", 0) + gap
            ranked = sorted(_gen_nodes(view), key=lambda n: n["rank"])
            victims = [ranked[-1]["node_id"]] if i < singles else _buddy_pair(ranked)
            for v in victims:  # two at once: both before either's loss is noticed
                await anyio.to_thread.run_sync(provider.vanish, v)
            kind = "single" if i < singles else "neighbours"
            for v in victims:
                injections.append(Injection("vanished", time.time(), v, f"{kind}: kill -9, no notice"))
            view.event(f"DRILL {kind}: {victims} killed")

    return run


def _source(state_dir: Path, gen: int) -> str:
    """How generation ``gen`` started, from its ranks' logs: replica, replica_resharded, durable or fresh."""
    lines = [line for f in (state_dir / "nodes").glob(f"*/logs/{JOB_ID}/gen{gen}-rank*.log")
             for line in f.read_text(errors="replace").splitlines()]
    if any("replica_resumed" in x and "saved_world_size=3 world_size=3" not in x for x in lines):
        return "replica_resharded"
    if any("replica_resumed" in x for x in lines):
        return "replica"
    return "durable" if any("resumed_from dir=" in x for x in lines) else "fresh"


def _reference(tmp: Path, steps: int, seed: int) -> dict[int, float]:
    tmp.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "ORCH_JOB_ID": "ref", "ORCH_GENERATION": "1", "ORCH_CKPT_URL": f"file://{tmp / 'ck'}",
           "ORCH_RESUME_FROM": "", "ORCH_TOTAL_STEPS": str(steps), "ORCH_STEP_LOG": str(tmp / "steps-{rank}.jsonl"),
           "ORCH_TRAINER_ARGS": f'{{"size": "tiny", "seed": {seed}, "ckpt_every": 0}}', "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "trainer.launch", "--nproc", "3", "--", sys.executable, "-m", "trainer"],
                   cwd=tmp, env=env, check=True, timeout=600, stdout=subprocess.DEVNULL)
    return loss_by_step(load_step_logs(sorted(tmp.glob("steps-*.jsonl"))))


def drill(a: argparse.Namespace) -> dict[str, Any]:
    state = Path(a.state_dir or tempfile.mkdtemp(prefix="orch-replica-drill-")).resolve()
    opts = DemoOptions(steps=a.steps, replica_every=a.every, spike=False, timeout_s=a.timeout, state_dir=str(state),
                       keep=True, ckpt_interval_s=a.ckpt_interval_s)
    reference: dict[int, float] = {}
    ref = threading.Thread(target=lambda: reference.update(_reference(state / "ref", a.steps, opts.seed)), daemon=True)
    ref.start()  # the uninterrupted run, beside the drill (it waits on boots and heartbeats most of the time)
    result = anyio.run(lambda: run_demo(opts, scenario=scenario(a.singles, a.neighbours, a.gap)), backend="asyncio")
    ref.join(timeout=600)
    r = result.report
    hits = sorted(r["preemptions"] + r["node_failures"], key=lambda e: e["ts"])
    recoveries = []
    for e in hits:
        kind = next(i.detail.split(":")[0] for i in result.injections if i.node == e["node"])
        nxt = e.get("next_generation")
        recoveries.append({"kind": kind, "node": e["node"], "lost_steps": e.get("lost_steps"),
                           "recovery_s": e.get("recovery_s"), "generation": nxt,
                           "source": _source(state, nxt) if nxt else None})
    got = loss_by_step(load_step_logs(result.step_logs))
    worst = max((abs(got[s] - reference[s]) for s in reference if s in got), default=None)
    singles = [x for x in recoveries if x["kind"] == "single"]
    pair = [x for x in recoveries if x["kind"] == "neighbours"]
    checks = {
        "job_succeeded": r["job_succeeded"],
        "singles_within_k_plus_1": len(singles) == a.singles and all(
            x["lost_steps"] is not None and x["lost_steps"] <= a.every + 1 and x["source"] in (
                "replica", "replica_resharded") for x in singles),
        "neighbours_from_durable": (bool(pair) and all(x["source"] == "durable" for x in pair)) if a.neighbours
        else not pair,
        "sample_order_exact": r["sample_order_exact"],
        "losses_match_reference": worst is not None and worst <= LOSS_TOL and sorted(got) == sorted(reference),
    }
    return {"checks": checks, "passed": all(checks.values()), "recoveries": recoveries, "every": a.every,
            "max_loss_diff": worst, "steps": a.steps, "generations": r["generations"], "wall_s": r["wall_s"],
            "state_dir": str(state)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--singles", type=int, default=2)
    ap.add_argument("--no-neighbours", dest="neighbours", action="store_false",
                    help="no kill of two neighbours at once (the single kills only)")
    ap.add_argument("--gap", type=int, default=10, help="steps on 3 nodes before each kill")
    ap.add_argument("--ckpt-interval-s", type=float, default=4.0)
    ap.add_argument("--timeout", type=float, default=420.0)
    ap.add_argument("--state-dir", default=None)
    out = drill(ap.parse_args())
    print(json.dumps(out) if "--json" in sys.argv else json.dumps(out, indent=2))
    sys.exit(0 if out["passed"] else 1)


if __name__ == "__main__":
    main()
