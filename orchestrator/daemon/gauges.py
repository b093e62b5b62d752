"""The state gauges: jobs, nodes, costs, budgets, steps and prices, set from the state in slices.

``refresh_gauge_slices`` reads what a ``GaugeSource`` shows (the state, the metrics, the fencing
token, and the daemon's ``observe.MetricsObserver`` for the gauges the state does not hold); the decide
loop runs it on a Tick, between urgent inputs.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import Gauge

import wire as ev
from orchestrator.core import State, job_cost_usd, job_step
from orchestrator.core.model import TERMINAL_JOB_PHASES
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.observe import MetricsObserver, Slicer


class GaugeSource(Protocol):
    """What the gauges read of the daemon (a test passes a stand-in with these fields)."""

    @property
    def state(self) -> State | None: ...
    @property
    def metrics(self) -> Metrics: ...
    @property
    def fencing_token(self) -> int: ...


def _s(value: object) -> str:
    return str(getattr(value, "value", value))


def refresh_gauges(d: GaugeSource) -> None:
    """Set the state gauges from the daemon's current state, all at once (``refresh_gauge_slices``)."""
    for _ in refresh_gauge_slices(d):
        pass


GAUGE_SLICE_JOBS = 100
"""Jobs per slice of ``refresh_gauge_slices`` (nodes: 8 times as many)."""


def refresh_gauge_slices(d: GaugeSource, jobs_per_slice: int = GAUGE_SLICE_JOBS) -> Iterator[None]:
    """Set the state gauges from the daemon's state, in slices: yields after each ``jobs_per_slice`` jobs
    (or 8 times as many nodes), or after ``observe.SLICE_MAX_S`` of wall time, whichever comes first
    (``observe.Slicer``), so that the decide loop takes urgent inputs between slices (at 10,000
    nodes the whole refresh costs 0.1-0.2 s of CPU). The state is read as it was at the start (it is
    immutable). Series are set in place and the stale ones removed at the end: a scrape between slices
    sees each series at its previous or its new value, never missing (and the children are not created
    again on every refresh)."""
    state, m = d.state, d.metrics
    if state is None:
        return
    live: dict[Gauge, set[tuple[str, ...]]] = {}

    def put(family: Gauge, labels: tuple[str, ...], value: float) -> None:
        family.labels(*labels).set(value)
        live.setdefault(family, set()).add(labels)

    for phase, count in Counter(_s(j.phase) for j in state.jobs.values()).items():
        put(m.jobs, (phase,), count)
    per_pool: Counter[tuple[str, ...]] = Counter()
    sl = Slicer(8 * jobs_per_slice)  # a node a unit, a job 8; and at most SLICE_MAX_S of wall time a slice
    for node in state.nodes.values():
        if sl.over():
            yield
            sl.restart()
        per_pool[(node.pool.cloud, node.pool_name, _s(node.phase))] += 1
    for labels, count in per_pool.items():
        put(m.nodes, labels, count)
    now = time.time()
    # Series of deleted jobs go; a finished job keeps its final cost and step but no budget, so a budget
    # alert resolves when the job stops instead of firing for as long as the job is kept.
    for job in state.jobs.values():
        if sl.over(8):
            yield
            sl.restart()
        put(m.cost, (job.job_id,), job_cost_usd(state, job.job_id, now))
        if job.spec.budget_usd is not None and job.phase not in TERMINAL_JOB_PHASES:
            put(m.budget, (job.job_id,), job.spec.budget_usd)
        put(m.job_phase, (job.job_id, _s(job.phase)), 1)
        put(m.job_step, (job.job_id,), job_step(state, job.job_id))
        pools: Counter[ev.PoolKey] = Counter()
        for nid in job.nodes:
            member = state.nodes.get(nid)
            if member is not None:
                pools[member.pool] += 1
        for p, n in pools.items():
            put(m.job_nodes, (job.job_id, p.cloud, p.region, p.zone, p.instance_type, _s(p.market)), n)
    for stats in state.pools.values():
        p = stats.pool
        if stats.price_usd_h is not None:
            m.pool_price.labels(p.cloud, p.region, p.zone, p.instance_type, _s(p.market)).set(stats.price_usd_h)
        if stats.on_demand_usd_h is not None:
            m.pool_on_demand_price.labels(p.cloud, p.region, p.zone, p.instance_type).set(stats.on_demand_usd_h)
    for family in (m.jobs, m.nodes, m.job_phase, m.job_nodes, m.cost, m.budget, m.job_step):
        now_set = live.get(family, set())
        for stale in m.state_series.get(family, set()) - now_set:
            with contextlib.suppress(KeyError):
                family.remove(*stale)
        m.state_series[family] = now_set
    m.lease_revision.set(d.fencing_token)
    observer: MetricsObserver | None = getattr(d, "observer", None)  # None: the state gauges only (tests)
    if observer is not None:
        yield from observer.refresh_slices(state, now, 8 * jobs_per_slice)  # heartbeat age, GPUs, goodput...
