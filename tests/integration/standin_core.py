"""A deliberately tiny stand-in for the decision core, used ONLY by the shell's plumbing test.

It speaks the core's interface (decide / state_to_records / state_from_records / State.empty) with the
core's own record types, and does just enough to exercise the shell: a submitted job launches its
nodes in the first priced pool, a preemption notice sends CheckpointCmd to the job's nodes, heartbeats
update last_seen. The real policy lives in orchestrator.core and is used by every other test.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from orchestrator import events as ev
from orchestrator.core.commands import Launch, SendToAgent
from orchestrator.core.inputs import JobSubmitted, NodeLaunched
from orchestrator.core.model import Job, Meta, Node, NodePhase, PoolStats, State, pool_record_key
from orchestrator.state import CoreApi

_r = msgspec.structs.replace


@dataclass(frozen=True)
class D:
    state: State
    commands: tuple = ()
    audit: tuple = ()
    dirty: frozenset = frozenset()


def decide(s: State, e: object, now: float) -> D:
    match e:
        case ev.PriceTick():
            ps = PoolStats(pool=e.pool, gpu_type=e.gpu_type, gpus_per_node=e.gpus_per_node, price_usd_h=e.price_usd_h,
                           on_demand_usd_h=e.on_demand_usd_h, price_ts=e.ts)
            return D(_r(s, pools=s.pools.set(e.pool.name, ps)), dirty=frozenset({pool_record_key(e.pool.name)}))
        case JobSubmitted():
            pool = next(iter(s.pools.values())).pool
            ids = tuple(f"{e.job_id}-n{i}" for i in range(e.spec.nodes))
            job = Job(job_id=e.job_id, spec=e.spec, phase_ts=now, submitted_ts=now, target_nodes=e.spec.nodes,
                      nodes=ids, cost_ts=now)
            nodes = s.nodes
            for n in ids:
                nodes = nodes.set(n, Node(node_id=n, job_id=e.job_id, pool=pool, pool_name=pool.name,
                                          token=f"{e.job_id}-l1", phase_ts=now, requested_ts=now))
            cmd = Launch(job_id=e.job_id, pool=pool, node_ids=ids, token=f"{e.job_id}-l1")
            return D(_r(s, jobs=s.jobs.set(e.job_id, job), nodes=nodes), (cmd,),
                     dirty=frozenset({f"job.{e.job_id}", *(f"node.{n}" for n in ids)}))
        case NodeLaunched():
            n = _r(s.nodes[e.node_id], phase=NodePhase.BOOTING, instance_id=e.instance_id)
            return D(_r(s, nodes=s.nodes.set(e.node_id, n)), dirty=frozenset({f"node.{e.node_id}"}))
        case ev.Heartbeat() if e.node_id in s.nodes:
            n = _r(s.nodes[e.node_id], last_seen=now, hb_seq=e.seq)
            return D(_r(s, nodes=s.nodes.set(e.node_id, n)), dirty=frozenset({f"node.{e.node_id}"}))
        case ev.PreemptionNotice() if e.node_id in s.nodes:
            job = s.jobs[s.nodes[e.node_id].job_id]
            cmds = tuple(SendToAgent(command=ev.CheckpointCmd(
                cmd_id=f"{n}-c{e.id}", fencing_token=s.meta.fencing_token, node_id=n, job_id=job.job_id,
                issued_ts=now, reason="preemption_notice", deadline_ts=e.deadline_ts)) for n in job.nodes)
            return D(s, cmds)
        case ev.CommandAck():
            return D(s)
    return D(s)


_enc = msgspec.json.Encoder()
_KINDS = {"job": Job, "node": Node, "pool": PoolStats}


def state_to_records(s: State, keys=None) -> dict[str, bytes]:
    out = {}
    for k in keys or ():
        kind, _, ident = k.partition(".")
        if kind == "job":
            out[k] = _enc.encode(s.jobs[ident]) if ident in s.jobs else b""
        elif kind == "node":
            out[k] = _enc.encode(s.nodes[ident]) if ident in s.nodes else b""
        elif kind == "pool":
            p = next((p for name, p in s.pools.items() if pool_record_key(name) == k), None)
            out[k] = _enc.encode(p) if p else b""
    return out


def state_from_records(records) -> State:
    s = State.empty()
    for k, v in records.items():
        kind = k.partition(".")[0]
        rec = msgspec.json.decode(v, type=_KINDS[kind]) if kind in _KINDS else None
        if kind == "job":
            s = _r(s, jobs=s.jobs.set(rec.job_id, rec))
        elif kind == "node":
            s = _r(s, nodes=s.nodes.set(rec.node_id, rec))
        elif kind == "pool":
            s = _r(s, pools=s.pools.set(rec.pool.name, rec))
    return s


CORE = CoreApi(decide=decide, state_to_records=state_to_records, state_from_records=state_from_records,
               empty_state=lambda: State(jobs=State.empty().jobs, nodes=State.empty().nodes,
                                         pools=State.empty().pools, meta=Meta()))
