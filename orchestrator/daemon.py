"""orchd: wiring, signals and the decide loop.

Role: the imperative shell around the pure core. One loop owns the state:

    take a batch (JetStream messages, heartbeats, shell inputs, a Tick when due)
      -> decode each (malformed: count, ``term`` so it is never redelivered, go on)
      -> decide(state, event, now) for each, collecting dirty keys, commands, audit
      -> Store.persist(records of the union of dirty keys, outbox += commands, audit)
      -> ack the JetStream messages, answer admin requests, hand commands to the executor

so nothing is acked or executed before it is durable, and a restarted daemon resumes from KV, re-executing
outbox commands with the same ids/tokens. Timers are events (``Tick`` every ``daemon.tick_s``). The
NATS connection reconnects forever; its state reaches the core as ``BusState``.

Embeddable: ``run_daemon(settings, providers, task_status=...)`` runs the whole daemon inside the
caller's task group (``await tg.start(run_daemon, settings, providers)`` returns a ``Daemon`` handle;
``handle.request_stop()`` shuts it down cleanly). ``main`` is the ``orchd`` console script.

Concurrency contract: one asyncio event loop (anyio on the asyncio backend, nats-py is asyncio-only).
Shutdown (SIGTERM/SIGINT or ``request_stop``): stop intake, decide and persist what was already taken,
cancel in-flight commands (they stay in the outbox), close NATS, stop the embedded server.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time
from collections import Counter, deque
from functools import partial
from typing import Any, Union

import anyio
import msgspec
import structlog
from anyio.abc import TaskStatus

from orchestrator import bus, events as ev, sdnotify
from orchestrator.core.inputs import BusState, LeaseChanged, Tick
from orchestrator.executor import Executor, Result
from orchestrator.lease import LeaderLease, lease_bucket
from orchestrator.ingest import Batch, Intake, ShellItem, screen, screen_heartbeat
from orchestrator.metrics import Metrics
from orchestrator.natsserver import NatsServer
from orchestrator.settings import Settings, SettingsError, load_settings
from orchestrator.state import CoreApi, default_core, refresh_gauges, summarize_event
from orchestrator.store import Store, outbox_key

log = structlog.get_logger("orchd")

_JS_TYPES = Union[ev.PriceTick, ev.PreemptionNotice, ev.NodeRegistered, ev.GenerationStarted,
                  ev.CheckpointCommitted, ev.RanksExited, ev.NodeLeaving]
_EXPECTED: dict[str, Any] = {"price": ev.PriceTick, "notice": ev.PreemptionNotice, "node_event": ev.NodeEvent}


MAX_HEARTBEATS_PER_BATCH = 1000
EXIT_LEASE_LOST = 3
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

    def request_stop(self) -> None:
        self._stop.set()

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


async def run_daemon(
    settings: Settings,
    providers: dict,
    *,
    core: CoreApi | None = None,
    metrics: Metrics | None = None,
    feeds: bool = True,
    stop: anyio.Event | None = None,
    tune_gc: bool = False,
    task_status: TaskStatus[Daemon] = anyio.TASK_STATUS_IGNORED,
) -> Daemon:
    """Run orchd until ``request_stop`` (or cancellation). ``task_status.started`` gets the handle.

    ``providers`` maps ``pool.cloud`` to the CloudProvider that serves it; ``core`` defaults to
    ``orchestrator.core`` (tests may pass another ``CoreApi``); ``feeds`` runs the providers' price
    feeds (``providers.feeds``, per ``settings.providers.feeds``)."""
    from orchestrator import admin
    from orchestrator.metrics_http import serve_metrics

    d = Daemon(settings, providers, core or default_core(settings), metrics or Metrics())
    if stop is not None:
        d._stop = stop  # the caller's stop event (signals arrive even while standing by)
    state_dir = settings.state_path
    state_dir.mkdir(parents=True, exist_ok=True)
    server: NatsServer | None = None
    urls = settings.nats.urls
    if not urls:
        server = NatsServer(state_dir / "nats", host=settings.nats.embedded_host, port=settings.nats.embedded_port,
                            name="orchd-embedded")
        await anyio.to_thread.run_sync(server.start)
        urls = (server.url,)
        log.info("embedded_nats_started", url=server.url, store=str(server.store_dir))
    d.nats_url = ",".join(urls)
    nc = ctl = hbc = None
    http = None
    try:
        nc = await bus.connect(settings.nats, urls, name="orchd", on_state=d._on_bus_state)
        # A second connection for writes and commands: their acks and replies never queue behind
        # the heartbeat flood that the intake connection reads (one reader task per connection).
        ctl = await bus.connect(settings.nats, urls, name="orchd-ctl")
        # And one for heartbeats alone: when orchd falls behind, their backlog (or the server's
        # slow-consumer drops) stays on this connection instead of delaying notices and admin calls.
        hbc = await bus.connect(settings.nats, urls, name="orchd-hb")
        d.connected = True
        d.metrics.nats_connected.set(1)
        topo = await bus.ensure_topology(nc, settings.nats.stream_replicas)
        lease = await _take_lease(d, topo.js)
        if lease is None and settings.daemon.ha:
            return d  # stopped while standing by
        d.store = Store(topo, writer=ctl)
        records, outbox = await d.store.load()  # only the leader reads: the state is its from here on
        d.state = d.core.restore(records) if records else d.core.empty_state()
        d.intake.put_shell(ShellItem(LeaseChanged(revision=d.fencing_token)))
        log.info("state_loaded", records=len(records), outbox=len(outbox), fencing_token=d.fencing_token)
        # The state of 10,000 nodes is a large, long-lived heap: move what exists now out of the
        # collector's view and collect young objects less often (full collections scan everything).
        if tune_gc:  # process-wide: only the orchd command asks for it, not embedders
            gc.collect()
            gc.freeze()
            gc.set_threshold(50_000, 50, 100)
        d.executor = Executor(settings, providers, ctl, d._on_result, d.metrics, nats_urls=urls,
                              on_agent_sent=d._on_agent_sent,
                              may_act=(lease.valid if lease is not None else _always))
        if settings.metrics.enabled:
            http = serve_metrics(d.metrics, settings.metrics.host, settings.metrics.port)
            d.metrics_url = f"http://{settings.metrics.host}:{http.server_port}/metrics"
        _write_discovery(d)
        async with anyio.create_task_group() as tg:
            await tg.start(d.executor.run)
            d._bg_tg = tg
            for key, cmd in outbox.items():  # decided before a crash: execute again, same ids/tokens
                d.executor.submit(key, _refence(cmd, d.fencing_token))
            if feeds:
                _start_feeds(tg, d, topo.js)
            if lease is not None:
                tg.start_soon(lease.run, partial(_on_lease_change, d))
            hb_sub = await hbc.subscribe(bus.SUBJECT_HEARTBEATS, cb=d.intake.on_heartbeat,
                                        pending_msgs_limit=500_000, pending_bytes_limit=512 * 1024 * 1024)
            await bus.ensure_consumers(topo.js)
            service = await admin.start_service(nc, d)
            async with anyio.create_task_group() as intake_tg:
                for kind, stream, consumer in bus.CONSUMERS:
                    intake_tg.start_soon(d.intake.pull_forever, nc, stream, consumer, kind)
                d.metrics.up.set(1)
                sdnotify.notify_ready(f"orchd ready, nats {d.nats_url}")
                log.info("orchd_ready", nats=d.nats_url, metrics=d.metrics_url, fencing_token=d.fencing_token)
                task_status.started(d)
                try:
                    with anyio.CancelScope() as loop_scope:
                        # A batch that cannot be persisted (NATS down) must not hold a SIGTERM forever:
                        # after the grace period it is abandoned - unacked, undispatched, redelivered.
                        intake_tg.start_soon(_cancel_after_stop, d, loop_scope)
                        await d.decide_loop()
                    if loop_scope.cancelled_caught:
                        log.warning("shutdown_abandoned_batch", grace_s=settings.daemon.shutdown_grace_s)
                finally:
                    with anyio.CancelScope(shield=True):
                        sdnotify.notify_stopping("orchd stopping")
                        log.info("orchd_stopping")
                        intake_tg.cancel_scope.cancel()
            with anyio.move_on_after(settings.daemon.shutdown_grace_s, shield=True):
                await _quietly(service.stop())
                await _quietly(hb_sub.unsubscribe())
                leftover = d.intake.take()
                d._flush_live = True  # and persist every liveness-only change
                await d.process(leftover)  # finish what was already taken in: decided and persisted
            tg.cancel_scope.cancel()  # in-flight commands stay in the outbox for the next daemon
    finally:
        with anyio.CancelScope(shield=True):
            d.metrics.up.set(0)
            if http is not None:
                http.shutdown()
            for conn in (hbc, ctl, nc):
                if conn is not None:
                    with anyio.move_on_after(3):
                        await _quietly(conn.close())
            if server is not None:
                await anyio.to_thread.run_sync(server.stop)
            log.info("orchd_stopped", events=d.events_decided, exit_code=d.exit_code)
    return d


async def _cancel_after_stop(d: Daemon, scope: anyio.CancelScope) -> None:
    await d._stop.wait()
    await anyio.sleep(d.settings.daemon.shutdown_grace_s)
    scope.cancel()


def _refence(cmd: Any, token: int) -> Any:
    """An agent command from the outbox, carrying this daemon's fencing token (same cmd_id).

    This daemon owns the persisted decisions of its predecessors; with their older token an agent
    that has already seen ours would refuse the command as stale and the decision would be lost."""
    inner = getattr(cmd, "command", None)
    if inner is not None and inner.fencing_token < token:
        return msgspec.structs.replace(cmd, command=msgspec.structs.replace(inner, fencing_token=token))
    return cmd


def _always() -> bool:
    return True


async def _take_lease(d: Daemon, js: Any) -> Any:
    """The fencing token. HA: stand by until this daemon holds the leader lease (returns the lease, or
    None when stopped first). Single daemon: a put on the lease bucket gives a revision greater than
    any earlier one (no lease is held, returns None)."""
    ds = d.settings.daemon
    kv = await lease_bucket(js, ttl_s=ds.lease_ttl_s, replicas=d.settings.nats.stream_replicas)
    if not ds.ha:
        d.fencing_token = await kv.put("epoch", json.dumps({"pid": os.getpid(), "host": os.uname().nodename,
                                                            "ts": time.time()}).encode())
        return None
    lease = LeaderLease(kv, ttl_s=ds.lease_ttl_s, holder=f"{os.uname().nodename}:{os.getpid()}")
    log.info("standby", lease_ttl_s=ds.lease_ttl_s)
    sdnotify.notify_status("orchd standby: waiting for the leader lease")
    while not await lease.try_acquire():
        with anyio.move_on_after(ds.lease_ttl_s / 3):
            await d._stop.wait()
        if d._stop.is_set():
            return None
    d.fencing_token = lease.revision
    log.info("lease_acquired", fencing_token=lease.revision)
    return lease


def _on_lease_change(d: Daemon, revision: int) -> None:
    if revision == 0:  # lost (CAS failure or local deadline passed): stop deciding at once
        log.error("lease_lost", fencing_token=d.fencing_token)
        d.exit_code = EXIT_LEASE_LOST
        d.request_stop()


def _start_feeds(tg: Any, d: Daemon, js: Any) -> None:
    """One price feed task per provider with a feed (providers.registry.feed_plan)."""
    try:
        from providers.feeds import run_price_feed
        from providers.registry import feed_plan
    except ImportError as e:  # the feeds are optional for embedders
        log.warning("price_feeds_unavailable", error=str(e))
        return
    for plan in feed_plan(d.settings, d.providers):
        limiter = d.executor._limiter(plan.cloud) if d.executor else None
        tg.start_soon(partial(run_price_feed, js, plan.provider, interval_s=plan.interval_s, limiter=limiter))
        log.info("price_feed_started", cloud=plan.cloud, interval_s=plan.interval_s)


async def _quietly(aw: Any) -> None:
    try:
        await aw
    except Exception as e:
        log.debug("shutdown_step_failed", error=repr(e))


def _write_discovery(d: Daemon) -> None:
    """<state_dir>/orchd.json: where orchctl finds this daemon when no server URL is given."""
    path = d.settings.state_path / "orchd.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"nats_url": d.nats_url, "metrics_url": d.metrics_url, "pid": os.getpid()}))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    from orchestrator.logs import configure
    from orchestrator.registry import ProviderConfigError, build_providers

    p = argparse.ArgumentParser(prog="orchd", description="Control plane for training on spot GPUs")
    p.add_argument("--config", "-c", help="TOML settings file (ORCH_* env overrides apply)")
    args = p.parse_args(argv)
    try:
        settings = load_settings(args.config)
    except SettingsError as e:
        print(f"orchd: {e}", file=sys.stderr)
        return 2
    configure(settings.log.level, settings.log.format)
    try:
        providers = build_providers(settings)
    except ProviderConfigError as e:
        print(f"orchd: {e}", file=sys.stderr)
        return 2
    try:
        return anyio.run(_serve_until_stopped, settings, providers, backend="asyncio")
    except KeyboardInterrupt:
        return 130


async def _serve_until_stopped(settings: Settings, providers: dict) -> int:
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:

        async def signals() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
                async for s in sigs:
                    log.info("signal_received", signal=signal.Signals(s).name)
                    stop.set()

        tg.start_soon(signals)
        d = await run_daemon(settings, providers, stop=stop, tune_gc=True)
        tg.cancel_scope.cancel()
    return d.exit_code


if __name__ == "__main__":
    sys.exit(main())
