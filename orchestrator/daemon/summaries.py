"""The admin API's summaries of the state: jobs, sweeps, nodes, pools and counts, as orchctl shows them.

Pure functions over the immutable state (through the core's read-only views, ``orchestrator.core.views``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec

import wire as ev
from orchestrator.core import Job, JobPhase, Node, PoolStats, State, job_cost_usd, job_step
from orchestrator.core.feasibility import wake_up
from orchestrator.core.model import safe_token
from orchestrator.core.views import sweep_view
from providers.reaper import KnownNode


def _s(value: Any) -> str:
    return str(getattr(value, "value", value))


_WAITING = frozenset({JobPhase.PENDING, JobPhase.PLACING, JobPhase.RESIZING})


def job_summary(state: State, job: Job, now: float) -> dict[str, Any]:
    """A job for orchctl: ``cost_usd`` is accrued up to ``now`` (closed nodes plus the live ones);
    ``step`` is the job's current step (``orchestrator.core.job_step``)."""
    spec = job.spec
    live = len(job.nodes)
    return {
        "job_id": job.job_id,
        "name": spec.name,
        "phase": _s(job.phase),
        "reason": job.reason,
        "nodes": live,
        "target_nodes": job.target_nodes,
        "generation": job.generation,
        "step": job_step(state, job.job_id),
        "total_steps": spec.total_steps,
        "committed_step": job.committed_step,
        "zone": job.zone,
        "cost_usd": round(job_cost_usd(state, job.job_id, now), 4),
        "budget_usd": spec.budget_usd,
        "failures": job.failures,
        "sweep_id": None if isinstance(job.spec.sweep_id, msgspec.UnsetType) else job.spec.sweep_id,
        "best_effort": job.spec.best_effort is True,  # accepted although its deadline was out of reach
        "final_loss": None if isinstance(job.final_loss, msgspec.UnsetType) else job.final_loss,
        # a restart hold in force (docs/core.md, "Restart hold"): why, until when, how many in a row
        "hold": {"reason": job.hold_reason, "until": job.hold_until, "holds": job.holds}
        if job.held(now) else None,
        # a job not training: why, and the earliest time that changes without an event (None: on an event)
        "waiting": dict(zip(("reason", "until"), wake_up(job, state.pools, state.config, now), strict=True))
        if job.phase in _WAITING else None,
    }


def sweep_summary(state: State, sweep_id: str, now: float) -> dict[str, Any]:
    """The sweep a job belongs to, as orchd holds it to its cap (core/sweeps.py): the cap (the smallest
    budget and earliest deadline its jobs carry), the cost of all its jobs so far, and why it takes no new
    trial (``closed``: ``sweep_budget`` / ``sweep_deadline``, None while open)."""
    v = sweep_view(state, sweep_id, now)
    return {"id": sweep_id, "budget_usd": v.budget_usd, "deadline_ts": v.deadline_ts,
            "cost_usd": round(v.cost_usd, 4), "jobs": v.jobs, "closed": v.closed}


def node_summary(node: Node, now: float) -> dict[str, Any]:
    return {
        "node_id": node.node_id,
        "job_id": node.job_id,
        "phase": _s(node.phase),
        "pool": node.pool_name,
        "instance_id": node.instance_id,
        "generation": node.generation,
        "rank": node.rank,
        "step": node.step,
        "loss": node.loss,  # the last loss its heartbeat reported (sweeps read it: docs/sweeps.md)
        "heartbeat_age_s": round(now - node.last_seen, 1) if node.last_seen else None,
        "notice_deadline": node.notice_deadline,
    }


def pool_summary(pool: PoolStats) -> dict[str, Any]:
    return {
        "pool": pool.pool.name,
        "gpu_type": pool.gpu_type,
        "gpus_per_node": pool.gpus_per_node,
        "price_usd_h": pool.price_usd_h,
        "on_demand_usd_h": pool.on_demand_usd_h,
        "ratio": round(pool.price_usd_h / pool.on_demand_usd_h, 3)
        if pool.price_usd_h and pool.on_demand_usd_h else None,
        "preemptions": round(pool.preemptions, 3),
        "exposure_h": round(pool.exposure_h, 2),
        "backoff_until": pool.backoff_until or None,
        "price_ts": pool.price_ts,
    }


def record_dict(record: Any) -> Any:
    return msgspec.to_builtins(record)


def counts(state: State) -> dict[str, Any]:
    jobs = Counter(_s(j.phase) for j in state.jobs.values())
    nodes = Counter(_s(n.phase) for n in state.nodes.values())
    return {"jobs": dict(jobs), "nodes": dict(nodes), "pools": len(state.pools)}


def new_job_id(spec: ev.JobSpec, entropy: str) -> str:
    return f"{safe_token(spec.name)[:40]}-{entropy}"


def known_nodes(state: State) -> dict[str, KnownNode]:
    """node id -> providers.reaper.KnownNode(job phase, instance id): what the reaper matches against."""
    known: dict[str, KnownNode] = {}
    for node in state.nodes.values():
        job = state.jobs.get(node.job_id)
        known[node.node_id] = KnownNode(job_state=_s(job.phase) if job is not None else "deleted",
                                        instance_id=node.instance_id)
    return known
