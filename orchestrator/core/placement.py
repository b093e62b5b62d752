"""Placement: which capacity pool a job's nodes should come from.

Role: pure ranking of the known pools (pools become known from PriceTicks) for a job's GPU need, its
allowed clouds/regions/zones/instance types and market policy, by expected cost (price, preemption
rate, recent-preemption penalty; see pricing.py). The result includes the runners-up for the audit.

Rules:
- spot pools whose price is at or above the on-demand price, or whose capacity hint is 0, are treated
  as having no capacity (traces show pools parked at the on-demand price);
- pools in launch-failure backoff are skipped (never retry the pool that just failed), and so are spot
  pools that sent a terminate notice, until that notice's deadline + ``notice_skip_grace_s``;
- ``zone`` restricts to one zone (replacements: a generation never spans zones); ``exclude`` removes
  pools (the pool that was just preempted).
"""

from __future__ import annotations

from collections.abc import Iterable

import immutables

from orchestrator.core.model import CoreConfig, Job, PoolStats
from orchestrator.core.pricing import expected_cost_usd
from orchestrator.events import Market, MarketPolicy, PoolKey

Alternative = tuple[str, float, float]  # (pool name, price_usd_h, expected_cost_usd)


def zone_of(pool: PoolKey) -> str:
    return f"{pool.cloud}/{pool.region}/{pool.zone}"


def markets_for(job: Job) -> frozenset[Market]:
    policy = job.spec.market
    if policy == MarketPolicy.SPOT:
        return frozenset({Market.SPOT})
    if policy == MarketPolicy.ON_DEMAND or job.force_on_demand:
        return frozenset({Market.ON_DEMAND})
    return frozenset({Market.SPOT, Market.ON_DEMAND})


def has_capacity(ps: PoolStats) -> bool:
    if ps.price_usd_h is None or ps.price_usd_h < 0:
        return False
    if ps.capacity_hint is not None and ps.capacity_hint <= 0:
        return False
    if ps.pool.market == Market.SPOT and ps.on_demand_usd_h is not None:
        return ps.price_usd_h < ps.on_demand_usd_h
    return True


def matches(job: Job, ps: PoolStats) -> bool:
    """The pool fits the job's GPU need and its allowed clouds/regions/zones/instance types."""
    spec = job.spec
    p = ps.pool
    return (
        ps.gpu_type == spec.gpu_type
        and ps.gpus_per_node == spec.gpus_per_node
        and (not spec.clouds or p.cloud in spec.clouds)
        and (not spec.regions or p.region in spec.regions)
        and (not spec.zones or p.zone in spec.zones)
        and (not spec.instance_types or p.instance_type in spec.instance_types)
    )


def ranked(
    pools: immutables.Map,
    job: Job,
    nnodes: int,
    step: int,
    cfg: CoreConfig,
    now: float,
    *,
    zone: str | None = None,
    exclude: Iterable[str] = (),
    markets: frozenset[Market] | None = None,
) -> list[tuple[float, str, PoolStats]]:
    """Feasible pools, cheapest expected cost first (ties broken by pool name: deterministic)."""
    allowed = markets if markets is not None else markets_for(job)
    excluded = frozenset(exclude)
    out: list[tuple[float, str, PoolStats]] = []
    for name, ps in pools.items():
        if name in excluded or ps.pool.market not in allowed or ps.backoff_until > now or ps.noticed_until > now:
            continue
        if zone is not None and zone_of(ps.pool) != zone:
            continue
        if not matches(job, ps) or not has_capacity(ps):
            continue
        out.append((expected_cost_usd(job, ps, nnodes, step, cfg, now), name, ps))
    out.sort(key=lambda t: (t[0], t[1]))
    return out


def alternatives(rank: list[tuple[float, str, PoolStats]], cfg: CoreConfig) -> tuple[Alternative, ...]:
    return tuple(
        (name, float(ps.price_usd_h or 0.0), round(cost, 6)) for cost, name, ps in rank[: cfg.max_alternatives]
    )
