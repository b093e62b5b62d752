"""Cost and progress queries on a ``Tx``: burn rate, accrued cost, billing start, progress.

Role: read-mostly helpers shared by lifecycle.py, policy.py and views.py. Cost is exact without ever
touching a job on a price change: each pool integrates its price over time (``PoolStats.cum_usd``); a
node remembers the integral when its billing started (``Node.cost0``); a job's cost is its closed part
(``Job.cost_usd``: nodes already gone, with their termination tail) plus its live nodes' integrals.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec

from orchestrator.core.model import Job, Node, NodePhase, PoolStats
from orchestrator.core.pricing import MAX_DURATION_S, pool_cum_usd, record_exposure, save_seconds
from orchestrator.core.tx import Tx

N = NodePhase


def progress_step(tx: Tx, job: Job) -> int:
    step = max(job.step, job.committed_step)
    nodes = tx.nodes
    for nid in job.gen_nodes:
        n = nodes.get(nid)
        if n is not None and n.generation == job.generation and n.step > step:
            step = n.step
    return step


def live_step_time(tx: Tx, job: Job) -> float | None:
    """Mean step time the current generation's nodes report (None before any report)."""
    total, count = 0.0, 0
    for nid in job.gen_nodes:
        n = tx.nodes.get(nid)
        if n is not None and n.generation == job.generation and n.step_time_s:
            total += min(n.step_time_s, MAX_DURATION_S)  # capped: the mean stays finite (pricing.py)
            count += 1
    return total / count if count else job.step_time_s


def _billed_prices(tx: Tx, job: Job) -> Iterator[tuple[float, PoolStats]]:
    """(price, pool) of each launched (billed) node of the job whose pool has a known price."""
    nodes, pools = tx.nodes, tx.pools
    for nid in job.nodes:
        n = nodes.get(nid)
        if n is None or n.phase == N.REQUESTED:
            continue
        ps = pools.get(n.pool_name)
        if ps is not None and ps.price_usd_h is not None:
            yield ps.price_usd_h, ps


def burn_usd_h(tx: Tx, job: Job) -> float:
    """$ per hour the job's launched nodes cost now."""
    return sum((price for price, _ in _billed_prices(tx, job)), 0.0)


def worst_burn_usd_h(tx: Tx, job: Job) -> float:
    """$ per hour the launched nodes could cost before the next check: spot at most at on-demand."""
    return sum((max(price, ps.on_demand_usd_h or 0.0) for price, ps in _billed_prices(tx, job)), 0.0)


def node_cost_usd(tx: Tx, node: Node) -> float:
    """$ this node has cost so far (0 until billing starts: NodeLaunched or registration)."""
    if node.phase == N.REQUESTED:
        return 0.0
    ps = tx.pools.get(node.pool_name)
    return pool_cum_usd(ps, tx.now) - node.cost0 if ps is not None else 0.0


def cost_now(tx: Tx, job: Job) -> float:
    """Accrued cost: the closed part plus every live node's share of its pool's price integral."""
    total = job.cost_usd
    nodes = tx.nodes
    for nid in job.nodes:
        n = nodes.get(nid)
        if n is not None and n.phase != N.REQUESTED:
            total += node_cost_usd(tx, n)
    return total


def billing_start(tx: Tx, node: Node) -> dict[str, float]:
    """Billing starts now: the pool counts one more live node; returns the node's field changes."""
    ps = tx.pools.get(node.pool_name)
    if ps is None:
        return {"cost0": 0.0}
    tx.put_pool(node.pool_name, msgspec.structs.replace(ps, **record_exposure(ps, tx.cfg, tx.now, 1, False)))
    return {"cost0": pool_cum_usd(ps, tx.now)}


def affordable(tx: Tx, job: Job, ps: PoolStats, count: int) -> int:
    """How many of ``count`` new nodes in ``ps`` the budget can still carry through boot, one checkpoint
    and termination (termination tail at the worst price, like check_budget)."""
    budget = job.spec.budget_usd
    if budget is None or count <= 0:
        return max(count, 0)
    cfg = tx.cfg
    cost = cost_now(tx, job)
    worst0, burn0 = worst_burn_usd_h(tx, job), burn_usd_h(tx, job)
    price = ps.price_usd_h or 0.0
    worst_price = max(price, ps.on_demand_usd_h or 0.0)
    for c in range(count, 0, -1):
        need = (worst0 + c * worst_price) * cfg.terminate_s + (burn0 + c * price) * (
            save_seconds(job) + 2 * cfg.tick_s + cfg.boot_s_estimate
        )
        if cost + need / 3600.0 < budget:
            return c
    return 0
