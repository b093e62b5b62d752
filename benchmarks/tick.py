"""CPU cost of one Tick of the decision core, and how it grows with idle jobs.

A fleet of N nodes in jobs of 8 (all training, built through ``decide``), optionally with 9x as many
*idle* jobs on top (10x the jobs in all): half of them waiting for a GPU type no pool offers (pending),
half finished (cancelled, kept as history). Every node heartbeats every 2 s (staggered; not timed), one
Tick per simulated second (timed: ``time.process_time`` around ``decide``). A warm-up of
``--warmup-s`` simulated seconds (the first two price evaluations of every job - the first re-ranks every
pool, the second too, once the first prices have held ``price_confirm_s`` -, the index settling) is not
measured; then ``--seconds`` Ticks are. Printed: the mean CPU per Tick (all Ticks measured / their
count), the median and the largest.

    python benchmarks/tick.py --json                       # this tree: 1x and 10x jobs
    python benchmarks/tick.py --json --base /tmp/base      # and an older tree, same run: ratios
    python benchmarks/tick.py --json --sweep-jobs 8        # 8 of the running jobs form a sweep

With ``--base DIR`` each configuration runs in its own process (this tree with its own path, the other
with ``PYTHONPATH=DIR``), alternating, and the report gives the ratios within the run:
``after_vs_before_1x`` / ``_10x`` (this tree's mean Tick CPU over the other's) and, per tree,
``idle_growth`` (mean Tick CPU with 10x jobs over 1x).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _worker(nodes: int, idle_factor: int, warmup_s: int, seconds: int, sweep_jobs: int = 0) -> dict[str, Any]:
    """Runs inside the process whose sys.path picks the tree under test."""
    t0 = time.process_time()
    state, base, now = _running_jobs(nodes, sweep_jobs)
    running = len(state.jobs)
    idle = running * (idle_factor - 1)
    if idle:
        state = _with_idle_jobs(state, base, idle, now)
    build_s = time.process_time() - t0
    costs, commands, state = _measure(state, now, warmup_s, seconds)
    return {
        "jobs": len(state.jobs), "running_jobs": running, "idle_jobs": len(state.jobs) - running,
        "nodes": len(state.nodes),
        "ticks": len(costs), "tick_cpu_ms_mean": round(1000 * sum(costs) / len(costs), 3),
        "tick_cpu_ms_p50": round(1000 * statistics.median(costs), 3),
        "tick_cpu_ms_max": round(1000 * max(costs), 3), "tick_commands": commands,
        "build_cpu_s": round(build_s, 2),
    }


def _running_jobs(nodes: int, sweep_jobs: int) -> tuple[Any, Any, float]:
    """A state with 18 priced pools and ``nodes // 8`` jobs of 8 nodes each, training (the first
    ``sweep_jobs`` of them in one sweep); the job spec they share; the clock."""
    import msgspec

    from orchestrator.core import State, decide
    from orchestrator.core.commands import Launch
    from orchestrator.core.inputs import JobSubmitted, NodeLaunched
    from wire import (
        CheckpointPolicy,
        GenerationStarted,
        InstanceId,
        JobId,
        JobSpec,
        Market,
        NodeRegistered,
        PoolKey,
        PriceTick,
    )

    per_job = 8
    zones = [f"us-east-1{c}" for c in "abcdef"]
    types = ["p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge"]
    state, now = State.empty(), 1_000_000.0
    for i, pk in enumerate(PoolKey(cloud="aws", region="us-east-1", zone=z, instance_type=t, market=Market.SPOT)
                           for z in zones for t in types):
        state = decide(state, PriceTick(id=f"p{i}", pool=pk, gpu_type="H100", gpus_per_node=8,
                                        price_usd_h=8.0 + i * 0.1, on_demand_usd_h=40.0, ts=now), now).state
    base = JobSpec(name="bench", total_steps=10**7, gpu_type="H100", gpus_per_node=8, nodes=per_job,
                   nodes_min=per_job // 2, nodes_max=per_job, checkpoint=CheckpointPolicy(url="s3://b/ckpt"))
    for j in range(nodes // per_job):
        jid = JobId(f"job{j:06d}")
        sweep = {"sweep_id": "bench-sweep", "sweep_budget_usd": 1e9} if j < sweep_jobs else {}
        d = decide(state, JobSubmitted(job_id=jid, spec=msgspec.structs.replace(
            base, checkpoint=CheckpointPolicy(url=f"s3://b/ckpt/{jid}"), **sweep)), now)
        state = d.state
        for c in d.commands:
            if isinstance(c, Launch):
                for nid in c.node_ids:
                    state = decide(state, NodeLaunched(node_id=nid, job_id=jid, instance_id=InstanceId(f"i-{nid}"),
                                                       pool=c.pool, token=c.token), now).state
                for k, nid in enumerate(c.node_ids):
                    state = decide(state, NodeRegistered(id=f"r{nid}", node_id=nid, host=f"10.{j % 250}.0.{k}",
                                                         ts=now), now).state
                state = decide(state, GenerationStarted(id=f"g{jid}", node_id=c.node_ids[0], job_id=jid,
                                                        generation=1, first_step=1, ts=now), now).state
    return state, base, now


def _with_idle_jobs(state: Any, base: Any, idle: int, now: float) -> Any:
    """``state`` with ``idle`` more jobs, waiting and finished in turn: one of each through decide, then
    cloned (ids and roots of their own)."""
    import immutables
    import msgspec

    from orchestrator.core import State, decide
    from orchestrator.core.inputs import JobCancelled, JobSubmitted
    from wire import CheckpointPolicy, JobId

    wait = msgspec.structs.replace(base, gpu_type="B200", checkpoint=CheckpointPolicy(url="s3://b/w/t"))
    state = decide(state, JobSubmitted(job_id=JobId("wait-t"), spec=wait), now).state
    state = decide(state, JobSubmitted(job_id=JobId("done-t"), spec=msgspec.structs.replace(
        wait, checkpoint=CheckpointPolicy(url="s3://b/d/t"))), now).state
    state = decide(state, JobCancelled(job_id=JobId("done-t")), now).state
    templates = [state.jobs["wait-t"], state.jobs["done-t"]]
    assert templates[0].phase == "pending" and templates[1].phase == "cancelled", templates
    jobs = state.jobs.mutate()
    for k in range(idle):
        tpl = templates[k % 2]
        iid = JobId(f"idle{k:06d}")
        jobs[iid] = msgspec.structs.replace(tpl, job_id=iid, spec=msgspec.structs.replace(
            tpl.spec, checkpoint=CheckpointPolicy(url=f"s3://b/i/{iid}")))
    mapping: immutables.Map[str, Any] = jobs.finish()
    return State(mapping, state.nodes, state.pools, state.meta)  # a state built by hand


def _measure(state: Any, now: float, warmup_s: int, seconds: int) -> tuple[list[float], int, Any]:
    """Heartbeats of half the nodes and one Tick per simulated second: each measured Tick's CPU time, the
    commands of those Ticks, the state after."""
    from orchestrator.core import decide
    from orchestrator.core.inputs import Tick
    from wire import AgentState, Heartbeat, NodeId

    node_ids = sorted(state.nodes.keys())

    def beat(state: Any, second: int) -> Any:
        for i in range(second % 2, len(node_ids), 2):
            nid = node_ids[i]
            n = state.nodes.get(nid)
            if n is not None:
                state = decide(state, Heartbeat(node_id=NodeId(nid), seq=n.hb_seq + 1, generation=n.generation,
                                                step=n.step + 1, state=AgentState.TRAINING, ts=now), now).state
        return state

    costs: list[float] = []
    commands = 0
    for second in range(warmup_s + seconds):
        now += 1.0
        state = beat(state, second)
        t = time.process_time()
        d = decide(state, Tick(), now)
        dt = time.process_time() - t
        state = d.state
        if second >= warmup_s:
            costs.append(dt)
            commands += len(d.commands)
    return costs, commands, state


def _run(tree: Path, nodes: int, idle_factor: int, warmup_s: int, seconds: int, sweep_jobs: int) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    env["PYTHONHASHSEED"] = "0"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--nodes", str(nodes),
           "--idle-factor", str(idle_factor), "--warmup-s", str(warmup_s), "--seconds", str(seconds),
           "--sweep-jobs", str(sweep_jobs)]
    out = subprocess.run(cmd, env=env, cwd=str(tree), capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"worker failed for {tree} (x{idle_factor}):\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=10_000)
    ap.add_argument("--idle-factor", type=int, default=10, help="the second configuration: this many x the jobs")
    ap.add_argument("--warmup-s", type=int, default=150)
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--base", type=Path, default=None, help="an older tree to measure in the same run")
    ap.add_argument("--sweep-jobs", type=int, default=0,
                    help="this many of the running jobs form one sweep (with a total budget): the sweep pass")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(_worker(a.nodes, a.idle_factor, a.warmup_s, a.seconds, a.sweep_jobs)))
        return
    trees = {"after": ROOT} if a.base is None else {"before": a.base.resolve(), "after": ROOT}
    report: dict[str, Any] = {
        "benchmark": "tick", "nodes": a.nodes, "idle_factor": a.idle_factor, "warmup_s": a.warmup_s,
        "seconds": a.seconds, "sweep_jobs": a.sweep_jobs, "python": platform.python_version(),
        "machine": platform.machine(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    for factor in (1, a.idle_factor):
        for name, tree in trees.items():  # alternating: both trees see the same load
            report[f"{name}_{factor}x"] = _run(tree, a.nodes, factor, a.warmup_s, a.seconds, a.sweep_jobs)
    for name in trees:
        report[f"{name}_idle_growth"] = round(
            report[f"{name}_{a.idle_factor}x"]["tick_cpu_ms_mean"] / report[f"{name}_1x"]["tick_cpu_ms_mean"], 3)
    if a.base is not None:
        for factor in (1, a.idle_factor):
            report[f"after_vs_before_{factor}x"] = round(
                report[f"after_{factor}x"]["tick_cpu_ms_mean"] / report[f"before_{factor}x"]["tick_cpu_ms_mean"], 3)
    report["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    if a.json:
        print(json.dumps(report))
        return
    for key, val in report.items():
        print(f"{key}: {val}")


if __name__ == "__main__":
    main()
