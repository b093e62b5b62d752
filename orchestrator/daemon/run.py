"""orchd: start-up, signals and shutdown around the decide loop.

Role: the wiring of the imperative shell around the pure core. One loop (``loop.Daemon``) owns the
state and runs each batch through the stages of ``pipeline``:

    take a batch (JetStream messages, heartbeats, shell inputs, a Tick when due)
      -> decode and screen each (rejected: count, ``term`` so it is never redelivered, go on)
      -> decide(state, event, now) for each, collecting dirty keys, commands, audit
      -> Store.persist(records of the union of dirty keys, outbox += commands, audit)
      -> ack the JetStream messages, answer admin requests, hand commands to the executor

so nothing is acked or executed before it is durable, and a restarted daemon resumes from KV, re-executing
outbox commands with the same ids/tokens. Timers are events (``Tick`` every ``daemon.tick_s``). The
NATS connection reconnects forever; its state reaches the core as ``BusState``. This module starts
and stops all of it, in named steps (``run_daemon``'s docstring lists them).

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
import importlib.metadata
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import msgspec
import structlog
from anyio.abc import TaskGroup, TaskStatus
from nats.aio.client import Client
from nats.js import JetStreamContext

from orchestrator import bus
from orchestrator.core.commands import Command, SendToAgent
from orchestrator.daemon.coreapi import CoreApi, default_core
from orchestrator.daemon.executor import Executor
from orchestrator.daemon.lease import LeaderLease, lease_bucket
from orchestrator.daemon.loop import Daemon
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.metrics_http import MetricsServer, serve_metrics
from orchestrator.daemon.registry import known_instance_types
from orchestrator.daemon.startup import (
    StartupError,
    bind_error,
    node_credentials,
    quietly,
    retrying,
    start_auth_callout,
)
from orchestrator.daemon.store import Store
from orchestrator.daemon.summaries import known_nodes
from orchestrator.natsserver import NatsServer, NatsServerError
from orchestrator.security.credentials import Credentials
from orchestrator.settings import Settings, SettingsError, settings_and_problems
from providers.base import CloudProvider
from wire import sdnotify

if TYPE_CHECKING:
    from orchestrator.security.authcallout import CalloutCredentials
    from providers.reaper import KnownNode

log = structlog.get_logger("orchd")

EXIT_LEASE_LOST = 3
T = TypeVar("T")


@dataclass
class _Resources:
    """What run_daemon opened, closed in reverse order on the way out (``_close``)."""

    server: NatsServer | None = None  # the embedded nats-server (no nats.urls)
    nc: Client | None = None  # intake: JetStream pulls, the admin service
    ctl: Client | None = None  # writes and commands
    hbc: Client | None = None  # heartbeats alone
    authc: Client | None = None  # the auth callout (credentials.mode = "callout")
    callout_credentials: CalloutCredentials | None = None
    http: MetricsServer | None = None


async def run_daemon(
    settings: Settings,
    providers: Mapping[str, CloudProvider],
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
    feeds (``orchestrator.daemon.feeds``, per ``settings.providers.feeds``); ``stop``: the caller's stop
    event (signals arrive even while standing by).

    Start-up steps, in order: embedded NATS (``_start_embedded_nats``), connections (``_connect``),
    streams and KV, ``/metrics`` (``_start_metrics``), the lease (``_take_lease``), the state
    (``_load_state``), the executor (``_start_executor``), then ``_serve`` (outbox, feeds, reaper,
    heartbeats, consumers, admin, discovery, the decide loop, the final batch); ``_close`` on the way out."""
    core = core or default_core(settings, known_instance_types(providers))
    d = Daemon(settings, providers, core, metrics or Metrics(), stop=stop)
    settings.state_path.mkdir(parents=True, exist_ok=True)
    res = _Resources()
    try:
        urls = await _start_embedded_nats(settings, res)
        d.nats_url = ",".join(urls)
        nc, ctl, hbc = await _connect(d, settings, urls, res)
        async with anyio.create_task_group() as watchdog_tg:
            watchdog_tg.start_soon(_feed_watchdog, d)
            await _lead_and_serve(d, settings, urls, res, (nc, ctl, hbc), feeds=feeds, tune_gc=tune_gc,
                                  task_status=task_status)
            watchdog_tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await _close(d, res)
    return d


async def _lead_and_serve(d: Daemon, settings: Settings, urls: tuple[str, ...], res: _Resources,
                          conns: tuple[Client, Client, Client], *, feeds: bool, tune_gc: bool,
                          task_status: TaskStatus[Daemon]) -> None:
    """Streams and KV, ``/metrics``, the lease (standing by until it is held), the state, the executor,
    then ``_serve`` until stopped."""
    nc, ctl, _hbc = conns
    topo = await _retrying(d, "ensure_topology", lambda: bus.ensure_topology(nc, settings.nats.stream_replicas))
    _start_metrics(d, res)  # a standby serves /metrics too (orchd_up 0): HA alerts need both sides
    try:
        lease = await _take_lease(d, topo.js)
    except ValueError as e:  # e.g. the lease bucket's TTL differs from daemon.lease_ttl_s
        raise StartupError(f"leader lease: {e}") from None
    if lease is None and settings.daemon.ha:
        return  # stopped while standing by
    # The lease is renewed from here on: loading the state may wait out a stream leader election
    # (seconds), longer than the lease TTL.
    async with anyio.create_task_group() as lease_tg:
        if lease is not None:
            lease_tg.start_soon(lease.run, partial(_on_lease_change, d))
        outbox = await _load_state(d, topo, ctl, tune_gc=tune_gc)
        credentials: Credentials | None = res.callout_credentials or (
            node_credentials(settings) if settings.credentials.enabled else None)
        executor = d.executor = _start_executor(d, ctl, urls, lease, credentials)
        await _serve(d, executor, topo.js, conns, outbox, credentials, feeds=feeds, task_status=task_status)
        lease_tg.cancel_scope.cancel()  # releases the lease (clean exit)


async def _feed_watchdog(d: Daemon) -> None:
    """``WATCHDOG=1`` every half ``WatchdogSec`` from the event loop (a blocked loop stops the pings), but
    only while the decide loop makes progress: starting, standing by and a NATS outage keep feeding it; a
    leader whose loop has not turned for ``daemon.stall_after_s`` stops, and systemd restarts it."""
    interval = sdnotify.watchdog_interval_s()
    if interval is None:
        return  # not under a systemd watchdog
    bound = d.settings.daemon.stall_after_s
    told = False
    while True:
        stalled = d.stalled_s()
        if stalled <= bound:
            sdnotify.notify_watchdog()
            told = False
        elif not told:
            told = True
            log.error("decide_loop_stalled", stalled_s=round(stalled, 1), bound_s=bound,
                      hint="no batch decided while connected: the systemd watchdog will restart orchd")
        await anyio.sleep(min(interval, max(0.1, bound / 4)))


async def _start_embedded_nats(settings: Settings, res: _Resources) -> tuple[str, ...]:
    """The NATS URLs: ``nats.urls``, else an embedded nats-server's (JetStream under <state_dir>/nats)."""
    if settings.nats.urls:
        return settings.nats.urls
    server = res.server = NatsServer(settings.state_path / "nats", host=settings.nats.embedded_host,
                                     port=settings.nats.embedded_port, name="orchd-embedded")
    try:
        await anyio.to_thread.run_sync(server.start)
    except NatsServerError as e:  # e.g. nats.embedded_port taken since the pre-flight check
        raise StartupError(f"nats.embedded_port: the embedded nats-server did not start: {e}") from None
    log.info("embedded_nats_started", url=server.url, store=str(server.store_dir))
    return (server.url,)


async def _connect(d: Daemon, settings: Settings, urls: tuple[str, ...], res: _Resources) -> tuple[
        Client, Client, Client]:
    """orchd's three connections (intake, writes/commands, heartbeats), after the auth callout's own
    connection in the ``callout`` credentials mode (orchd's logins go through it)."""
    if settings.credentials.enabled and settings.credentials.mode == "callout":
        res.authc, res.callout_credentials = await start_auth_callout(lambda: d.stop_requested, settings, urls)
    nc = res.nc = await bus.connect(settings.nats, urls, name="orchd", on_state=d.on_bus_state)
    # A second connection for writes and commands: their acks and replies never queue behind
    # the heartbeat flood that the intake connection reads (one reader task per connection).
    ctl = res.ctl = await bus.connect(settings.nats, urls, name="orchd-ctl")
    # And one for heartbeats alone: when orchd falls behind, their backlog (or the server's
    # slow-consumer drops) stays on this connection instead of delaying notices and admin calls.
    hbc = res.hbc = await bus.connect(settings.nats, urls, name="orchd-hb")
    d.connected = True
    d.metrics.nats_connected.set(1)
    return nc, ctl, hbc


async def _load_state(d: Daemon, topo: bus.Topology, ctl: Client, *, tune_gc: bool) -> dict[str, Command]:
    """The store, the state (only the leader reads: retried, a takeover may meet an election) and the
    outbox to execute again."""
    rejected = d.metrics.rejected
    store = d.store = Store(topo, writer=ctl, on_refused=lambda _subject, why: rejected.labels("store", why).inc())
    records, outbox = await _retrying(d, "load_state", store.load)
    d.restore(records)
    log.info("state_loaded", records=len(records), outbox=len(outbox), fencing_token=d.fencing_token)
    # The state of 10,000 nodes is a large, long-lived heap: move what exists now out of the
    # collector's view and collect young objects less often (full collections scan everything).
    if tune_gc:  # process-wide: only the orchd command asks for it, not embedders
        gc.collect()
        gc.freeze()
        gc.set_threshold(50_000, 50, 100)
    return outbox


def _start_executor(d: Daemon, ctl: Client, urls: tuple[str, ...], lease: LeaderLease | None,
                    credentials: Credentials | None) -> Executor:
    """The executor (acting only while the lease is valid)."""
    return Executor(d.settings, d.providers, ctl, d.intake.put_result, d.metrics, nats_urls=urls,
                    may_act=lease.valid if lease is not None else None,
                    credentials=credentials)


def _start_metrics(d: Daemon, res: _Resources) -> None:
    """The ``/metrics`` server, from before the lease: a standby answers with ``orchd_up`` 0."""
    settings = d.settings
    if settings.metrics.enabled:
        try:
            res.http = serve_metrics(d.metrics, settings.metrics.host, settings.metrics.port)
        except OSError as e:  # taken since the pre-flight check
            raise bind_error("metrics.port", settings.metrics.host, settings.metrics.port, e) from None
        d.metrics_url = f"http://{settings.metrics.host}:{res.http.server_port}/metrics"


async def _serve(d: Daemon, executor: Executor, js: JetStreamContext, conns: tuple[Client, Client, Client],
                 outbox: Mapping[str, Command], credentials: Credentials | None, *, feeds: bool,
                 task_status: TaskStatus[Daemon]) -> None:
    """Everything that runs while this daemon leads, until it stops; then the final batch."""
    from orchestrator.daemon import admin

    nc, ctl, hbc = conns
    settings = d.settings
    async with anyio.create_task_group() as tg:
        await tg.start(executor.run)
        d.attach_background(tg)
        for key, cmd in outbox.items():  # decided before a crash: execute again, same ids/tokens
            executor.submit(key, _refence(cmd, d.fencing_token), inherited=True)
        if feeds:
            _start_feeds(tg, d, js, executor)
        if d.providers and settings.daemon.reap_interval_s > 0:
            tg.start_soon(_reap_periodically, d)
        hb_sub = await hbc.subscribe(bus.SUBJECT_HEARTBEATS, cb=d.intake.on_heartbeat,
                                     pending_msgs_limit=500_000, pending_bytes_limit=512 * 1024 * 1024)
        ack_wait = bus.ack_wait_s(d.settings.daemon.lease_ttl_s)
        await _retrying(d, "ensure_consumers", lambda: bus.ensure_consumers(js, timeout_s=2.0, ack_wait=ack_wait))
        service = await admin.start_service(nc, d)
        if credentials is not None:  # the enrol endpoint (orch.enrol.<node>), on the leader only
            await credentials.serve(ctl)
        _write_discovery(d)  # readiness for orchctl and harnesses: written once the admin API answers
        await _decide_until_stopped(d, nc, task_status)
        with anyio.move_on_after(settings.daemon.shutdown_grace_s, shield=True):
            await quietly(hb_sub.unsubscribe())
            await d.finish()  # what was already taken in: decided and persisted, liveness records too
            await quietly(service.stop())  # after: every admin request it took in is answered first
        tg.cancel_scope.cancel()  # in-flight commands stay in the outbox for the next daemon


async def _decide_until_stopped(d: Daemon, nc: Client, task_status: TaskStatus[Daemon]) -> None:
    """The pull loops and the decide loop; ready (sd_notify, ``task_status``) once they run."""
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
                log.warning("shutdown_abandoned_batch", grace_s=d.settings.daemon.shutdown_grace_s)
        finally:
            with anyio.CancelScope(shield=True):
                sdnotify.notify_stopping("orchd stopping")
                log.info("orchd_stopping")
                intake_tg.cancel_scope.cancel()


async def _close(d: Daemon, res: _Resources) -> None:
    d.metrics.up.set(0)
    if res.http is not None:
        res.http.shutdown()
    for provider in d.providers.values():  # nodes that cannot outlive orchd (the local provider's)
        stopping = getattr(provider, "daemon_stopping", None)
        if stopping is not None:
            await quietly(anyio.to_thread.run_sync(stopping))
    for conn in (res.hbc, res.ctl, res.nc, res.authc):  # the callout connection last: the others log in through it
        if conn is not None:
            with anyio.move_on_after(3):
                await quietly(conn.close())
    if res.server is not None:
        await anyio.to_thread.run_sync(res.server.stop)
    _remove_discovery(d)
    log.info("orchd_stopped", events=d.events_decided, exit_code=d.exit_code)


async def _cancel_after_stop(d: Daemon, scope: anyio.CancelScope) -> None:
    await d.wait_for_stop()
    await anyio.sleep(d.settings.daemon.shutdown_grace_s)
    scope.cancel()


async def _retrying(d: Daemon, what: str, call: Callable[[], Awaitable[T]]) -> T:
    """``startup.retrying``, given up at once when the daemon is asked to stop."""
    return await retrying(lambda: d.stop_requested, what, call)


def _refence(cmd: Command, token: int) -> Command:
    """An agent command from the outbox, carrying this daemon's fencing token (same cmd_id).

    This daemon owns the persisted decisions of its predecessors; with their older token an agent
    that has already seen ours would refuse the command as stale and the decision would be lost."""
    if isinstance(cmd, SendToAgent) and cmd.command.fencing_token < token:
        return msgspec.structs.replace(cmd, command=msgspec.structs.replace(cmd.command, fencing_token=token))
    return cmd


async def _take_lease(d: Daemon, js: JetStreamContext) -> LeaderLease | None:
    """The fencing token. HA: stand by until this daemon holds the leader lease (returns the lease, or
    None when stopped first). Single daemon: a put on the lease bucket gives a revision greater than
    any earlier one (no lease is held, returns None)."""
    ds = d.settings.daemon
    kv = await _retrying(d, "lease_bucket", lambda: lease_bucket(js, ttl_s=ds.lease_ttl_s,
                                                                replicas=d.settings.nats.stream_replicas))
    if not ds.ha:
        epoch = json.dumps({"pid": os.getpid(), "host": os.uname().nodename, "ts": time.time()}).encode()
        # retried: a put that timed out but landed only makes the next revision (the token) greater
        d.fencing_token = await _retrying(d, "epoch", lambda: kv.put("epoch", epoch))
        return None
    lease = LeaderLease(kv, ttl_s=ds.lease_ttl_s, holder=f"{os.uname().nodename}:{os.getpid()}")
    log.info("standby", lease_ttl_s=ds.lease_ttl_s)
    sdnotify.notify_status("orchd standby: waiting for the leader lease")
    while not await lease.try_acquire():
        with anyio.move_on_after(ds.lease_ttl_s / 3):
            await d.wait_for_stop()
        if d.stop_requested:
            return None
    d.fencing_token = lease.revision
    log.info("lease_acquired", fencing_token=lease.revision)
    return lease


def _on_lease_change(d: Daemon, revision: int) -> None:
    if revision == 0:  # lost (CAS failure or local deadline passed): stop deciding at once
        log.error("lease_lost", fencing_token=d.fencing_token)
        d.exit_code = EXIT_LEASE_LOST
        d.request_stop()


async def _reap_periodically(d: Daemon) -> None:
    """providers.reaper on every provider, every daemon.reap_interval_s (orphans terminated after
    daemon.reap_grace_s; nothing is done while this daemon may not act, e.g. without a valid lease)."""

    async def read_state() -> tuple[dict[str, KnownNode], bool]:
        state = d.state  # loaded before this task starts
        return (known_nodes(state) if state is not None else {}), d.may_act()

    async def on_report(report: Any) -> None:
        if any(report.terminated.values()) or report.refused or report.errors:
            log.warning("reaper_report", **report.to_dict())

    await d.reaper_for().run_periodic(read_state, interval_s=d.settings.daemon.reap_interval_s,
                                      on_report=on_report)


def _start_feeds(tg: TaskGroup, d: Daemon, js: JetStreamContext, executor: Executor) -> None:
    """One price feed task per provider with a feed (orchestrator.daemon.registry.feed_plan)."""
    try:
        from orchestrator.daemon.feeds import run_price_feed
        from orchestrator.daemon.registry import feed_plan
    except ImportError as e:  # the feeds are optional for embedders
        log.warning("price_feeds_unavailable", error=str(e))
        return
    for plan in feed_plan(d.settings, d.providers):
        limiter = executor.limiter(plan.cloud)
        tg.start_soon(partial(run_price_feed, js, plan.provider, interval_s=plan.interval_s, limiter=limiter))
        log.info("price_feed_started", cloud=plan.cloud, interval_s=plan.interval_s)


def _write_discovery(d: Daemon) -> None:
    """<state_dir>/orchd.json: where orchctl finds this daemon when no server URL is given."""
    path = d.settings.state_path / "orchd.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"nats_url": d.nats_url, "metrics_url": d.metrics_url, "pid": os.getpid()}))
    tmp.replace(path)


def _remove_discovery(d: Daemon) -> None:
    """On the way out, orchd.json goes if this process wrote it: no stale address left for orchctl."""
    path = d.settings.state_path / "orchd.json"
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    from orchestrator.daemon.registry import providers_and_problems
    from orchestrator.daemon.startup import preflight_problems
    from wire.logs import configure

    p = argparse.ArgumentParser(prog="orchd", description="Control plane for training on spot GPUs")
    p.add_argument("--config", "-c", help="TOML settings file (ORCH_* env overrides apply)")
    p.add_argument("--check", action="store_true",
                   help="check the settings, the providers' tables and the ports, then exit: 0 fine, 2 problems")
    p.add_argument("--version", action="version", version="%(prog)s " + next(
        (d.version for d in importlib.metadata.distributions(name="spot-orchestrator")), "unknown"))
    args = p.parse_args(argv)
    # Every start-up problem in ONE report, exit 2: the settings' (file, ORCH_* and credentials), every
    # enabled provider's table, and what would fail later (a busy port, an unwritable state directory).
    settings, problems = settings_and_problems(args.config)
    providers: dict[str, CloudProvider] = {}
    if settings is not None:
        providers, more = providers_and_problems(settings)
        failed = {problem.split(":")[0] for problem in problems}  # a check of a stand-in default says nothing
        problems += more + [pf for pf in preflight_problems(settings) if pf.split(":")[0] not in failed]
    if problems or settings is None:
        print(f"orchd: {SettingsError(problems, args.config or 'settings')}", file=sys.stderr)
        return 2
    if args.check:
        print(f"orchd: {args.config or 'settings'}: no problems (providers: {', '.join(providers) or 'none'})")
        return 0
    configure(settings.log.level, settings.log.format)
    try:
        return anyio.run(_serve_until_stopped, settings, providers, backend="asyncio")
    except KeyboardInterrupt:
        return 130
    except StartupError as e:
        print(f"orchd: {e}", file=sys.stderr)
        return 2
    except BaseExceptionGroup as eg:  # StartupErrors raised inside the task groups
        startup = eg.subgroup(StartupError)
        if startup is None:
            raise
        print("orchd: " + "; ".join(map(str, _leaves(startup))), file=sys.stderr)
        return 2


def _leaves(eg: BaseExceptionGroup[Any]) -> list[BaseException]:
    """The exceptions of a (nested) group, groups flattened."""
    return [leaf for e in eg.exceptions for leaf in (_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])]


async def _serve_until_stopped(settings: Settings, providers: Mapping[str, CloudProvider]) -> int:
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
