"""Start-up helpers of orchd: retried JetStream set-up and the credentials modes' start.

Role: what ``run.run_daemon`` needs before the daemon leads, that an operator's configuration can get
wrong (reported as ``StartupError``, without a traceback) or that a cluster in an election makes slow
(``retrying``). The credentials helpers build ``[credentials]``'s two modes: ``node_credentials``
(``file``: an external nats-server's users include) and ``start_auth_callout`` (``callout``).

``preflight_problems`` checks, before anything starts, what would otherwise fail deep in the start (a
busy port, an unwritable state directory), so that ``run.main`` reports it with the settings' and the
providers' problems in one message (exit 2).

Concurrency contract: coroutines on the daemon's event loop; ``node_credentials`` and
``preflight_problems`` are synchronous.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client

from orchestrator import bus
from orchestrator.settings import Settings

if TYPE_CHECKING:
    from orchestrator.security.authcallout import CalloutCredentials
    from orchestrator.security.credentials import NodeCredentials
    from orchestrator.security.nkeys import KeyPair

log = structlog.get_logger("orchd")

T = TypeVar("T")


class StartupError(RuntimeError):
    """A problem found while starting that an operator must fix (reported without a traceback)."""


JS_NO_SUITABLE_PEERS = 10005
"""JetStream's "no suitable peers for placement": a replicated stream asked of a cluster whose servers
do not all know each other yet (just started) or with a server down."""


def _transient(e: Exception) -> bool:
    if isinstance(e, nats.js.errors.APIError) and not isinstance(e, nats.js.errors.ServiceUnavailableError):
        return e.err_code == JS_NO_SUITABLE_PEERS
    return True


async def retrying(stopping: Callable[[], bool], what: str, call: Callable[[], Awaitable[T]],
                   give_up_s: float = 60.0) -> T:
    """``await call()``, retried on timeouts, 503s and "no suitable peers" (idempotent JetStream set-up):
    a cluster still electing its JetStream meta leader or a stream leader (after a server died: ~5 s), a
    cluster just started whose servers do not all know each other yet (an R3 stream cannot be placed), or
    two orchd creating the same R3 streams at once (on a 3-server cluster both creates then time out; a
    retry finds the streams). A new leader must not crash on these while taking over. ``stopping()``: give
    up at once (the daemon is asked to stop)."""
    deadline = time.monotonic() + give_up_s
    while True:
        try:
            return await call()
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.APIError) as e:
            if not _transient(e) or time.monotonic() > deadline or stopping():
                raise
            log.warning("jetstream_setup_retry", step=what, error=repr(e))
            await anyio.sleep(0.2 + random.random())  # jitter: do not collide with the other orchd again


def static_users(settings: Settings) -> list[dict[str, str]]:
    """``credentials.static_users_file``: ``[{"name", "password_hash", "role"}]``, role one of orchd, orchctl,
    feed, feed:<cloud> (``nats_auth.role_permissions``)."""
    from orchestrator.security.nats_auth import role_permissions

    path = settings.credentials.static_users_file
    try:
        users = json.loads(Path(path).read_text())
        for u in users:
            role_permissions(u["role"])  # ValueError: an unknown role
            if not u["name"] or not u["password_hash"].startswith("$2"):
                raise ValueError(f"bad entry for {u.get('name')!r}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise StartupError(f"credentials.static_users_file {path}: {e!r}") from None
    return list(users)


def node_credentials(settings: Settings) -> NodeCredentials:
    """``NodeCredentials`` from ``settings.credentials`` (an external nats-server on this host that
    includes ``auth_file`` and writes ``server_pid_file``)."""
    from orchestrator.security.credentials import EnrollingIssuer, NodeCredentials
    from orchestrator.security.nats_auth import User, role_permissions, signal_reload

    c = settings.credentials
    static = [User(name=u["name"], password_hash=u["password_hash"], permissions=role_permissions(u["role"]))
              for u in static_users(settings)]

    def reload() -> None:
        signal_reload(int(Path(c.server_pid_file).read_text().strip()))

    return NodeCredentials(EnrollingIssuer(c.auth_file, static_users=static, reload=reload),
                           enrol_ttl_s=c.enrol_ttl_s)


def _callout_secrets(settings: Settings, problems: list[str]) -> tuple[KeyPair | None, str]:
    """The callout's issuer key pair and the auth user's password; each problem appended to ``problems``."""
    from orchestrator.security.nkeys import KeyPair, NkeyError

    c = settings.credentials
    issuer, password = None, ""
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
    return issuer, password


async def start_auth_callout(stopping: Callable[[], bool], settings: Settings, urls: tuple[str, ...]) -> tuple[
        Client, CalloutCredentials]:
    """``[credentials] mode = "callout"``: connect as the auth user (the one the servers do not ask
    about), answer ``$SYS.REQ.USER.AUTH`` - on every orchd, standbys included, before orchd's own
    connections, which the callout authorizes - and return (connection, ``CalloutCredentials``).
    Every bad credential file is reported in one ``StartupError``."""
    from orchestrator.security.authcallout import AuthCallout, CalloutCredentials, CredentialStore, StaticUser

    c = settings.credentials
    problems: list[str] = []
    issuer, password = _callout_secrets(settings, problems)
    static: list[StaticUser] = []
    try:
        static = [StaticUser(u["name"], u["password_hash"], u["role"]) for u in static_users(settings)]
    except StartupError as e:
        problems.append(str(e))
    if problems or issuer is None:
        raise StartupError("; ".join(problems))
    auth = dataclasses.replace(settings.nats, user=c.auth_user, password=password, token="", creds_file="",
                               nkey_seed_file="")
    authc = await bus.connect(auth, urls, name="orchd-auth")
    try:
        store = await retrying(stopping, "credentials_bucket", lambda: CredentialStore.open(
            authc.jetstream(timeout=5.0), settings.nats.stream_replicas))
        await AuthCallout(issuer, store, static).serve(authc)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await quietly(authc.close())
        raise
    log.info("auth_callout_serving", issuer=issuer.public_key, auth_user=c.auth_user, static_users=len(static))
    return authc, CalloutCredentials(store, enrol_ttl_s=c.enrol_ttl_s)


def preflight_problems(settings: Settings) -> list[str]:
    """What would stop orchd later in its start, checked before anything starts, each ``key: why``: every
    address it binds is free (``metrics.port``, the embedded server's ``nats.embedded_port``) and the state
    directory can be written."""
    out = []
    if settings.metrics.enabled and settings.metrics.port > 0:
        out += _bind_problems("metrics.port", settings.metrics.host, settings.metrics.port)
    if not settings.nats.urls and settings.nats.embedded_port > 0:
        out += _bind_problems("nats.embedded_port", settings.nats.embedded_host, settings.nats.embedded_port)
    state = settings.state_path.absolute()
    existing = next(p for p in (state, *state.parents) if p.exists())  # orchd creates the rest
    if not existing.is_dir():
        out.append(f"daemon.state_dir: {state} cannot be created: {existing} is not a directory")
    elif not os.access(existing, os.W_OK | os.X_OK):
        out.append(f"daemon.state_dir: {state} cannot be created or written: no write access to {existing}")
    return out


def _bind_problems(key: str, host: str, port: int) -> list[str]:
    """[] when ``host:port`` can be bound now (the same SO_REUSEADDR as the servers: a TIME_WAIT is fine)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        return [f"{key}: cannot resolve {host!r}: {e.strerror}"]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            return [f"{key}: cannot listen on {host}:{port}: {e.strerror} (another process has the port?)"]
    return []


def bind_error(key: str, host: str, port: int, e: OSError) -> StartupError:
    """A server that failed to bind after the pre-flight check (the port was taken meanwhile)."""
    return StartupError(f"{key}: cannot listen on {host}:{port}: {e.strerror or e}")


async def quietly(aw: Awaitable[Any]) -> None:
    """Await a shutdown step; a failure is logged at debug level (the step is best effort)."""
    try:
        await aw
    except Exception as e:
        log.debug("shutdown_step_failed", error=repr(e))
