"""The shell's view of the core's state: the core API handle, metric gauges, admin summaries.

Role: the only shell module that reads the core's record types (``orchestrator.core.model``). The
daemon calls the core through ``CoreApi`` (so tests and benchmarks can pass the same functions,
and the daemon never reaches into the core's internals); the admin service formats state through the
pure functions here.

Concurrency contract: pure functions over immutable state, plus ``refresh_gauges`` which writes
Prometheus gauges (called from the decide loop on each Tick).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client import Gauge

import wire as ev
from orchestrator.core import (
    AuditEntry,
    Decision,
    Job,
    JobPhase,
    Node,
    PoolStats,
    State,
    job_cost_usd,
    job_step,
    sweeps,
)
from orchestrator.core.feasibility import wake_up
from orchestrator.core.inputs import CoreEvent
from orchestrator.core.model import DEFAULT_RESTART_BACKOFF_BASE_S, DEFAULT_RESTART_BACKOFF_MAX_S, TERMINAL_JOB_PHASES
from orchestrator.core.tx import Tx
from orchestrator.daemon.observe import Slicer
from orchestrator.settings import Settings

if TYPE_CHECKING:
    from orchestrator.daemon.loop import Daemon
    from providers.reaper import KnownNode

_enc = msgspec.json.Encoder()


@dataclass(frozen=True)
class CoreApi:
    """The functions of the decision core the daemon calls (``orchestrator.core``'s, or a test's)."""

    decide: Callable[[State, CoreEvent, float], Decision]
    state_to_records: Callable[[State, Iterable[str]], dict[str, bytes]]
    state_from_records: Callable[[Mapping[str, bytes]], State]
    empty_state: Callable[[], State]
    encode_audit: Callable[[AuditEntry], bytes] = _enc.encode
    configure: Callable[[State], State] | None = None
    """Applied to a state restored from records, so the settings of this run (not the persisted
    ones) drive the policy; None leaves the restored state as it is."""

    def restore(self, records: Mapping[str, bytes]) -> State:
        state = self.state_from_records(records)
        return self.configure(state) if self.configure is not None else state


def default_core(settings: Settings, known_instance_types: tuple[str, ...] | None = None) -> CoreApi:
    """The real core, configured by ``settings``; ``known_instance_types`` (``registry.known_instance_types``
    of the providers): a pool of any other type is never a launch target (None: no list)."""
    from orchestrator import core

    config = core.CoreConfig(
        heartbeat_timeout_s=settings.daemon.heartbeat_timeout_s,
        tick_s=settings.daemon.tick_s,
    )
    if settings.daemon.price_confirm_s != config.confirm_s():
        # set only when not the core's default: the persisted meta record keeps the bytes older releases wrote
        config = msgspec.structs.replace(config, price_confirm_s=settings.daemon.price_confirm_s)
    if known_instance_types is not None:
        config = msgspec.structs.replace(config, known_instance_types=known_instance_types)
    d = settings.daemon
    if (d.restart_backoff_base_s, d.restart_backoff_max_s) != (DEFAULT_RESTART_BACKOFF_BASE_S,
                                                               DEFAULT_RESTART_BACKOFF_MAX_S):
        config = msgspec.structs.replace(config, restart_backoff_base_s=d.restart_backoff_base_s,
                                         restart_backoff_max_s=d.restart_backoff_max_s)
    if (d.boot_estimate_s, d.terminate_billing_s) != (config.boot_s_estimate, config.terminate_s):
        config = msgspec.structs.replace(config, boot_s_estimate=d.boot_estimate_s, terminate_s=d.terminate_billing_s)
    return CoreApi(
        decide=core.decide,
        state_to_records=core.state_to_records,
        state_from_records=core.state_from_records,
        empty_state=lambda: core.State.empty(config),
        configure=lambda s: msgspec.structs.replace(s, meta=msgspec.structs.replace(s.meta, config=config)),
    )


def summarize_event(event: CoreEvent) -> dict[str, str]:
    """job/node context of an event, for bound_contextvars."""
    out: dict[str, str] = {"event": type(event).__name__}
    job = getattr(event, "job_id", None)
    node = getattr(event, "node_id", None)
    if job:
        out["job"] = str(job)
    if node:
        out["node"] = str(node)
    return out


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
    tx = Tx(state, "view", now)
    jobs = sweeps.members(tx, sweep_id)
    cap = sweeps.cap_of(j.spec for j in jobs)
    return {"id": sweep_id, "budget_usd": cap.budget_usd, "deadline_ts": cap.deadline_ts,
            "cost_usd": round(sweeps.sweep_cost_usd(tx, jobs), 4), "jobs": len(jobs),
            "closed": sweeps.closed_reason(tx, jobs, cap)}


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


def refresh_gauges(d: Daemon) -> None:
    """Set the state gauges from the daemon's current state, all at once (``refresh_gauge_slices``)."""
    for _ in refresh_gauge_slices(d):
        pass


GAUGE_SLICE_JOBS = 100
"""Jobs per slice of ``refresh_gauge_slices`` (nodes: 8 times as many)."""


def refresh_gauge_slices(d: Daemon, jobs_per_slice: int = GAUGE_SLICE_JOBS) -> Iterator[None]:
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
    observer = getattr(d, "observer", None)  # None: a stand-in with the state gauges' fields only (tests)
    if observer is not None:
        yield from observer.refresh_slices(state, now, 8 * jobs_per_slice)  # heartbeat age, GPUs, goodput...


def new_job_id(spec: ev.JobSpec, entropy: str) -> str:
    from orchestrator.core.model import safe_token

    return f"{safe_token(spec.name)[:40]}-{entropy}"


def known_nodes(state: State) -> dict[str, KnownNode]:
    """node id -> providers.reaper.KnownNode(job phase, instance id): what the reaper matches against."""
    from providers.reaper import KnownNode

    known: dict[str, KnownNode] = {}
    for node in state.nodes.values():
        job = state.jobs.get(node.job_id)
        known[node.node_id] = KnownNode(job_state=_s(job.phase) if job is not None else "deleted",
                                        instance_id=node.instance_id)
    return known


class RejectionLog:
    """Events the trust gate refused, for ``orchctl events`` - rate-limited so that a noisy node
    cannot flood the in-memory log: at most one entry per (sender node, reason) per ``window_s``;
    the rejections folded in between are counted into that key's next entry (``count``: this one
    and the ones not shown since the previous entry). Keys idle for a window are forgotten."""

    def __init__(self, window_s: float = 10.0, max_keys: int = 10_000) -> None:
        self.window_s = window_s
        self.max_keys = max_keys
        self._shown: dict[tuple[str, str], tuple[float, int]] = {}  # key -> (last shown ts, folded since)

    def entry(self, event: CoreEvent, reason: str, now: float) -> dict[str, object] | None:
        """The entry to show for this rejection, or None when it is folded into a later one."""
        node = str(getattr(event, "node_id", "") or "")
        key = (node, reason)
        last = self._shown.get(key)
        if last is not None and now - last[0] < self.window_s:
            self._shown[key] = (last[0], last[1] + 1)
            return None
        if len(self._shown) >= self.max_keys:
            self._forget(now)
        self._shown[key] = (now, 0)
        out: dict[str, object] = {**summarize_event(event), "command": "rejected", "reason": reason,
                                  "count": 1 + (last[1] if last is not None else 0)}
        return out

    def _forget(self, now: float) -> None:
        old = [k for k, (ts, _n) in self._shown.items() if now - ts >= self.window_s]
        for k in old:
            del self._shown[k]
        if len(self._shown) >= self.max_keys:  # all recent: forget the oldest half
            for k in sorted(self._shown, key=lambda k: self._shown[k][0])[: self.max_keys // 2]:
                del self._shown[k]
