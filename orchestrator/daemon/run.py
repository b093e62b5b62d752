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
import random
import signal
import sys
import time
from functools import partial
from typing import Any

import anyio
import msgspec
import nats.errors
import nats.js.errors
import structlog
from anyio.abc import TaskStatus

from orchestrator import bus
from wire import sdnotify
from orchestrator.core.inputs import LeaseChanged
from orchestrator.daemon.executor import Executor
from orchestrator.daemon.ingest import ShellItem
from orchestrator.daemon.lease import LeaderLease, lease_bucket
from orchestrator.daemon.loop import _EXPECTED, _HB_DECODER, _JS_TYPES, Daemon  # noqa: F401 (re-exported)
from orchestrator.daemon.metrics import Metrics
from orchestrator.natsserver import NatsServer
from orchestrator.settings import Settings, SettingsError, load_settings
from orchestrator.daemon.state import CoreApi, default_core, known_nodes
from orchestrator.daemon.store import Store

log = structlog.get_logger("orchd")

EXIT_LEASE_LOST = 3


class StartupError(RuntimeError):
    """A problem found while starting that an operator must fix (reported without a traceback)."""


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
    feeds (``orchestrator.daemon.feeds``, per ``settings.providers.feeds``)."""
    from orchestrator.daemon.run import admin
    from orchestrator.daemon.metrics_http import serve_metrics

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
    nc = ctl = hbc = authc = None
    http = None
    try:
        callout_credentials = None
        if settings.credentials.enabled and settings.credentials.mode == "callout":  # first: orchd's own logins go through it
            authc, callout_credentials = await _start_auth_callout(d, settings, urls)
        nc = await bus.connect(settings.nats, urls, name="orchd", on_state=d._on_bus_state)
        # A second connection for writes and commands: their acks and replies never queue behind
        # the heartbeat flood that the intake connection reads (one reader task per connection).
        ctl = await bus.connect(settings.nats, urls, name="orchd-ctl")
        # And one for heartbeats alone: when orchd falls behind, their backlog (or the server's
        # slow-consumer drops) stays on this connection instead of delaying notices and admin calls.
        hbc = await bus.connect(settings.nats, urls, name="orchd-hb")
        d.connected = True
        d.metrics.nats_connected.set(1)
        topo = await _retrying(d, "ensure_topology", lambda: bus.ensure_topology(nc, settings.nats.stream_replicas))
        try:
            lease = await _take_lease(d, topo.js)
        except ValueError as e:  # e.g. the lease bucket's TTL differs from daemon.lease_ttl_s
            raise StartupError(f"leader lease: {e}") from None
        if lease is None and settings.daemon.ha:
            return d  # stopped while standing by
        # The lease is renewed from here on: loading the state may wait out a stream leader election
        # (seconds), longer than the lease TTL.
        async with anyio.create_task_group() as lease_tg:
            if lease is not None:
                lease_tg.start_soon(lease.run, partial(_on_lease_change, d))
            d.store = Store(topo, writer=ctl)
            # only the leader reads: the state is its from here on (retried: a takeover may meet an election)
            records, outbox = await _retrying(d, "load_state", d.store.load)
            d.state = d.core.restore(records) if records else d.core.empty_state()
            d.intake.put_shell(ShellItem(LeaseChanged(revision=d.fencing_token)))
            log.info("state_loaded", records=len(records), outbox=len(outbox), fencing_token=d.fencing_token)
            # The state of 10,000 nodes is a large, long-lived heap: move what exists now out of the
            # collector's view and collect young objects less often (full collections scan everything).
            if tune_gc:  # process-wide: only the orchd command asks for it, not embedders
                gc.collect()
                gc.freeze()
                gc.set_threshold(50_000, 50, 100)
            credentials = callout_credentials or (node_credentials(settings) if settings.credentials.enabled else None)
            d.executor = Executor(settings, providers, ctl, d._on_result, d.metrics, nats_urls=urls,
                                  on_agent_sent=d._on_agent_sent,
                                  may_act=(lease.valid if lease is not None else _always), credentials=credentials)
            if settings.metrics.enabled:
                http = serve_metrics(d.metrics, settings.metrics.host, settings.metrics.port)
                d.metrics_url = f"http://{settings.metrics.host}:{http.server_port}/metrics"
            async with anyio.create_task_group() as tg:
                await tg.start(d.executor.run)
                d._bg_tg = tg
                for key, cmd in outbox.items():  # decided before a crash: execute again, same ids/tokens
                    d.executor.submit(key, _refence(cmd, d.fencing_token))
                if feeds:
                    _start_feeds(tg, d, topo.js)
                if providers and settings.daemon.reap_interval_s > 0:
                    tg.start_soon(_reap_periodically, d)
                hb_sub = await hbc.subscribe(bus.SUBJECT_HEARTBEATS, cb=d.intake.on_heartbeat,
                                            pending_msgs_limit=500_000, pending_bytes_limit=512 * 1024 * 1024)
                await _retrying(d, "ensure_consumers", lambda: bus.ensure_consumers(topo.js, timeout_s=2.0))
                service = await admin.start_service(nc, d)
                if credentials is not None:  # the enrol endpoint (orch.enrol.<node>), on the leader only
                    await credentials.serve(ctl)
                _write_discovery(d)  # readiness for orchctl and harnesses: written once the admin API answers
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
            lease_tg.cancel_scope.cancel()  # releases the lease (clean exit)
    finally:
        with anyio.CancelScope(shield=True):
            d.metrics.up.set(0)
            if http is not None:
                http.shutdown()
            for conn in (hbc, ctl, nc, authc):  # the callout connection last: the others log in through it
                if conn is not None:
                    with anyio.move_on_after(3):
                        await _quietly(conn.close())
            if server is not None:
                await anyio.to_thread.run_sync(server.stop)
            log.info("orchd_stopped", events=d.events_decided, exit_code=d.exit_code)
    return d


def _static_users(settings: Settings) -> list[dict]:
    """``credentials.static_users_file``: ``[{"name", "password_hash", "role": "orchd"|"orchctl"}]``."""
    from pathlib import Path

    path = settings.credentials.static_users_file
    try:
        users = json.loads(Path(path).read_text())
        for u in users:
            if u["role"] not in ("orchd", "orchctl") or not u["name"] or not u["password_hash"].startswith("$2"):
                raise ValueError(f"bad entry for {u.get('name')!r}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise StartupError(f"credentials.static_users_file {path}: {e!r}") from None
    return users


def node_credentials(settings: Settings) -> Any:
    """``NodeCredentials`` from ``settings.credentials`` (an external nats-server on this host that
    includes ``auth_file`` and writes ``server_pid_file``)."""
    from pathlib import Path

    from orchestrator.security.credentials import EnrollingIssuer, NodeCredentials
    from orchestrator.security.nats_auth import User, orchctl_permissions, orchd_permissions, signal_reload

    c = settings.credentials
    roles = {"orchd": orchd_permissions(), "orchctl": orchctl_permissions()}
    static = [User(name=u["name"], password_hash=u["password_hash"], permissions=roles[u["role"]])
              for u in _static_users(settings)]

    def reload() -> None:
        signal_reload(int(Path(c.server_pid_file).read_text().strip()))

    return NodeCredentials(EnrollingIssuer(c.auth_file, static_users=static, reload=reload),
                           enrol_ttl_s=c.enrol_ttl_s)


async def _start_auth_callout(d: Daemon, settings: Settings, urls: tuple[str, ...]) -> tuple[Any, Any]:
    """``[credentials] mode = "callout"``: connect as the auth user (the one the servers do not ask
    about), answer ``$SYS.REQ.USER.AUTH`` - on every orchd, standbys included, before orchd's own
    connections, which the callout authorizes - and return (connection, ``CalloutCredentials``)."""
    import dataclasses
    from pathlib import Path

    from orchestrator.security.authcallout import AuthCallout, CalloutCredentials, CredentialStore, StaticUser
    from orchestrator.security.nkeys import KeyPair, NkeyError

    c = settings.credentials
    problems, issuer, password = [], None, ""
    try:
        issuer = KeyPair.from_seed(Path(c.issuer_seed_file).read_text())
        if issuer.kind != "account":
            problems.append(f"credentials.issuer_seed_file: a {issuer.kind} seed, an account seed (SA...) is needed")
    except (OSError, NkeyError) as e:
        problems.append(f"credentials.issuer_seed_file {c.issuer_seed_file!r}: {e}")
    try:
        password = Path(c.auth_password_file).read_text().strip()
    except OSError as e:
        problems.append(f"credentials.auth_password_file {c.auth_password_file!r}: {e}")
    try:
        static = [StaticUser(u["name"], u["password_hash"], u["role"]) for u in _static_users(settings)]
    except StartupError as e:
        problems.append(str(e))
    if problems:
        raise StartupError("; ".join(problems))
    auth = dataclasses.replace(settings.nats, user=c.auth_user, password=password, token="", creds_file="",
                               nkey_seed_file="")
    authc = await bus.connect(auth, urls, name="orchd-auth")
    try:
        store = await _retrying(d, "credentials_bucket", lambda: CredentialStore.open(
            authc.jetstream(timeout=5.0), settings.nats.stream_replicas))
        await AuthCallout(issuer, store, static).serve(authc)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await _quietly(authc.close())
        raise
    log.info("auth_callout_serving", issuer=issuer.public_key, auth_user=c.auth_user, static_users=len(static))
    return authc, CalloutCredentials(store, enrol_ttl_s=c.enrol_ttl_s)


async def _cancel_after_stop(d: Daemon, scope: anyio.CancelScope) -> None:
    await d._stop.wait()
    await anyio.sleep(d.settings.daemon.shutdown_grace_s)
    scope.cancel()


async def _retrying(d: Daemon, what: str, call: Any, give_up_s: float = 60.0) -> Any:
    """``await call()``, retried on timeouts and 503s (idempotent JetStream set-up): a cluster still
    electing its JetStream meta leader or a stream leader (after a server died: ~5 s), or two orchd
    creating the same R3 streams at once (on a 3-server cluster both creates then time out; a retry
    finds the streams). A new leader must not crash on these while taking over."""
    deadline = time.monotonic() + give_up_s
    while True:
        try:
            return await call()
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError) as e:
            if time.monotonic() > deadline or d._stop.is_set():
                raise
            log.warning("jetstream_setup_retry", step=what, error=repr(e))
            await anyio.sleep(0.2 + random.random())  # jitter: do not collide with the other orchd again


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


async def _reap_periodically(d: Daemon) -> None:
    """providers.reaper on every provider, every daemon.reap_interval_s (orphans terminated after
    daemon.reap_grace_s; nothing is done while this daemon may not act, e.g. without a valid lease)."""

    async def read_state() -> tuple[dict, bool]:
        return known_nodes(d.state), d.may_act()

    async def on_report(report: Any) -> None:
        if any(report.terminated.values()) or report.refused or report.errors:
            log.warning("reaper_report", **report.to_dict())

    await d.reaper_for().run_periodic(read_state, interval_s=d.settings.daemon.reap_interval_s,
                                      on_report=on_report)


def _start_feeds(tg: Any, d: Daemon, js: Any) -> None:
    """One price feed task per provider with a feed (orchestrator.daemon.registry.feed_plan)."""
    try:
        from orchestrator.daemon.feeds import run_price_feed
        from orchestrator.daemon.registry import feed_plan
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
    from wire.logs import configure
    from orchestrator.daemon.registry import build_providers

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
    except SettingsError as e:
        print(f"orchd: {e}", file=sys.stderr)
        return 2
    try:
        return anyio.run(_serve_until_stopped, settings, providers, backend="asyncio")
    except KeyboardInterrupt:
        return 130
    except StartupError as e:
        print(f"orchd: {e}", file=sys.stderr)
        return 2
    except BaseExceptionGroup as eg:  # a StartupError raised inside the task group
        startup = eg.subgroup(StartupError)
        if startup is None:
            raise
        print(f"orchd: {startup.exceptions[0]}", file=sys.stderr)
        return 2


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
