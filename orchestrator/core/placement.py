"""Placement: which capacity pool a job's nodes should come from.

Role: pure ranking of the known pools (pools become known from PriceTicks) for a job's GPU need, its
allowed clouds/regions/zones/instance types and market policy, by expected cost (price, preemption
rate, recent-preemption penalty; see pricing.py). The result includes the runners-up for the audit.

Rules:
- spot pools whose price is at or above the on-demand price, or whose capacity hint is 0, are treated
  as having no capacity (traces show pools parked at the on-demand price);
- a pool whose instance type the providers do not know (``CoreConfig.knows``) is never a launch target,
  and a pool without a confirmed price (docs/core.md, "Price confirmation") has no capacity;
- pools in launch-failure backoff are skipped (never retry the pool that just failed), and so are spot
  pools that sent a terminate notice, until that notice's deadline + ``notice_skip_grace_s``; the
  backoff doubles with each failure of one run of failures (``launch_failed``): a failure more than
  ``backoff_max_s`` after the previous backoff ended starts a new run at ``backoff_base_s``; a job
  that waits for capacity (nothing to train on) retries a pool at most ``CoreConfig.probe_s()`` after
  its last failure (``retry_at``) - one such probe per pool at a time, whatever the number of waiting
  jobs (``probed``) - and a running job's move waits out the whole backoff; a successful launch ends
  the pool's backoff;
- ``zone`` restricts to one zone (replacements: a generation never spans zones); ``exclude`` removes
  pools (the pool that was just preempted); a job fleeing a reclaim skips spot pools with a notice or a
  loss in the last ``reclaim_s()`` (``fleeing``);
- under ``spot_with_fallback`` with a deadline, a new launch goes to on-demand whenever the safety net
  says spot would risk the deadline (core/safety.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import immutables
import msgspec

from orchestrator.core.model import CoreConfig, Job, PoolStats
from orchestrator.core.pricing import expected_cost_usd, spare_slack_s, wait_reserve_s
from orchestrator.core.safety import at_risk_s, net_slack_s
from wire.messages import Market, MarketPolicy, PoolKey

Alternative = tuple[str, float, float]  # (pool name, price_usd_h, expected_cost_usd)
Ranked = tuple[float, str, PoolStats]  # (expected_cost_usd, pool name, pool): one entry of ``ranked``


def zone_of(pool: PoolKey) -> str:
    return f"{pool.cloud}/{pool.region}/{pool.zone}"


_SPOT_ONLY: frozenset[Market] = frozenset({Market.SPOT})
_ON_DEMAND_ONLY: frozenset[Market] = frozenset({Market.ON_DEMAND})
_BOTH_MARKETS: frozenset[Market] = frozenset({Market.SPOT, Market.ON_DEMAND})


def markets_for(job: Job) -> frozenset[Market]:
    """Markets the job's nodes may be in (shared frozensets: called per node in the lifecycle's loops)."""
    policy = job.spec.market
    if policy == MarketPolicy.SPOT:
        return _SPOT_ONLY
    if policy == MarketPolicy.ON_DEMAND or job.force_on_demand:
        return _ON_DEMAND_ONLY
    return _BOTH_MARKETS


def line_step(job: Job, ts: float) -> float | None:
    """Can't Be Late's uniform-progress line: the step a job should have reached at ``ts`` to finish
    exactly at its deadline at constant speed, ``total_steps * (ts - submitted) / (deadline - submitted)``
    (capped at total_steps). None without a usable deadline."""
    spec = job.spec
    if spec.deadline_ts is None or spec.deadline_ts <= job.submitted_ts:
        return None
    frac = (ts - job.submitted_ts) / (spec.deadline_ts - job.submitted_ts)
    return spec.total_steps * min(1.0, max(0.0, frac))


def ahead_of_line(job: Job, step: int, cfg: CoreConfig, now: float, shift_s: float | None = None) -> bool | None:
    """``step`` is at or above the uniform-progress line at ``now + shift`` (default: the margin). None
    when the job has no deadline."""
    line = line_step(job, now + (cfg.progress_line_margin_s if shift_s is None else shift_s))
    return None if line is None else step >= line


def launch_markets_for(job: Job, step: int, cfg: CoreConfig, now: float) -> frozenset[Market]:
    """Markets a NEW launch may use now. Under ``spot_with_fallback`` with a deadline (and the
    ``progress_line`` policy on): on-demand only once the spare slack (``spare_slack_s``) no longer
    covers the expected cost of waiting for spot (``wait_reserve_s``); before that the job waits for
    spot, even behind the uniform-progress line. The deadline fallback (``force_on_demand``) stays the
    safety net. Nodes already running keep being acceptable (``markets_for``): this only gates launches."""
    allowed = markets_for(job)
    if len(allowed) < 2:
        return allowed
    left = net_slack_s(job, step, cfg, now, None, at_risk_s(job, step, job.committed_step, None))
    if left is not None and left < 0:  # the safety net (core/safety.py): spot would risk the deadline
        return _ON_DEMAND_ONLY
    if not cfg.progress_line:
        return allowed
    spare = spare_slack_s(job, step, cfg, now)
    if spare is not None and spare >= wait_reserve_s(job, step, cfg, now):
        return _SPOT_ONLY
    return allowed


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
    pools: immutables.Map[str, PoolStats],
    job: Job,
    nnodes: int,
    step: int,
    cfg: CoreConfig,
    now: float,
    *,
    zone: str | None = None,
    exclude: Iterable[str] = (),
    markets: frozenset[Market] | None = None,
    waiting: bool = False,
    fleeing: bool = False,
) -> list[Ranked]:
    """Feasible pools, cheapest expected cost first (ties broken by pool name: deterministic).
    ``markets`` None: the markets a new launch may use now (``launch_markets_for``). ``waiting``: for a
    job with nothing to train on (``retry_at``). ``fleeing``: for a job that lost a node to a notice or a
    loss just now: no spot pool with a notice or a loss within ``CoreConfig.reclaim_s()`` (a zone-wide
    reclaim reaches its other pools within minutes)."""
    recent = now - cfg.reclaim_s() if fleeing else None
    allowed = markets if markets is not None else launch_markets_for(job, step, cfg, now)
    excluded = frozenset(exclude)
    out: list[Ranked] = []
    for name, ps in pools.items():
        if name in excluded or ps.pool.market not in allowed or ps.noticed_until > now:
            continue
        if ps.backoff_until > now and retry_at(ps, cfg, waiting) > now:
            continue
        if zone is not None and zone_of(ps.pool) != zone:
            continue
        if recent is not None and ps.pool.market == Market.SPOT and (ps.last_preempted_ts or -1e300) >= recent:
            continue
        if not matches(job, ps) or not has_capacity(ps) or not cfg.knows(ps.pool):
            continue
        out.append((expected_cost_usd(job, ps, nnodes, step, cfg, now), name, ps))
    out.sort(key=lambda t: (t[0], t[1]))
    return out


def launch_failed(ps: PoolStats, cfg: CoreConfig, now: float) -> PoolStats:
    """The pool after a failed (or timed-out) launch: exponential backoff over one run of failures.
    A pool left untried for longer than the longest backoff after its last one ended (no job needed
    it) holds no evidence about now: its count starts over, so a single capacity error hours after
    the last one waits ``backoff_base_s``, not ``backoff_max_s``."""
    failures = ps.failures if now - ps.backoff_until <= cfg.backoff_max_s else 0
    return msgspec.structs.replace(ps, failures=failures + 1, backoff_until=now + _backoff_s(cfg, failures))


def _backoff_s(cfg: CoreConfig, before: int) -> float:
    """The backoff a failure sets after ``before`` failures of its run."""
    return float(min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** min(before, 20)))


def retry_at(ps: PoolStats, cfg: CoreConfig, waiting: bool) -> float:
    """When a new launch may try the pool again: the end of its launch backoff - or, for a job that
    waits for capacity (``waiting``), ``CoreConfig.probe_s()`` after the failure that set it, if that is
    sooner. The backoff grows with each failure of a run (``launch_failed``) and keeps running jobs'
    moves off a pool that keeps failing; a waiting job loses slack for as long as it does not probe, and a
    failed launch costs it nothing."""
    probe_s = cfg.probe_s()
    if not waiting or ps.failures <= 0 or not probe_s > 0:  # 0, < 0, nan: no probes (never the pool that just failed)
        return ps.backoff_until
    probe = ps.backoff_until - _backoff_s(cfg, ps.failures - 1) + probe_s  # the last failure + probe_s
    if not isinstance(ps.probe_until, msgspec.UnsetType):  # another waiting job's probe is out
        probe = max(probe, ps.probe_until)
    return min(ps.backoff_until, probe)


def reopens(ps: PoolStats, cfg: CoreConfig) -> tuple[float, float, float]:
    """The times the pool may become a launch target again without an event: a waiting job's retry
    (``retry_at``), the end of its backoff (for every other job: a paused one, one training on
    ``nodes_min``, a move) and the end of its notice skip. Wake-ups take all three (an early one is
    harmless, a missing one strands a sleeping job)."""
    return retry_at(ps, cfg, True), ps.backoff_until, ps.noticed_until


def probed(ps: PoolStats, cfg: CoreConfig, now: float) -> PoolStats | None:
    """The pool after a waiting job's launch into it while it is in backoff (a probe: no other waiting job
    probes it for ``probe_s``); None when it is not in backoff."""
    if ps.backoff_until <= now:
        return None
    return msgspec.structs.replace(ps, probe_until=now + cfg.probe_s())


def alternatives(rank: list[Ranked], cfg: CoreConfig) -> tuple[Alternative, ...]:
    return tuple(
        (name, float(ps.price_usd_h or 0.0), round(cost, 6)) for cost, name, ps in rank[: cfg.max_alternatives]
    )
