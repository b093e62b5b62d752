"""Micro-benchmark of the pure decision core: events per second through ``decide`` alone.

Builds a fleet of N nodes (jobs of 8 nodes, all training) through decide itself, then replays a
simulated-seconds mix: every node heartbeats once per second, one Tick per second, price ticks for the
pools, and an occasional preemption notice (with its checkpoint + replacement launch). Only the
``decide`` calls are timed (events are prebuilt).

    python benchmarks/core_decide.py --json            # {"events_per_s": ..., ...}
    python benchmarks/core_decide.py --nodes 10000 --seconds 5
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.core import CoreEvent, State, decide
from orchestrator.core.commands import Launch
from orchestrator.core.inputs import JobSubmitted, NodeLaunched, Tick
from wire import (
    AgentState,
    CheckpointPolicy,
    GenerationStarted,
    Heartbeat,
    InstanceId,
    JobId,
    JobSpec,
    Market,
    NodeId,
    NodeRegistered,
    PoolKey,
    PreemptionNotice,
    PriceTick,
)

ZONES = [f"us-east-1{c}" for c in "abcdef"]
TYPES = ["p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge"]


def pools() -> list[PoolKey]:
    return [
        PoolKey(cloud="aws", region="us-east-1", zone=z, instance_type=t, market=Market.SPOT)
        for z in ZONES
        for t in TYPES
    ]


def build(n_nodes: int, per_job: int) -> tuple[State, float]:
    state, now = State.empty(), 1_000_000.0
    for i, pk in enumerate(pools()):
        state = decide(state, PriceTick(id=f"p{i}", pool=pk, gpu_type="H100", gpus_per_node=8,
                                        price_usd_h=8.0 + i * 0.1, on_demand_usd_h=40.0, ts=now), now).state
    spec = JobSpec(name="bench", total_steps=10**7, gpu_type="H100", gpus_per_node=8, nodes=per_job,
                   nodes_min=per_job // 2, nodes_max=per_job,
                   checkpoint=CheckpointPolicy(url="s3://b/ckpt"))
    for j in range(n_nodes // per_job):
        jid = JobId(f"job{j}")
        job_spec = msgspec.structs.replace(spec, checkpoint=CheckpointPolicy(url=f"s3://b/ckpt/{jid}"))  # one root each
        d = decide(state, JobSubmitted(job_id=jid, spec=job_spec), now)
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
    return state, now


def workload(
    state: State, now: float, seconds: int, prices_per_s: int, notices_per_s: float
) -> list[tuple[CoreEvent, float]]:
    events: list[tuple[CoreEvent, float]] = []
    nodes = [NodeId(nid) for nid in sorted(state.nodes.keys())]
    pks = pools()
    notice_every = int(1 / notices_per_s) if notices_per_s > 0 else 0
    for s in range(seconds):
        t = now + s + 1
        for k, nid in enumerate(nodes):
            events.append((Heartbeat(node_id=nid, seq=s + 1, ts=t, state=AgentState.TRAINING, generation=1,
                                     step=100 * s + 1, loss=2.0, step_time_s=1.0), t + k * 1e-6))
        events.append((Tick(), t + 0.5))
        for p in range(prices_per_s):
            pk = pks[(s * prices_per_s + p) % len(pks)]
            events.append((PriceTick(id=f"x{s}-{p}", pool=pk, gpu_type="H100", gpus_per_node=8,
                                     price_usd_h=8.0 + ((s + p) % 7) * 0.05, on_demand_usd_h=40.0, ts=t), t + 0.6))
        if notice_every and s % notice_every == 0:
            nid = nodes[(s * 7919) % len(nodes)]
            events.append((PreemptionNotice(id=f"n{s}", node_id=nid, cloud="aws", deadline_ts=t + 120,
                                            observed_ts=t), t + 0.7))
    return events


def run(n_nodes: int, seconds: int, prices_per_s: int, notices_per_s: float) -> dict:
    t0 = time.perf_counter()
    state, now = build(n_nodes, 8)
    build_s = time.perf_counter() - t0
    events = workload(state, now, seconds, prices_per_s, notices_per_s)
    kinds: dict[str, int] = {}
    for ev, _ in events:
        kinds[type(ev).__name__] = kinds.get(type(ev).__name__, 0) + 1
    kind_cpu: dict[str, float] = dict.fromkeys(kinds, 0.0)  # heartbeats: timed apart below (no clock per event)
    clock = time.process_time
    t0, c0 = time.perf_counter(), clock()
    for ev, ts in events:
        if type(ev) is Heartbeat:
            state = decide(state, ev, ts).state
        else:
            c = clock()
            state = decide(state, ev, ts).state
            kind_cpu[type(ev).__name__] += clock() - c
    total, cpu = time.perf_counter() - t0, clock() - c0
    # heartbeat-only timing on the final state
    hbs = [
        Heartbeat(node_id=NodeId(nid), seq=10**9 + k, ts=now, state=AgentState.TRAINING, generation=1, step=10**6 + k,
                  loss=1.5, step_time_s=1.0)
        for k, nid in enumerate(sorted(state.nodes.keys())[:20000])
        if state.nodes[nid].generation == 1
    ]
    c1 = time.process_time()
    for ev in hbs:
        decide(state, ev, now + seconds + 2)
    hb_ns = (time.process_time() - c1) / max(len(hbs), 1) * 1e9
    return {
        "events_per_s": round(len(events) / total),  # wall clock: depends on what else the machine runs
        "events_per_cpu_s": round(len(events) / cpu),  # CPU time of this process: the load-independent figure
        "events": len(events),
        "seconds_timed": round(total, 3),
        "cpu_seconds": round(cpu, 3),
        "nodes": len(state.nodes),
        "jobs": len(state.jobs),
        "mix": kinds,
        "heartbeat_cpu_us": round(hb_ns / 1000, 2),
        # CPU per decide() call by event kind (Tick: the O(jobs) timer pass over every job)
        "cpu_ms_per_event": {k: round(kind_cpu[k] / kinds[k] * 1000, 3) for k in sorted(kinds) if k != "Heartbeat"},
        "build_s": round(build_s, 2),
        "python": platform.python_version(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=10_000)
    ap.add_argument("--seconds", type=int, default=20, help="simulated seconds of traffic")
    ap.add_argument("--prices-per-s", type=int, default=20)
    ap.add_argument("--notices-per-s", type=float, default=0.2)
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = ap.parse_args()
    res = run(a.nodes, a.seconds, a.prices_per_s, a.notices_per_s)
    if a.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:>14}: {v}")


if __name__ == "__main__":
    main()
