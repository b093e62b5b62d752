"""The metrics the core's state does not hold, computed from what the decide loop already sees.

Role: ``MetricsObserver`` watches every decided batch (the state before and after it, the events the
core decided, the commands it produced) and keeps the little history these metrics need:

    orchd_node_gpu_utilization_ratio / _temperature_celsius   the latest NVML readings carried in each
        known node's heartbeats (``Heartbeat.gpus``); a node without NVML sends none and has no series
    orchd_job_goodput_ratio          steps kept / steps executed per job (generations lost to a
        preemption executed steps that were not kept)
    orchd_recovery_seconds           a preemption notice, or the loss of a member of a running generation
        (``NodeGone``), to the first step of the job's next generation
    orchd_emergency_checkpoint_margin_seconds / _missed_total    from the emergency ``CheckpointCommitted``
        reports, and the preemption checkpoints that never committed
    orchd_job_on_demand_cost_usd     node-hours of the job's nodes at their pool's on-demand price
    orchd_preemptions_total{kind="vanished"}   a spot node gone without a notice (the core's rule)
    orchd_event_backlog              the ingestion consumers' pending messages (``poll_backlog``)

``refresh`` (with the state gauges, ``gauges.refresh_gauges``) also sets ``orchd_node_heartbeat_age_seconds``.
History starts when this orchd starts leading: goodput counts the steps executed since then, and the
on-demand cost of nodes that left a job before then is not known (docs/operations.md, "Metrics").

Concurrency contract: ``after_batch`` and ``refresh`` run on the decide loop's task (``refresh_slices``:
between its slices the loop decides urgent batches, which ``after_batch`` observes); ``poll_backlog`` is
a task of its own that only sets a gauge.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import structlog

import wire as ev
from orchestrator import bus
from orchestrator.core import Job, Node, State, job_step
from orchestrator.core.commands import SendToAgent, Terminate
from orchestrator.core.inputs import NodeGone
from orchestrator.core.model import GEN_PHASES, NodePhase
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.records import Decided

if TYPE_CHECKING:
    from nats.js import JetStreamContext

log = structlog.get_logger("orchd")

MISS_GRACE_S = 30.0
"""An emergency checkpoint not committed this long after its deadline is counted missed."""
MAX_GPUS = 64
"""GPU series per node at most (``ingest.MAX_GPUS_PER_NODE``): a node cannot flood the registry."""
MAX_TEMP_C = 200.0
SLICE_MAX_S = 0.002
"""Wall time after which a slice of the gauge refresh ends even if its units of work are not done."""


class Slicer:
    """Where a slice of the gauge refresh ends. ``over(n)`` is asked before ``n`` units of work: True when
    the slice already holds work and these ``n`` units would take it over ``units``, or it has run
    ``max_s`` of wall time since it began; the caller then yields, calls ``restart``, and does the ``n``
    units as the first of the next slice. So a slice holds at most ``units`` units (or one single piece
    of work bigger than that) and, on a loaded machine, ends after ``max_s`` whatever a unit costs."""

    __slots__ = ("_done", "_t0", "max_s", "units")

    def __init__(self, units: int, max_s: float = SLICE_MAX_S) -> None:
        self.units, self.max_s = max(1, units), max_s
        self._done, self._t0 = 0, time.perf_counter()

    def over(self, n: int = 1) -> bool:
        if self._done and (self._done + n > self.units or time.perf_counter() - self._t0 >= self.max_s):
            self._done = n
            return True
        self._done += n
        return False

    def restart(self) -> None:
        """The next slice begins (its first units were counted by ``over``)."""
        self._t0 = time.perf_counter()


def _remove_gone(old: set[tuple[str, str]], kept: set[tuple[str, str]],
                 remove: Callable[[tuple[str, str]], None], sl: Slicer) -> Iterator[None]:
    """``remove`` the label sets of ``old`` that are not ``kept`` (series no longer reported), a unit of
    work each, in ``sl``'s slices."""
    while old:
        key = old.pop()
        if sl.over():
            yield
            sl.restart()
        if key not in kept:
            remove(key)


@dataclass(slots=True)
class _JobTrack:
    """A job's step history as seen by this orchd."""

    kept0: int  # the step counting starts from (its committed step when first seen)
    gen: int  # the generation being tracked
    base: int  # the step the tracked generation resumed from
    top: int  # the highest step it reached
    executed: int = 0  # steps executed by the generations before it
    od_closed: float = 0.0  # on-demand $ of the nodes that left the job
    recover_t0: float | None = None  # when the current interruption began
    recover_gen: int = 0  # the generation it interrupted

    def goodput(self, step: int) -> float | None:
        executed = self.executed + max(0, self.top - self.base)
        return min(1.0, max(0.0, (step - self.kept0) / executed)) if executed > 0 else None


class MetricsObserver:
    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics
        self.jobs: dict[str, _JobTrack] = {}
        self.gpus: dict[str, tuple[float, tuple[ev.GpuStats, ...]]] = {}  # node -> (when, latest readings)
        self.ckpt_due: dict[tuple[str, int], float] = {}  # (job, generation) -> emergency checkpoint deadline
        self.ckpt_seen: set[tuple[str, int]] = set()  # emergency commits observed (one per job and generation)
        self.ckpt_missed: set[tuple[str, int]] = set()
        self._hb_labels: set[tuple[str, str]] = set()
        self._gpu_labels: set[tuple[str, str]] = set()
        self._goodput_labels: set[str] = set()

    # --- per batch -----------------------------------------------------------------------------------

    def after_batch(self, before: State, decided: Decided, now: float) -> None:
        """Observe one decided batch: ``before`` is the state it was decided from."""
        after = decided.state
        for c in decided.commands.values():
            if (isinstance(c, SendToAgent) and isinstance(c.command, ev.CheckpointCmd)
                    and c.command.reason == "preemption_notice" and c.command.deadline_ts is not None
                    and (job := after.jobs.get(str(c.command.job_id))) is not None
                    and job_step(after, job.job_id) > job.committed_step):  # else nothing to lose
                due = (job.job_id, c.command.generation)
                self.ckpt_due[due] = min(self.ckpt_due.get(due, math.inf), c.command.deadline_ts)
        heartbeat, live, gpus = ev.Heartbeat, after.nodes, self.gpus
        touched: set[str] = set()  # the jobs whose step may have moved
        for e in decided.seen:
            if type(e) is heartbeat:
                if e.gpus and e.node_id in live:
                    gpus[e.node_id] = (now, e.gpus)
                elif gpus and e.node_id in gpus:
                    del gpus[e.node_id]
                # its node's job (the trust gate refused a heartbeat naming another job; a node that
                # left with this batch is in ``dirty``, below)
                if e.job_id is not None:
                    touched.add(e.job_id)
                elif (node := live.get(e.node_id)) is not None:
                    touched.add(node.job_id)
            elif isinstance(e, ev.PreemptionNotice) and e.kind != ev.NoticeKind.REBALANCE:
                self._interrupted(before, e.node_id, now)
            elif isinstance(e, NodeGone):
                self._node_gone(before, e, now)
            elif isinstance(e, ev.CheckpointCommitted) and e.emergency and e.job_id in after.jobs:
                self._emergency_commit(e)
        for key in decided.dirty:
            if key.startswith("job."):
                touched.add(key[4:])
            elif key.startswith("node."):
                nid = key[5:]
                node = after.nodes.get(nid)
                if node is None and (gone := before.nodes.get(nid)) is not None:
                    self._node_left(after, gone, decided, now)
                    node = gone
                if node is not None:
                    touched.add(node.job_id)
        for jid in touched:
            job = after.jobs.get(jid)
            if job is not None:
                self._progress(after, job, now)

    def _track(self, job: Job) -> _JobTrack:
        t = self.jobs.get(job.job_id)
        if t is None:
            t = self.jobs[job.job_id] = _JobTrack(kept0=job.committed_step, gen=job.generation,
                                                  base=job.committed_step, top=job.committed_step)
        return t

    def _progress(self, state: State, job: Job, now: float) -> None:
        """Steps of the job's generation; the first step of a new one ends an interruption."""
        t = self._track(job)
        step = job_step(state, job.job_id)
        if job.generation != t.gen:
            t.executed += max(0, t.top - t.base)
            t.gen, t.base = job.generation, job.committed_step
            t.top = max(t.base, step) if job.phase in GEN_PHASES else t.base
        elif job.phase in GEN_PHASES:
            t.top = max(t.top, step)
        if (t.recover_t0 is not None and job.generation > t.recover_gen and job.phase in GEN_PHASES
                and step > t.base):
            self.m.recovery.observe(max(0.0, now - t.recover_t0))
            t.recover_t0 = None

    def _interrupted(self, before: State, node_id: str, t0: float) -> None:
        """A member of a running generation is going away: its job's recovery clock starts at ``t0``."""
        node = before.nodes.get(node_id)
        job = before.jobs.get(node.job_id) if node is not None else None
        if node is None or job is None or job.phase not in GEN_PHASES or node_id not in job.gen_nodes:
            return
        t = self._track(job)
        if t.recover_t0 is None or t.recover_gen < job.generation:
            t.recover_t0, t.recover_gen = t0, job.generation

    def _node_gone(self, before: State, e: NodeGone, now: float) -> None:
        """The cloud lost a node: a preemption without notice when the core counts it as one (spot, not
        terminated by orchd, no notice), and a recovery from its last heartbeat."""
        node = before.nodes.get(e.node_id)
        if node is None or (e.instance_id is not None and node.instance_id is not None
                            and e.instance_id != node.instance_id) or e.reason == "terminated_by_us":
            return
        if node.pool.market == ev.Market.SPOT and node.phase != NodePhase.NOTICED:
            self.m.preemptions.labels(node.pool.cloud, node.pool_name, "vanished").inc()
        self._interrupted(before, e.node_id, node.last_seen or now)

    def _emergency_commit(self, e: ev.CheckpointCommitted) -> None:
        key = (str(e.job_id), e.generation)
        self.ckpt_due.pop(key, None)
        if key in self.ckpt_seen:
            return  # the same checkpoint from another member of the generation
        self.ckpt_seen.add(key)
        margin = e.deadline_margin_s
        if margin is not None and math.isfinite(margin):
            self.m.checkpoint_margin.observe(margin)
            if margin < 0:
                self._missed(key)

    def _missed(self, key: tuple[str, int]) -> None:
        if key not in self.ckpt_missed:
            self.ckpt_missed.add(key)
            self.m.checkpoint_missed.labels(key[0]).inc()

    def _node_left(self, after: State, node: Node, decided: Decided, now: float) -> None:
        """A node's record was deleted: its node-hours (and termination tail) at on-demand price."""
        if node.phase == NodePhase.REQUESTED:
            return
        od = _on_demand_usd_h(after, node)
        if od is None:
            return
        hours = max(0.0, now - (node.launched_ts or node.requested_ts)) / 3600.0
        if any(isinstance(c, Terminate) and c.node_id == node.node_id for c in decided.commands.values()):
            hours += after.meta.config.terminate_s / 3600.0
        t = self.jobs.get(node.job_id)
        job = after.jobs.get(node.job_id)
        if t is None and job is not None:
            t = self._track(job)
        if t is not None:
            t.od_closed += od * hours

    # --- per gauge refresh ---------------------------------------------------------------------------

    def refresh(self, state: State, now: float) -> None:
        """Set the gauges of this module, close the emergency checkpoints that can no longer commit, and
        forget what left the state."""
        for _ in self.refresh_slices(state, now):
            pass

    def refresh_slices(self, state: State, now: float, nodes_per_slice: int = 800) -> Iterator[None]:
        """``refresh`` in slices (the decide loop takes urgent inputs between slices:
        ``gauges.refresh_gauge_slices``): a slice ends after ``nodes_per_slice`` units of work (a node's
        heartbeat age, a GPU reading, a series removed, an eighth of a job's goodput and on-demand cost)
        or ``SLICE_MAX_S`` of wall time, whichever comes first (``Slicer``). ``state`` is the one the
        refresh started with."""
        sl = Slicer(nodes_per_slice)
        yield from self._refresh_nodes(state, now, sl)
        yield from self._refresh_gpus(state, now, sl)
        for jid in [j for j in self.jobs if j not in state.jobs]:
            del self.jobs[jid]
        goodput: set[str] = set()
        for job in state.jobs.values():
            if sl.over(8):
                yield
                sl.restart()
            t = self._track(job)
            g = t.goodput(job_step(state, job.job_id))
            if g is not None:
                self.m.goodput.labels(job.job_id).set(g)
                goodput.add(job.job_id)
            od = t.od_closed
            for nid in job.nodes:
                node = state.nodes.get(nid)
                if node is not None and node.phase != NodePhase.REQUESTED:
                    rate = _on_demand_usd_h(state, node)
                    if rate is not None:
                        od += rate * max(0.0, now - (node.launched_ts or node.requested_ts)) / 3600.0
            self.m.on_demand_cost.labels(job.job_id).set(od)
            # a 0 from the start: Prometheus's increase() cannot see a counter's first miss otherwise
            self.m.checkpoint_missed.labels(job.job_id)
        for name, ps in state.pools.items():  # at 0 from the start, like checkpoint_missed
            for kind in ("notice", "vanished"):
                self.m.preemptions.labels(ps.pool.cloud, name, kind)
        old, self._goodput_labels = self._goodput_labels, goodput
        while old:  # what left, sliced like the rest (popped: freeing the old set is sliced too)
            jid = old.pop()
            if sl.over():
                yield
                sl.restart()
            if jid not in goodput:
                self.m.goodput.remove(jid)
        for due, deadline in list(self.ckpt_due.items()):
            owner = state.jobs.get(due[0])
            if owner is None:
                del self.ckpt_due[due]
            elif owner.generation > due[1] or now > deadline + MISS_GRACE_S:
                del self.ckpt_due[due]  # the generation ended, or the deadline passed, with no emergency commit
                self._missed(due)
        for done in (self.ckpt_seen, self.ckpt_missed):
            for key in [k for k in done if k[0] not in state.jobs or state.jobs[k[0]].generation > k[1] + 1]:
                done.discard(key)

    def _refresh_nodes(self, state: State, now: float, sl: Slicer) -> Iterator[None]:
        """Heartbeat age of every node heard from."""
        hb_labels: set[tuple[str, str]] = set()
        age = self.m.node_heartbeat_age
        for node in state.nodes.values():
            if sl.over():
                yield
                sl.restart()
            if node.last_seen > 0:
                hb = (str(node.node_id), str(node.job_id))
                hb_labels.add(hb)
                age.labels(*hb).set(max(0.0, now - node.last_seen))
        old, self._hb_labels = self._hb_labels, hb_labels
        yield from _remove_gone(old, hb_labels, lambda key: age.remove(*key), sl)

    def _refresh_gpus(self, state: State, now: float, sl: Slicer) -> Iterator[None]:
        """The latest GPU readings of the live nodes (a unit of work per reading): at 8 GPUs a node,
        10,000 nodes hold 80,000 readings, 0.4 s of CPU in one piece."""
        stale = state.meta.config.heartbeat_timeout_s
        gpu_labels: set[tuple[str, str]] = set()
        util, temp = self.m.gpu_util, self.m.gpu_temp
        for nid, (ts, gpus) in list(self.gpus.items()):
            if nid not in state.nodes or now - ts > stale:
                self.gpus.pop(nid, None)  # gone, or silent: no reading is better than an old one
                continue
            if sl.over(min(len(gpus), MAX_GPUS)):
                yield
                sl.restart()
            for g in gpus[:MAX_GPUS]:
                key = (nid, str(g.index))
                if 0.0 <= g.util_pct <= 100.0:
                    util.labels(*key).set(g.util_pct / 100.0)
                    gpu_labels.add(key)
                if g.temp_c is not None and -MAX_TEMP_C <= g.temp_c <= MAX_TEMP_C:
                    temp.labels(*key).set(g.temp_c)
                    gpu_labels.add(key)
        def remove(key: tuple[str, str]) -> None:
            for gauge in (util, temp):
                with contextlib.suppress(KeyError):  # set for one of the two only
                    gauge.remove(*key)

        old, self._gpu_labels = self._gpu_labels, gpu_labels
        yield from _remove_gone(old, gpu_labels, remove, sl)

    # --- the consumers' backlog ----------------------------------------------------------------------

    async def poll_backlog(self, js: JetStreamContext, period_s: float) -> None:
        """Every ``period_s``: messages of the ingestion consumers not yet delivered (``num_pending``) plus
        delivered and not yet acked (``num_ack_pending``: taken in, not yet decided). A failed request
        keeps the last value; once this orchd stops leading (the task is cancelled) the gauge is 0: a
        standby reads no consumer."""
        try:
            while True:
                try:
                    total = 0
                    for _kind, stream, consumer in bus.CONSUMERS:
                        info = await js.consumer_info(stream, consumer, timeout=2.0)
                        total += (info.num_pending or 0) + (info.num_ack_pending or 0)
                    self.m.backlog.set(total)
                except Exception as e:  # disconnected, or a stream leader election: the next poll tries again
                    log.debug("backlog_poll_failed", error=repr(e))
                await anyio.sleep(period_s)
        finally:
            self.m.backlog.set(0)


def _on_demand_usd_h(state: State, node: Node) -> float | None:
    ps = state.pools.get(node.pool_name)
    if ps is None:
        return None
    if ps.on_demand_usd_h is not None:
        return ps.on_demand_usd_h
    return ps.price_usd_h if node.pool.market == ev.Market.ON_DEMAND else None
