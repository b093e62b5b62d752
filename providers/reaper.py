"""Reconciler and orphan reaper: match the clouds' instances to orchd's state, adopt or terminate.

Role: at start and periodically, every instance carrying this deployment's cluster id tag is matched to
the state. Instances of live jobs are *adopted* (orchd keeps driving them); instances that are unknown,
belong to finished jobs, or duplicate a node that already has another instance are *terminated*, but
only after they have been seen as orphans for ``grace_s`` (a launch whose result is not yet recorded
looks exactly like an orphan for a moment), and they are reported.

Safety: the reaper refuses to act when the state is unreadable or empty while instances exist. An empty
state next to a running fleet is far more often a wrong state dir, a wrong KV bucket or a wiped store
than a fleet of real orphans; acting on it is how a fleet gets killed by mistake. ``allow_empty_state``
overrides that (an operator who has checked). ``dry_run`` plans and reports without terminating.

``plan`` is pure (time and state are parameters). ``Reaper`` is the thin shell: it lists each provider,
calls ``plan``, terminates, and reports. Its methods are synchronous and block on SDK calls: the daemon
runs ``Reaper.reconcile`` in a worker thread (``anyio.to_thread.run_sync``) or uses ``run_periodic``.
One ``Reaper`` must not run two reconciles at once (one lock enforces it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import structlog

from providers.base import TAG_CLUSTER, CloudProvider, Instance, InstanceState, ProviderError

if TYPE_CHECKING:
    from anyio.abc import TaskStatus

log = structlog.get_logger("orch.reaper")

FINISHED_JOB_STATES = frozenset(
    {"completed", "succeeded", "failed", "cancelled", "canceled", "stopped", "finished", "deleted"})
"""Job states whose instances must go. Any other state (queued, running, paused, migrating...) is live."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReaperSettings:
    """``[reaper]`` (for the daemon's Settings; load with ``load_dataclass(ReaperSettings, raw, "reaper")``)."""

    enabled: bool = True
    interval_s: float = 300.0
    """Period of the reconcile after the one at start."""
    grace_s: float = 600.0
    """How long an instance must be seen as an orphan (or have been launched) before it is terminated."""
    dry_run: bool = False
    """Report only, terminate nothing (a first deployment, or after restoring state from a backup)."""


@dataclass(frozen=True, slots=True)
class KnownNode:
    """What the state says about a node: its job's state and the instance id recorded for it (if any)."""

    job_state: str
    instance_id: str | None


@dataclass(frozen=True, slots=True)
class Orphan:
    instance: Instance
    reason: str  # unknown_node | finished_job | duplicate | no_node_tag
    first_seen_ts: float


@dataclass(frozen=True, slots=True)
class ReapPlan:
    adopt: tuple[Instance, ...] = ()
    terminate: tuple[Orphan, ...] = ()
    waiting: tuple[Orphan, ...] = ()  # orphans still inside their grace period
    refused_reason: str | None = None
    first_seen: Mapping[str, float] = field(default_factory=dict)
    """Carry this into the next plan: when each current orphan was first seen."""


def plan(
    instances: Sequence[Instance],
    known: Mapping[str, KnownNode | tuple[str, str | None]],
    first_seen: Mapping[str, float],
    now: float,
    grace_s: float,
    state_ok: bool,
    *,
    cluster_id: str | None = None,
    allow_empty_state: bool = False,
) -> ReapPlan:
    """Decide what to adopt and what to terminate. Pure.

    ``known``: node id -> KnownNode (or a (job_state, instance_id) tuple). ``first_seen``: instance id ->
    when it was first seen as an orphan (from the previous plan). An orphan is terminated once
    ``now - min(first_seen, launched_ts) >= grace_s``; a new orphan without a launch time starts waiting now."""
    # Every instance that still exists counts (a stopped GCP VM or a deallocated Azure VM still holds a disk).
    alive = [i for i in instances if i.state is not InstanceState.TERMINATED
             and (cluster_id is None or i.tags.get(TAG_CLUSTER) == cluster_id)]
    if not state_ok:
        return ReapPlan(refused_reason="state_unreadable", first_seen=dict(first_seen))
    if not known and alive and not allow_empty_state:
        return ReapPlan(refused_reason=f"state_empty_with_{len(alive)}_instances", first_seen=dict(first_seen))
    nodes = {n: (k if isinstance(k, KnownNode) else KnownNode(k[0], k[1])) for n, k in known.items()}
    adopt: list[Instance] = []
    orphans: list[tuple[Instance, str]] = []
    for inst in sorted(alive, key=lambda i: i.instance_id):
        node = nodes.get(inst.node_id) if inst.node_id else None
        if inst.node_id is None:
            orphans.append((inst, "no_node_tag"))
        elif node is None:
            orphans.append((inst, "unknown_node"))
        elif node.job_state in FINISHED_JOB_STATES:
            orphans.append((inst, "finished_job"))
        elif node.instance_id is not None and node.instance_id != inst.instance_id:
            orphans.append((inst, "duplicate"))
        else:
            adopt.append(inst)
    seen: dict[str, float] = {}
    terminate: list[Orphan] = []
    waiting: list[Orphan] = []
    for inst, reason in orphans:
        # Grace runs from when we first saw it as an orphan, or from its launch time if that is older:
        # an unknown instance launched hours ago is not a launch in flight.
        t0 = first_seen.get(inst.instance_id, now)
        if inst.launched_ts is not None:
            t0 = min(t0, inst.launched_ts)
        seen[inst.instance_id] = t0
        o = Orphan(inst, reason, t0)
        (terminate if now - t0 >= grace_s else waiting).append(o)
    return ReapPlan(adopt=tuple(adopt), terminate=tuple(terminate), waiting=tuple(waiting), first_seen=seen)


@dataclass(frozen=True, slots=True)
class ReapReport:
    """What one reconcile did (or, in dry-run, would have done), per cloud."""

    dry_run: bool
    adopted: dict[str, tuple[str, ...]] = field(default_factory=dict)
    terminated: dict[str, tuple[str, ...]] = field(default_factory=dict)
    waiting: dict[str, tuple[str, ...]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    orphans: tuple[Orphan, ...] = ()

    def to_dict(self) -> dict[str, object]:
        return {
            "dry_run": self.dry_run,
            "adopted": {k: list(v) for k, v in self.adopted.items()},
            "terminated": {k: list(v) for k, v in self.terminated.items()},
            "waiting": {k: list(v) for k, v in self.waiting.items()},
            "refused": dict(self.refused),
            "errors": dict(self.errors),
            "orphans": [
                {"instance_id": o.instance.instance_id, "node_id": o.instance.node_id, "reason": o.reason,
                 "pool": o.instance.pool.name, "first_seen_ts": o.first_seen_ts}
                for o in self.orphans
            ],
        }


StateReader = Callable[[], tuple[Mapping[str, KnownNode | tuple[str, str | None]], bool]]


class Reaper:
    """Lists each provider, plans, terminates (unless dry-run), reports. See the module docstring."""

    def __init__(
        self,
        providers: Mapping[str, CloudProvider],
        *,
        cluster_id: str,
        grace_s: float = 600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.providers = dict(providers)
        self.cluster_id = cluster_id
        self.grace_s = grace_s
        self._clock = clock
        self._first_seen: dict[str, dict[str, float]] = {}
        self._lock = threading.Lock()

    def reconcile(
        self,
        known: Mapping[str, KnownNode | tuple[str, str | None]],
        *,
        state_ok: bool,
        dry_run: bool = False,
        allow_empty_state: bool = False,
    ) -> ReapReport:
        """One pass over every provider. Blocking: run it in a worker thread."""
        with self._lock:
            adopted: dict[str, tuple[str, ...]] = {}
            terminated: dict[str, tuple[str, ...]] = {}
            waiting: dict[str, tuple[str, ...]] = {}
            refused: dict[str, str] = {}
            errors: dict[str, str] = {}
            orphans: list[Orphan] = []
            for cloud, provider in self.providers.items():
                try:
                    instances = provider.list_instances(self.cluster_id)
                except ProviderError as e:
                    # Unreadable cloud: act on nothing there (and forget nothing: grace timers keep running).
                    errors[cloud] = f"list_failed: {type(e).__name__}: {e}"
                    log.warning("reaper_list_failed", cloud=cloud, error=str(e), retryable=e.retryable)
                    continue
                p = plan(instances, known, self._first_seen.get(cloud, {}), self._clock(), self.grace_s,
                         state_ok, cluster_id=self.cluster_id, allow_empty_state=allow_empty_state)
                if p.refused_reason:
                    refused[cloud] = p.refused_reason
                    log.error("reaper_refused", cloud=cloud, reason=p.refused_reason, instances=len(instances))
                    continue
                if not dry_run:  # a dry run must not start grace timers that a real run would then honour
                    self._first_seen[cloud] = dict(p.first_seen)
                adopted[cloud] = tuple(i.instance_id for i in p.adopt)
                waiting[cloud] = tuple(o.instance.instance_id for o in p.waiting)
                orphans += [*p.terminate, *p.waiting]
                ids = tuple(o.instance.instance_id for o in p.terminate)
                for o in p.terminate:
                    log.warning("orphan_instance", cloud=cloud, instance=o.instance.instance_id,
                                node=o.instance.node_id, reason=o.reason, pool=o.instance.pool.name,
                                orphan_for_s=round(self._clock() - o.first_seen_ts, 1), dry_run=dry_run)
                if ids and not dry_run:
                    try:
                        provider.terminate(ids, self.cluster_id)
                    except ProviderError as e:
                        errors[cloud] = f"terminate_failed: {type(e).__name__}: {e}"
                        log.error("reaper_terminate_failed", cloud=cloud, error=str(e), instances=list(ids))
                        continue
                    for i in ids:
                        self._first_seen.get(cloud, {}).pop(i, None)
                terminated[cloud] = ids
            return ReapReport(dry_run=dry_run, adopted=adopted, terminated=terminated, waiting=waiting,
                              refused=refused, errors=errors, orphans=tuple(orphans))

    async def run_periodic(
        self,
        read_state: Callable[[], Awaitable[tuple[Mapping[str, KnownNode | tuple[str, str | None]], bool]]],
        *,
        interval_s: float,
        dry_run: bool = False,
        on_report: Callable[[ReapReport], Awaitable[None]] | None = None,
        task_status: TaskStatus[None] | None = None,
    ) -> None:
        """Reconcile at once, then every ``interval_s``, until cancelled. Use with ``await tg.start(...)``.

        ``read_state`` returns (known nodes, state_ok); an exception from it counts as unreadable state."""
        import anyio

        started = False
        while True:
            try:
                known, ok = await read_state()
            except Exception as e:  # any failure to read state means: do not act
                log.error("reaper_state_unreadable", error=repr(e))
                known, ok = {}, False
            report = await anyio.to_thread.run_sync(partial(self.reconcile, known, state_ok=ok, dry_run=dry_run))
            if on_report is not None:
                await on_report(report)
            if not started:
                started = True
                if task_status is not None:
                    task_status.started()
            await anyio.sleep(interval_s)
