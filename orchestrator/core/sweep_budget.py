"""A sweep's budget, reserved: what the sweep spent, what its live trials are committed to, what a launch adds.

Role: the jobs of a sweep (``JobSpec.sweep_id``) share the sweep's total budget (the smallest
``sweep_budget_usd`` any of them carries, ``cap_of``). The Tick's stop (sweeps.py) ends them near it; this
module keeps a launch from going over it in the first place (docs/sweeps.md, "Budget and deadline"):

- **Spent**: ``cost_now`` of every job of the sweep, ended ones included (their termination tails booked).
- **Committed**: every live job's billed nodes - a termination tail at the worst price (spot may rise to
  on-demand) plus one checkpoint and two Ticks at the current price, like ``policy.check_budget`` - and
  every node launched but not billed yet (``REQUESTED``): boot, one checkpoint, two Ticks and the tail, at
  its pool's prices.
- **This launch**: ``count`` new nodes in pool ``ps``, the same way as a requested node.

``sweep_affordable`` is how many of ``count`` nodes fit: spent + committed + this launch below the cap.
``lifecycle.launch`` takes the lower of it and the job's own budget (``costs.affordable``); the rest
waits (audit ``launch_refused`` / ``sweep_budget``), or, when no other job of the sweep holds a node (so
nothing it reserved can come free), the job stops with reason ``sweep_budget`` - the sweep is closed.

Pure: no I/O, no clock (``tx.now``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from orchestrator.core.costs import burn_usd_h, cost_now, worst_burn_usd_h
from orchestrator.core.model import TERMINAL_JOB_PHASES, Job, NodePhase, PoolStats
from orchestrator.core.pricing import save_seconds
from orchestrator.core.tx import Tx
from wire.messages import JobSpec

SWEEP_BUDGET = "sweep_budget"


@dataclass(frozen=True, slots=True)
class SweepCap:
    budget_usd: float | None
    deadline_ts: float | None


def sweep_of(spec: JobSpec) -> str | None:
    sid = spec.sweep_id
    return None if isinstance(sid, msgspec.UnsetType) else sid


def _value(v: float | msgspec.UnsetType) -> float | None:
    if isinstance(v, msgspec.UnsetType | bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) and v > 0 else None


def cap_of(specs: Iterable[JobSpec]) -> SweepCap:
    """The sweep's cap: the smallest budget and the earliest deadline any of its jobs carries."""
    budgets: list[float] = []
    deadlines: list[float] = []
    for spec in specs:
        if (b := _value(spec.sweep_budget_usd)) is not None:
            budgets.append(b)
        if (d := _value(spec.sweep_deadline_ts)) is not None:
            deadlines.append(d)
    return SweepCap(min(budgets, default=None), min(deadlines, default=None))


def members(tx: Tx, sweep_id: str) -> list[Job]:
    """Every job (any phase) of the sweep, in job id order, from the index of the sweeps' jobs
    (timers.py): no scan of the other jobs."""
    jobs = tx.jobs
    return [jobs[jid] for jid in sorted(tx.timers.sweeps.get(sweep_id, ())) if jid in jobs]


def sweep_cost_usd(tx: Tx, jobs: Iterable[Job]) -> float:
    return sum((cost_now(tx, j) for j in jobs), 0.0)


def _new_node_usd(tx: Tx, job: Job, ps: PoolStats | None) -> float:
    """What one new node of ``job`` in ``ps`` is committed to until it is gone: boot, one checkpoint, two
    Ticks at the pool's price, and the termination tail at the worst price."""
    if ps is None:
        return 0.0
    cfg = tx.cfg
    price = ps.price_usd_h or 0.0
    worst = max(price, ps.on_demand_usd_h or 0.0)
    return (worst * cfg.terminate_s + price * (save_seconds(job) + 2 * cfg.tick_s + cfg.boot_s_estimate)) / 3600.0


def committed_usd(tx: Tx, job: Job) -> float:
    """What a live job's nodes are committed to beyond what they cost so far (0 for an ended job)."""
    if job.phase in TERMINAL_JOB_PHASES:
        return 0.0
    cfg = tx.cfg
    out = (worst_burn_usd_h(tx, job) * cfg.terminate_s
           + burn_usd_h(tx, job) * (save_seconds(job) + 2 * cfg.tick_s)) / 3600.0
    nodes, pools = tx.nodes, tx.pools
    for nid in job.nodes:
        n = nodes.get(nid)
        if n is not None and n.phase == NodePhase.REQUESTED:
            out += _new_node_usd(tx, job, pools.get(n.pool_name))
    return out


def others_hold_nodes(tx: Tx, job: Job) -> bool:
    """Another live job of ``job``'s sweep holds nodes (what they reserved may come free)."""
    sid = sweep_of(job.spec)
    return sid is not None and any(j.job_id != job.job_id and j.phase not in TERMINAL_JOB_PHASES and j.nodes
                                   for j in members(tx, sid))


def sweep_affordable(tx: Tx, job: Job, ps: PoolStats, count: int) -> tuple[int, dict[str, float] | None]:
    """(how many of ``count`` new nodes of ``job`` in ``ps`` its sweep's budget can carry, the figures when
    it cannot carry all of them - else None). A job of no sweep, or of a sweep without a budget: all."""
    sid = sweep_of(job.spec)
    if sid is None or count <= 0:
        return max(count, 0), None
    jobs = members(tx, sid)
    if not any(j.job_id == job.job_id for j in jobs):
        jobs.append(job)
    cap = cap_of([j.spec for j in jobs]).budget_usd
    if cap is None:
        return count, None
    spent = sweep_cost_usd(tx, jobs)
    committed = sum((committed_usd(tx, j) for j in jobs), 0.0)
    each = _new_node_usd(tx, job, ps)
    for c in range(count, 0, -1):
        if spent + committed + c * each < cap:
            return c, (None if c == count else _figures(spent, committed, each, cap))
    return 0, _figures(spent, committed, each, cap)


def _figures(spent: float, committed: float, each: float, cap: float) -> dict[str, float]:
    return {"spent_usd": round(spent, 6), "committed_usd": round(committed, 6), "per_node_usd": round(each, 6),
            "budget_usd": cap}
