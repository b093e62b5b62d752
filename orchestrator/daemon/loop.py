"""The decide loop of orchd: batches in, decisions persisted, acks and commands out.

Role: ``Daemon`` is the running daemon's handle and owns the core's state. ``decide_loop`` takes a
batch from the intake and runs it through the stages of ``orchestrator.daemon.pipeline`` (``process``):
decode and screen every message, decide every event with the pure core, persist the union of the dirty
keys and the commands (``Store.persist``: outbox first), then hand the commands to the executor (checkpoint
commands first), answer admin requests and ack. See docs/architecture.md for the ordering and what a crash leaves.

Concurrency contract: one task runs ``decide_loop``; nothing else mutates ``Daemon.state`` (admin
handlers read the immutable value). Producers reach the loop only through ``Daemon.intake``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Set
from typing import TYPE_CHECKING

import anyio
import structlog
from anyio.abc import TaskGroup

from orchestrator import bus
from orchestrator.core import State
from orchestrator.core.inputs import BusState, CoreEvent, LeaseChanged, Tick
from orchestrator.daemon import pipeline
from orchestrator.daemon.coreapi import CoreApi, park_bad_names
from orchestrator.daemon.eventlog import EventLog
from orchestrator.daemon.executor import Executor
from orchestrator.daemon.gauges import refresh_gauge_slices
from orchestrator.daemon.ingest import Intake
from orchestrator.daemon.liveness import LivenessFlusher
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.observe import MetricsObserver
from orchestrator.daemon.ratelimit import SenderLimiter
from orchestrator.daemon.records import Batch, Decided, NotLeader, ShellItem, ShuttingDown
from orchestrator.daemon.store import Store
from orchestrator.daemon.tracking import TrackingGate, TrackingReporter
from orchestrator.settings import DaemonSettings, Settings
from providers.base import CloudProvider

if TYPE_CHECKING:
    from nats.aio.msg import Msg

    from providers.reaper import Reaper

log = structlog.get_logger("orchd")

MAX_HEARTBEATS_PER_BATCH = 1000
SLOW_BATCH_S = 0.25
URGENT_ROUNDS = 4
_NOTHING: frozenset[str] = frozenset()
_NOT_LEADER = "this orchd lost the leader lease; retry: the new leader answers"
__all__ = ["DEFAULT_CLUSTER_ID", "Daemon", "cluster_identity"]


class Daemon:
    """The running daemon's handle: state and stats for the admin service, tests and the demo.

    Public surface for ``run.run_daemon``: ``stop_requested`` / ``wait_for_stop``, the bus callback
    ``on_bus_state``, ``restore`` (the loaded state), ``attach_background`` (where liveness flushes run),
    ``decide_loop`` and ``finish`` (the final batch). The executor reports on the intake's channel
    (``Intake.put_result``). The admin service sees it as a ``view.DaemonView``."""

    def __init__(self, settings: Settings, providers: Mapping[str, CloudProvider], core: CoreApi, metrics: Metrics,
                 *, stop: anyio.Event | None = None) -> None:
        self.settings = settings
        self.providers = providers
        self.core = core
        self.metrics = metrics
        d = settings.daemon
        self.intake = Intake(metrics, limiter=SenderLimiter(d.sender_rate_per_s, d.sender_burst)
                             if d.sender_rate_per_s > 0 else None)
        self.state: State | None = None
        self.store: Store | None = None
        self.executor: Executor | None = None
        self.nats_url = ""
        self.metrics_url = ""
        self.started_ts = time.time()
        self.connected = False
        self.fencing_token = 0
        self.events_decided = 0
        self.batches = 0
        self.events = EventLog()  # decided commands and the gate's refusals, for `orchctl events`
        self._stages = pipeline.Stages(core, metrics, on_decision=self.events.decision,
                                       on_reject=self.events.rejection, dead_after=d.dead_after_deliveries,
                                       retry_s=pipeline.retry_ahead_s(bus.ack_wait_s(d.lease_ttl_s)))
        self.liveness = LivenessFlusher(self._write_liveness, settings.daemon.liveness_flush_max)
        self.observer = MetricsObserver(metrics)  # the metrics the state does not hold (observe.py)
        gate = TrackingGate(settings.tracking)  # only the servers of [tracking.servers] get orchd's credentials
        self.tracking = TrackingReporter(self.observer, refusal=gate.refusal,  # figures to tracked jobs' runs
                                         on_refused=lambda why: metrics.rejected.labels("tracking", why).inc())
        self._stop = stop if stop is not None else anyio.Event()  # the caller's: signals arrive while standing by
        self.exit_code = 0
        self._reaper: Reaper | None = None
        self._persisting: Set[str] = _NOTHING  # the dirty keys of the batch being persisted
        self._closed = False  # the final batch is taken (``finish``): ``submit`` refuses at once
        self._held: list[Msg] = []  # handed back while the pull loops ran: nak'ed by ``finish``
        self.deciding = False  # the decide loop runs (a leader); False while starting or standing by
        self.progress_ts = time.monotonic()  # the decide loop's last turn (``stalled_s``)

    # --- lifecycle (run.py) ------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    async def wait_for_stop(self) -> None:
        await self._stop.wait()

    def restore(self, records: Mapping[str, bytes]) -> None:
        """The state loaded from KV (empty: a fresh state) and the cluster's identity (``cluster_identity``:
        ``settings.daemon.cluster_id`` is this run's from here on); ``LeaseChanged`` is the first event
        decided (it records the identity in a state that holds none)."""
        records, parked = park_bad_names(records)
        for key, why in sorted(parked.items()):  # reported, never a crash; left in KV for an operator
            log.error("stored_record_parked", key=key[:200], reason=why,
                      hint="an older release stored an id today's names refuse: rename the job and resubmit it")
            self.metrics.rejected.labels("state", "bad_name").inc()
        self.state = self.core.restore(records) if records else self.core.empty_state()
        cluster = cluster_identity(self.state, bool(records), self.settings.daemon.cluster_id)
        if cluster != self.settings.daemon.cluster_id:
            self.settings = dataclasses.replace(self.settings, daemon=dataclasses.replace(
                self.settings.daemon, cluster_id=cluster))
        log.info("cluster_identity", cluster_id=cluster)
        self.intake.put_shell(ShellItem(LeaseChanged(revision=self.fencing_token, cluster_id=cluster)))

    def attach_background(self, tg: TaskGroup) -> None:
        """The task group that runs background work of the loop (liveness flush slices, the backlog poll)."""
        self.liveness.attach(tg)
        tg.start_soon(self.tracking.run)
        if self.store is not None:
            tg.start_soon(self.observer.poll_backlog, self.store.js, self.settings.daemon.tick_s)

    def may_act(self) -> bool:
        """True while this daemon may change the world (single daemon, or HA with a valid lease)."""
        ex = self.executor
        return ex is not None and (ex.may_act is None or ex.may_act())

    def reaper_for(self) -> Reaper:
        """The one Reaper of this daemon (its orphan grace timers are shared by every pass)."""
        if self._reaper is None:
            from providers.reaper import Reaper

            self._reaper = Reaper(self.providers, cluster_id=self.settings.daemon.cluster_id,
                                  grace_s=self.settings.daemon.reap_grace_s)
        return self._reaper

    async def submit(self, event: CoreEvent) -> None:
        """Feed a shell event (admin intent) and return once its decision is persisted. ``NotLeader`` when
        the lease was lost before, ``ShuttingDown`` when it comes after the final batch was taken (both: 503)."""
        if self._closed:
            if not self.may_act():
                raise NotLeader(_NOT_LEADER)
            raise ShuttingDown("this orchd is shutting down; retry once it or a standby answers")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.intake.put_shell(ShellItem(event, fut))
        await fut

    # --- callbacks of the bus and the executor -----------------------------------------------------

    def on_bus_state(self, connected: bool) -> None:
        self.connected = connected
        self.metrics.nats_connected.set(1 if connected else 0)
        self.intake.put_shell(ShellItem(BusState(connected=connected)))

    # --- the decide loop ---------------------------------------------------------------------------

    def stalled_s(self) -> float:
        """How long the decide loop has made no progress: 0 while it does not run (starting, standing by)
        and while NATS is unreachable (an outage is not a stall: the lease and the retries handle it)."""
        if not self.deciding or not self.connected:
            return 0.0
        return max(0.0, time.monotonic() - self.progress_ts)

    def _progress(self) -> None:
        self.progress_ts = time.monotonic()
        self.metrics.decide_progress.set(time.time())

    async def decide_loop(self) -> None:
        self.deciding = True
        try:
            await self._turns()
        finally:
            self.deciding = False

    async def _turns(self) -> None:
        """The decide loop's turns until stopped: wait, take, decide (urgent, Tick, heartbeats)."""
        tick_s = self.settings.daemon.tick_s
        next_tick = time.monotonic() + tick_s
        next_flush = time.monotonic() + self.settings.daemon.liveness_flush_s
        next_gauges = 0.0
        while not self._stop.is_set():
            self._progress()  # each turn: the previous batch was decided and persisted, or there was none
            if self.intake.pending():  # more is buffered: one pass of the event loop (the bus's readers run)
                await anyio.sleep(0)  # instead of a task group of two waiters per batch
            else:
                with anyio.move_on_after(max(0.0, next_tick - time.monotonic())):
                    await _first(self.intake.wait, self._stop.wait)
            urgent, heartbeats = self.intake.take_split(MAX_HEARTBEATS_PER_BATCH)
            tick = None
            if time.monotonic() >= next_tick:
                tick = Batch([], [], [ShellItem(Tick())])
                next_tick = time.monotonic() + tick_s
                if time.monotonic() >= next_flush:
                    self.liveness.start_round()
                    next_flush = time.monotonic() + self.settings.daemon.liveness_flush_s
            # Urgent first: notices, node events, executor results and admin intents are decided,
            # persisted and their commands dispatched before the Tick (O(jobs) in the core) and the
            # heartbeats taken with them.
            if urgent is not None:
                await self.process(urgent, urgent=True)
            if tick is not None:
                await self._urgent_first()
                await self.process(tick)
                if time.monotonic() >= next_gauges:  # O(nodes): not on every tick, never before urgent work
                    for _ in refresh_gauge_slices(self):  # urgent inputs that came meanwhile go between slices
                        await anyio.sleep(0)
                        await self._urgent_first()
                    next_gauges = time.monotonic() + self.settings.metrics.refresh_s
            if heartbeats is not None:
                await self._urgent_first()
                await self.process(heartbeats)

    async def _urgent_first(self) -> None:
        """Urgent inputs that arrived while the previous stage ran (its persist and dispatch await): they are
        decided, persisted and dispatched before the next bulk stage (the Tick, a heartbeat batch), so a
        notice never waits behind bulk work taken before it arrived. At most ``URGENT_ROUNDS`` rounds: a
        flood of urgent inputs cannot starve the Tick."""
        for _ in range(URGENT_ROUNDS):
            batch = self.intake.take_urgent()
            if batch is None:
                return
            await self.process(batch, urgent=True)

    async def finish(self) -> None:
        """The final batch: what intake already took in is decided and persisted, with every pending
        liveness record (called once the loop has stopped). A daemon that lost the lease hands it all
        back instead (``process``), and naks every message it handed back (``_hand_back``). Admin requests
        that come later are refused at once (``submit``): the admin service stops after this, once every
        request it took is answered. Called once the pull loops have stopped."""
        if self.may_act():
            self.liveness.start_round()
        batch = self.intake.take()
        self._closed = True  # an admin request that comes from now on is refused, not left unanswered
        await self.process(batch)
        await self._nak_held()

    async def process(self, batch: Batch, *, urgent: bool = False) -> None:
        """Decide a batch, persist it, dispatch its commands, ack it (``pipeline``'s stages). ``urgent``
        batches carry no slice of a liveness flush round (their commands should leave as soon as possible)."""
        store, executor, state = self._running()
        if not self.may_act():  # deposed: the leader that took over decides this batch
            self._hand_back([msg for _kind, msg in batch.js], [i.reply for i in batch.shell if i.reply is not None])
            return
        t_begin = time.perf_counter()
        # decided, and its checkpoint commands handed to the executor before the outbox's round trip
        decided = pipeline.decide(batch, state, self._stages, executor)
        final = self._stop.is_set()
        self.liveness.settle(decided.liveness, decided.dirty, final=final)
        t_decided = time.perf_counter()
        # While this batch is written, a liveness slice must not write its dirty keys from the older
        # state (``_write_liveness``): the batch's newer value would be overwritten.
        self._persisting = decided.dirty

        async def send() -> None:
            # The other commands as soon as they are in the outbox, while the records are written: the
            # metrics, the acks and the next liveness slice come after.
            pipeline.dispatch(decided, executor)
            if decided.commands:
                await anyio.sleep(0)  # let the executor's tasks send before the records' publishes

        try:
            if decided.sent:
                await anyio.sleep(0)  # let their tasks send before the outbox's publishes
            records = await pipeline.persist(store, self.core, decided, after_outbox=send)
        finally:
            self._persisting = _NOTHING
        t_persisted = time.perf_counter()
        self.state = decided.state
        if not self.may_act():
            # The lease's deadline passed while the batch was written: the new leader may have loaded
            # the state before these writes landed, so it must get the batch's messages (nak: at once,
            # not after the ack wait; deciding them again is idempotent) and its admin requests fail.
            self._hand_back(decided.to_ack, decided.replies)
            decided.to_ack.clear()
            decided.replies.clear()
        for reply in decided.replies:  # admin requests: answered once the whole batch is persisted
            if not reply.done():
                reply.set_result(None)
        self._observe_batch(decided, records, t_begin, t_decided, t_persisted)
        self.observer.after_batch(state, decided, time.time())
        self.tracking.after_batch(state, decided, time.time())
        if not urgent and not final:
            self.liveness.write_slice()
        await pipeline.acknowledge(decided)
        self.events_decided += decided.decided
        self.batches += 1
        for name, n in decided.counts.items():
            self.metrics.events.labels(name).inc(n)
        for c in decided.commands.values():
            self.metrics.decisions.labels(type(c).__name__).inc()
        for reason, n in decided.holds.items():
            self.metrics.holds.labels(reason).inc(n)
        for reason, n in decided.at_risk.items():
            self.metrics.deadline_at_risk.labels(reason).inc(n)

    def _running(self) -> tuple[Store, Executor, State]:
        if self.store is None or self.executor is None or self.state is None:
            raise RuntimeError("the daemon is not started: no store, executor or state yet")
        return self.store, self.executor, self.state

    def _observe_batch(self, decided: Decided, records: int, t_begin: float, t_decided: float,
                       t_persisted: float) -> None:
        m = self.metrics
        m.batch_seconds.labels("decide").observe(t_decided - t_begin)
        m.batch_seconds.labels("persist").observe(t_persisted - t_decided)
        m.batch_events.observe(decided.decided)
        if t_persisted - t_begin > SLOW_BATCH_S:
            log.warning("slow_batch", decide_s=round(t_decided - t_begin, 3),
                        persist_s=round(t_persisted - t_decided, 3), events=decided.decided, records=records,
                        commands=len(decided.commands), audit=len(decided.audit), types=dict(decided.counts))

    def _hand_back(self, msgs: list[Msg], replies: list[asyncio.Future[None]]) -> None:
        """What a daemon that lost the lease holds: its JetStream messages are nak'ed (redelivered at once
        to the leader that took over, instead of after the ack wait), its admin requests fail with
        ``NotLeader`` (the client retries and reaches the new leader), executor results are dropped
        (the commands are still in the outbox: the new leader executes them again).

        The naks wait for ``finish`` (``_nak_held``, once the pull loops stopped): nak'ed while this
        daemon's pull request is open, a message is redelivered to that very request and lost when the
        pull stops - the new leader would get it only after the ack wait."""
        for fut in replies:
            if not fut.done():
                fut.set_exception(NotLeader(_NOT_LEADER))
        self._held.extend(msgs)
        if msgs or replies:
            log.warning("handed_back", messages=len(msgs), requests=len(replies))

    async def _nak_held(self) -> None:
        held, self._held = self._held, []
        for msg in held:
            try:
                await msg.nak()
            except Exception as e:  # disconnected: redelivered after the ack wait instead
                log.debug("nak_failed", error=repr(e))

    async def _write_liveness(self, keys: set[str]) -> None:
        """One slice of a liveness flush round, written off the decide loop from the latest state (not by
        a daemon that lost the lease)."""
        store, _executor, _state = self._running()
        if not self.may_act():
            return
        core = self.core

        def encode(ks: tuple[str, ...]) -> dict[str, bytes]:
            state = self.state
            assert state is not None  # set before the first batch; never unset
            persisting = self._persisting  # written by the batch in flight, newer than ``state``'s
            return core.state_to_records(state, [k for k in ks if k not in persisting] if persisting else ks)

        await store.write_records_background(keys, encode)


DEFAULT_CLUSTER_ID = DaemonSettings().cluster_id


def cluster_identity(state: State, had_records: bool, configured: str) -> str:
    """The cluster's identity, generated once and kept in the state: the one the state holds; else, for a
    state written by an older release, ``configured`` (its instances and runs carry that tag already); else
    ``configured`` when the operator set one; else a new unique ``orch-<12 hex digits>`` (never the shared
    default, so two clusters never claim each other's instances, runs or checkpoint roots)."""
    stored = state.meta.cluster_id
    if isinstance(stored, str) and stored:
        if configured not in (stored, DEFAULT_CLUSTER_ID):
            log.warning("cluster_id_kept", stored=stored, configured=configured,
                        hint="the state's identity wins: its instances and runs carry it")
        return stored
    if had_records or configured != DEFAULT_CLUSTER_ID:
        return configured
    return f"orch-{secrets.token_hex(6)}"


async def _first(*waiters: Callable[[], Awaitable[object]]) -> None:
    async with anyio.create_task_group() as tg:
        async def one(w: Callable[[], Awaitable[object]]) -> None:
            await w()
            tg.cancel_scope.cancel()
        for w in waiters:
            tg.start_soon(one, w)
