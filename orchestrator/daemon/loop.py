"""The decide loop of orchd: batches in, decisions persisted, acks and commands out.

Role: ``Daemon`` is the running daemon's handle and owns the core's state. ``decide_loop`` takes a
batch from the intake, decides every event with the pure core, persists the union of the dirty keys
and the commands (``Store.persist``: outbox first), then acks, answers admin requests and hands the
commands to the executor. See docs/architecture.md for the ordering and what a crash leaves.

Concurrency contract: one task runs ``decide_loop``; nothing else mutates ``Daemon.state`` (admin
handlers read the immutable value). Producers reach the loop only through ``Daemon.intake``.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any, Union

import anyio
import msgspec
import structlog

import wire as ev
from orchestrator import bus
from wire import sdnotify
from orchestrator.core.inputs import BusState, Tick
from orchestrator.daemon.executor import Executor, Result
from orchestrator.daemon.ingest import Batch, Intake, ShellItem, screen, screen_heartbeat
from orchestrator.daemon.metrics import Metrics
from orchestrator.settings import Settings
from orchestrator.daemon.state import CoreApi, refresh_gauges, summarize_event
from orchestrator.daemon.store import Store, outbox_key

log = structlog.get_logger("orchd")

_JS_TYPES = Union[ev.PriceTick, ev.PreemptionNotice, ev.NodeRegistered, ev.GenerationStarted,
                  ev.CheckpointCommitted, ev.RanksExited, ev.NodeLeaving]
_EXPECTED: dict[str, Any] = {"price": ev.PriceTick, "notice": ev.PreemptionNotice, "node_event": ev.NodeEvent}


MAX_HEARTBEATS_PER_BATCH = 1000
SLOW_BATCH_S = 0.25
GAUGE_REFRESH_S = 10.0
_HB_DECODER = msgspec.json.Decoder(ev.Heartbeat)


def _hb_reason(e: Exception) -> str:
    """The same rejection labels as ``events.decode``."""
    text = str(e)
    if "Invalid value" in text and "type" in text:
        return "unknown_type"
    if "malformed" in text or "truncated" in text:
        return "bad_json"
    return "bad_schema"


class Daemon:
    """The running daemon's handle: state and stats for the admin service, tests and the demo."""

    def __init__(self, settings: Settings, providers: dict, core: CoreApi, metrics: Metrics) -> None:
        self.settings = settings
        self.providers = providers
        self.core = core
        self.metrics = metrics
        self.intake = Intake(metrics)
        self.state: Any = None
        self.store: Store | None = None
        self.executor: Executor | None = None
        self.nats_url = ""
        self.metrics_url = ""
        self.started_ts = time.time()
        self.connected = False
        self.fencing_token = 0
        self.events_decided = 0
        self.batches = 0
        self.recent: deque[dict] = deque(maxlen=2000)  # decided commands, for `orchctl events`
        self.recent_seq = 0
        self.notice_ts: dict[str, float] = {}  # cmd_id -> notice publish ts (latency metric)
        self._live: set[str] = set()  # node keys changed by heartbeats only, not yet persisted
        self._flush_live = False  # set every liveness_flush_s: start a flush round
        self._flushing: set[str] = set()  # keys of the current flush round not yet written
        self._bg_flush_busy = False  # one background flush slice at a time
        self._bg_keys: set[str] = set()  # the keys of the slice being written
        self._bg_tg: Any = None  # the task group that runs background flush slices
        self._stop = anyio.Event()
        self.exit_code = 0
        self._reaper: Any = None

    def request_stop(self) -> None:
        self._stop.set()

    def may_act(self) -> bool:
        """True while this daemon may change the world (single daemon, or HA with a valid lease)."""
        return self.executor.may_act() if self.executor is not None else False

    def reaper_for(self) -> Any:
        """The one Reaper of this daemon (its orphan grace timers are shared by every pass)."""
        if self._reaper is None:
            from providers.reaper import Reaper

            self._reaper = Reaper(self.providers, cluster_id=self.settings.daemon.cluster_id,
                                  grace_s=self.settings.daemon.reap_grace_s)
        return self._reaper

    async def submit(self, event: Any) -> None:
        """Feed a shell event (admin intent) and return once its decision is persisted."""
        import asyncio

        fut = asyncio.get_running_loop().create_future()
        self.intake.put_shell(ShellItem(event, fut))
        await fut

    def _on_bus_state(self, connected: bool) -> None:
        self.connected = connected
        self.metrics.nats_connected.set(1 if connected else 0)
        self.intake.put_shell(ShellItem(BusState(connected=connected)))

    def _on_result(self, result: Result) -> None:
        self.intake.put_shell(ShellItem(result))

    def _on_agent_sent(self, cmd: Any) -> None:
        ts = self.notice_ts.pop(cmd.command.cmd_id, None)
        if ts is not None:
            self.metrics.notice_to_command.observe(max(0.0, time.time() - ts))

    # --- the decide loop ---------------------------------------------------------------------------

    async def decide_loop(self) -> None:
        tick_s = self.settings.daemon.tick_s
        next_tick = time.monotonic() + tick_s
        next_flush = time.monotonic() + self.settings.daemon.liveness_flush_s
        next_gauges = 0.0
        while not self._stop.is_set():
            with anyio.move_on_after(max(0.0, next_tick - time.monotonic())):
                await _first(self.intake.wait, self._stop.wait)
            batch = self.intake.take(MAX_HEARTBEATS_PER_BATCH)
            tick = None
            if time.monotonic() >= next_tick:
                tick = Batch([], [], [ShellItem(Tick())])
                next_tick = time.monotonic() + tick_s
                if time.monotonic() >= next_flush:
                    self._flush_live = True
                    next_flush = time.monotonic() + self.settings.daemon.liveness_flush_s
                sdnotify.notify_watchdog()
            # Urgent first: notices, node events, executor results and admin intents are decided,
            # persisted and their commands dispatched before the Tick (O(jobs) in the core) and the
            # heartbeats taken with them.
            if batch.js or batch.shell:
                await self.process(Batch(batch.js, [], batch.shell), urgent=True)
            if tick is not None:
                await self.process(tick)
                if time.monotonic() >= next_gauges:  # O(nodes): not on every tick, never before urgent work
                    refresh_gauges(self)
                    next_gauges = time.monotonic() + GAUGE_REFRESH_S
            if batch.hb:
                await self.process(Batch([], batch.hb, []))

    async def process(self, batch: Batch, *, urgent: bool = False) -> None:
        """Decide a batch, persist it, ack it, dispatch its commands. ``urgent`` batches carry no
        slice of a liveness flush round (their commands should leave as soon as possible)."""
        t_begin = time.perf_counter()
        core = self.core
        state = self.state
        dirty: set[str] = set()
        new_cmds: dict[str, Any] = {}
        done_keys: list[str] = []
        audit: list[tuple[str | None, bytes]] = []
        counts: Counter[str] = Counter()
        to_ack: list[Any] = []
        notice_of: dict[str, float] = {}
        decided = 0

        live = self._live
        is_hb = ev.Heartbeat

        def run(event: Any, now: float, publish_ts: float | None = None) -> bool:
            nonlocal state, decided
            try:
                d = core.decide(state, event, now)
            except Exception as e:  # a core bug must not stop the daemon: skip the event, loudly
                self.metrics.rejected.labels(type(event).__name__, "core_error").inc()
                log.exception("decide_failed", event_type=type(event).__name__, error=repr(e))
                return False
            state = d.state
            decided += 1
            counts[type(event).__name__] += 1
            if d.dirty:
                dirty.update(d.dirty)
            elif type(event) is is_hb:
                live.add("node." + event.node_id)  # liveness only: persisted at a lower rate
            if d.commands or d.audit:
                self._log_decision(event, d)
                for c in d.commands:
                    key = outbox_key(c)
                    new_cmds[key] = c
                    if publish_ts is not None and isinstance(event, ev.PreemptionNotice):
                        inner = getattr(c, "command", None)
                        if isinstance(inner, ev.CheckpointCmd):
                            notice_of[inner.cmd_id] = publish_ts
                for a in d.audit:
                    audit.append((getattr(a, "job_id", None), core.encode_audit(a)))
            if isinstance(event, ev.PreemptionNotice):
                node = state.nodes.get(event.node_id)
                if node is not None:
                    self.metrics.preemptions.labels(node.pool.cloud, node.pool_name, "notice").inc()
            return True

        now = time.time()
        for item in batch.shell:
            if isinstance(item.event, Result):
                done_keys.append(item.event.outbox_key)
                for e in item.event.events:
                    run(e, now)
            else:
                run(item.event, now)
        for kind, msg in batch.js:
            try:
                event = ev.decode(msg.data, _EXPECTED.get(bus.message_kind(msg.subject), _JS_TYPES))
                reason = screen(msg.subject, event)
                if reason is not None:
                    raise ev.WireError(reason, f"{type(event).__name__} on {msg.subject}")
            except ev.WireError as e:
                self.metrics.rejected.labels(bus.message_kind(msg.subject), e.reason).inc()
                log.warning("message_rejected", subject=msg.subject, reason=e.reason, detail=e.detail[:200])
                await _term(msg)
                continue
            try:
                publish_ts = msg.metadata.timestamp.timestamp()
            except Exception:
                publish_ts = None
            if publish_ts is not None:
                self.metrics.event_lag.observe(max(0.0, now - publish_ts))
            if run(event, time.time(), publish_ts):
                to_ack.append(msg)
            else:
                await _term(msg)  # poison for the core: never redeliver it forever
        # Heartbeats: the hot path, kept lean (no per-event closure, counter or context binding).
        hb_decode = _HB_DECODER.decode
        decide = core.decide
        n_hb = 0
        for i, msg in enumerate(batch.hb):
            try:
                if len(msg.data) > ev.MAX_MESSAGE_BYTES:
                    raise ev.WireError("too_large", str(len(msg.data)))
                hb = hb_decode(msg.data)
                if hb.v != ev.SCHEMA_VERSION:
                    raise ev.WireError("bad_version", str(hb.v))
                bad = screen_heartbeat(msg.subject, hb)
                if bad is not None:
                    raise ev.WireError(bad, msg.subject)
            except (msgspec.DecodeError, ev.WireError) as e:
                reason = e.reason if isinstance(e, ev.WireError) else _hb_reason(e)
                self.metrics.rejected.labels("heartbeat", reason).inc()
                continue
            if i % 256 == 0:
                now = time.time()
                self.metrics.event_lag.observe(max(0.0, now - hb.ts))
            try:
                d = decide(state, hb, now)
            except Exception as e:
                self.metrics.rejected.labels("Heartbeat", "core_error").inc()
                log.exception("decide_failed", event_type="Heartbeat", error=repr(e))
                continue
            state = d.state
            n_hb += 1
            if d.dirty:
                dirty.update(d.dirty)
            else:
                live.add("node." + hb.node_id)
            if d.commands or d.audit:
                self._log_decision(hb, d)
                for c in d.commands:
                    new_cmds[outbox_key(c)] = c
                for a in d.audit:
                    audit.append((getattr(a, "job_id", None), core.encode_audit(a)))
        decided += n_hb
        if n_hb:
            counts["Heartbeat"] += n_hb
        if self._flush_live:  # a flush round started: move this round's keys out, drain them in slices
            self._flushing |= live
            live.clear()
            self._flush_live = False
        if self._stop.is_set() and (self._flushing or self._bg_keys):  # shutting down: all of them now
            dirty.update(self._flushing, self._bg_keys)
            self._flushing.clear()
        t_decided = time.perf_counter()
        records = core.state_to_records(state, frozenset(dirty)) if dirty else {}
        live.difference_update(dirty)
        if new_cmds and done_keys:  # a command decided again in this batch keeps its outbox entry
            done_keys = [k for k in done_keys if k not in new_cmds]
        await self.store.persist(records, new_cmds, done_keys, audit)  # type: ignore[union-attr]
        t_persisted = time.perf_counter()
        m = self.metrics
        m.batch_seconds.labels("decide").observe(t_decided - t_begin)
        m.batch_seconds.labels("persist").observe(t_persisted - t_decided)
        m.batch_events.observe(decided)
        if t_persisted - t_begin > SLOW_BATCH_S:
            log.warning("slow_batch", decide_s=round(t_decided - t_begin, 3), persist_s=round(t_persisted - t_decided, 3),
                        events=decided, records=len(records), commands=len(new_cmds), audit=len(audit),
                        types=dict(counts))
        self.state = state
        if self._flushing and not urgent and not self._stop.is_set() and not self._bg_flush_busy:
            take = self.settings.daemon.liveness_flush_max
            keys = {self._flushing.pop() for _ in range(min(take, len(self._flushing)))}
            self._bg_flush_busy = True
            self._bg_tg.start_soon(self._flush_in_background, keys)  # type: ignore[union-attr]
        for msg in to_ack:
            await _ack(msg)
        for item in batch.shell:
            if item.reply is not None and not item.reply.done():
                item.reply.set_result(None)
        self.notice_ts.update(notice_of)
        for key, c in new_cmds.items():
            self.executor.submit(key, c)  # type: ignore[union-attr]
        if new_cmds:
            await anyio.sleep(0)  # let the executor's tasks send before the next batch is decided
        self.events_decided += decided
        self.batches += 1
        for name, n in counts.items():
            self.metrics.events.labels(name).inc(n)
        for c in new_cmds.values():
            self.metrics.decisions.labels(type(c).__name__).inc()

    async def _flush_in_background(self, keys: set[str]) -> None:
        """One slice of a liveness flush round, written off the decide loop from the latest state."""
        self._bg_keys = keys
        try:
            await self.store.write_records_background(  # type: ignore[union-attr]
                keys, lambda ks: self.core.state_to_records(self.state, ks))
        finally:
            self._bg_flush_busy = False
            self._bg_keys = set()

    def _log_decision(self, event: Any, d: Any) -> None:
        ctx = summarize_event(event)
        with structlog.contextvars.bound_contextvars(**ctx):
            for c in d.commands:
                info = _describe_command(c)
                log.info("command_decided", **info)
                self.recent_seq += 1
                self.recent.append({"seq": self.recent_seq, "ts": time.time(), "event": type(event).__name__,
                                    **ctx, **info})
            for a in d.audit:
                log.debug("decision_audit", entry=str(a)[:300])


def _describe_command(c: Any) -> dict:
    info: dict = {"command": type(c).__name__}
    inner = getattr(c, "command", None)
    if inner is not None:
        info.update(kind=type(inner).__struct_config__.tag, node=inner.node_id, cmd_id=inner.cmd_id,
                    job=inner.job_id, generation=inner.generation)
    for attr in ("job_id", "node_id", "token", "reason"):
        if hasattr(c, attr):
            info[attr.replace("_id", "") if attr != "token" else attr] = getattr(c, attr)
    if hasattr(c, "pool") and c.pool is not None:
        info["pool"] = c.pool.name
    if hasattr(c, "node_ids"):
        info["nodes"] = list(c.node_ids)
    return info


async def _first(*waiters: Any) -> None:
    async with anyio.create_task_group() as tg:
        async def one(w: Any) -> None:
            await w()
            tg.cancel_scope.cancel()
        for w in waiters:
            tg.start_soon(one, w)


async def _ack(msg: Any) -> None:
    try:
        await msg.ack()
    except Exception as e:  # disconnected: the message is redelivered and decided again (idempotent)
        log.debug("ack_failed", error=repr(e))


async def _term(msg: Any) -> None:
    try:
        await msg.term()
    except Exception as e:
        log.debug("term_failed", error=repr(e))


# --- running ---------------------------------------------------------------------------------------
