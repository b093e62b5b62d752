"""The agent's NATS connection and its enrolment.

Role: connect to NATS with the configured credentials (user/password, token, .creds file, TLS CA) and
keep trying until the server answers (a daemon must not give up); reconnect forever afterwards. With
an enrolment token and no other credential, the node's own NATS user comes from enrolment
(orchestrator/security/credentials.py): connect as ``enrol-<node>`` with the token as password, request
``orch.enrol.<node>``, store the answer in ``<work_dir>/nats-credential.json`` (0600), which later
restarts of the agent reuse.

Logging while NATS (or orchd) is away: one line per state change, not one per attempt.
``nats_disconnected`` and ``nats_reconnected`` (with the failed attempts) from nats-py's callbacks;
the failed attempts themselves (nats-py's error callback, every ``reconnect_time_wait`` - also before
the first connection, which nats-py retries itself) as ``nats_unreachable`` at the 1st, 2nd, 4th,
8th ... consecutive one; ``nats_connected`` when the first connection came after failures. Closing a
connection whose server is gone is quiet (``close_quietly``): no traceback on the way out.

Concurrency contract: ``connect`` is awaited once, from the agent's ``run``, before anything else.
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import nats
import nats.errors
import structlog

from agent.config import AgentConfig

log = structlog.get_logger("agent")

CREDENTIAL_FILE = "nats-credential.json"


async def connect(cfg: AgentConfig, work_dir: Path, *, pending: Callable[[], int] = lambda: 0) -> nats.NATS:
    """A connected client; retries (capped backoff) until the server answers. ``pending``: the events
    waiting in the outbox, logged on a reconnect."""
    state = _LinkLog()
    opts = _options(cfg, pending, state)
    if cfg.enrol_token and not (cfg.nats_user or cfg.nats_token or cfg.nats_creds_file):
        user, password = await node_credential(cfg, work_dir, opts)
        # agent_permissions (orchestrator/nats_auth.py): replies only on the node's own inbox prefix
        opts.update(user=user, password=password, inbox_prefix=f"_INBOX.{cfg.node_id}")
    wait = 0.2
    while True:
        try:
            nc = await nats.connect(**opts)
        except Exception as e:  # any failure: the server is not up yet, keep trying
            state.failed(e)
            await anyio.sleep(wait)
            wait = min(2.0, wait * 2)
            continue
        if state.failures:
            log.info("nats_connected", failed_attempts=state.failures)
            state.failures = 0
        return nc


class _LinkLog:
    """Consecutive failed connection attempts, logged at the 1st, 2nd, 4th, 8th ... (see the module docstring)."""

    def __init__(self) -> None:
        self.failures = 0

    def failed(self, e: BaseException) -> None:
        self.failures += 1
        if self.failures & (self.failures - 1) == 0:
            log.warning("nats_unreachable", error=repr(e), failed_attempts=self.failures)


async def close_quietly(nc: nats.NATS, timeout_s: float = 2.0) -> None:
    """Close the connection, bounded in time; a server already gone (connection reset, closed
    transport) is expected on the way out and logged as one debug line, never raised."""
    with anyio.move_on_after(timeout_s):
        try:
            await nc.close()
        except Exception as e:  # any failure: the connection is unusable anyway, the agent is leaving
            log.debug("nats_close_failed", error=repr(e))


def _options(cfg: AgentConfig, pending: Callable[[], int], state: _LinkLog | None = None) -> dict[str, Any]:
    link = state or _LinkLog()

    async def on_error(e: Exception) -> None:
        if isinstance(e, (OSError, TimeoutError, nats.errors.NoServersError)):  # a failed (re)connect attempt
            link.failed(e)
        else:
            log.debug("nats_error", error=repr(e))

    async def on_disconnect() -> None:
        log.warning("nats_disconnected")

    async def on_reconnect() -> None:
        log.info("nats_reconnected", pending_events=pending(), failed_attempts=link.failures)
        link.failures = 0

    opts: dict[str, Any] = dict(
        servers=list(cfg.nats_urls), name=f"orch-agent-{cfg.node_id}", max_reconnect_attempts=-1,
        reconnect_time_wait=0.5, connect_timeout=2, ping_interval=10, max_outstanding_pings=2,
        error_cb=on_error, disconnected_cb=on_disconnect, reconnected_cb=on_reconnect)
    if cfg.nats_user:
        opts.update(user=cfg.nats_user, password=cfg.nats_password)
    if cfg.nats_token:
        opts["token"] = cfg.nats_token
    if cfg.nats_creds_file:
        opts["user_credentials"] = cfg.nats_creds_file
    if cfg.nats_tls_ca_file:
        opts["tls"] = ssl.create_default_context(cafile=cfg.nats_tls_ca_file)
    return opts


async def node_credential(cfg: AgentConfig, work_dir: Path, opts: dict[str, Any]) -> tuple[str, str]:
    """This node's NATS user and password: from ``<work_dir>/nats-credential.json`` when enrolled
    before (an agent restart), else by redeeming the enrolment token. Retries until orchd answers; a
    refusal (expired, reused...) is logged and retried slowly - the node stays unregistered and orchd
    replaces it after the heartbeat timeout."""
    path = work_dir / CREDENTIAL_FILE
    if path.exists():
        stored = json.loads(path.read_text())
        return stored["user"], stored["password"]
    wait = 0.2
    while True:
        try:
            reply = await _enrol(cfg, opts)
        except Exception as e:  # any failure: NATS or orchd not up yet, keep trying
            log.warning("enrol_retry", error=type(e).__name__, retry_s=wait)
            await anyio.sleep(wait)
            wait = min(2.0, wait * 2)
            continue
        if "error" in reply:
            log.error("enrol_refused", reason=reply["error"], retry_s=30)
            await anyio.sleep(30)
            continue
        _store(path, reply["user"], reply["password"])
        log.info("enrolled", user=reply["user"])
        return reply["user"], reply["password"]


async def _enrol(cfg: AgentConfig, opts: dict[str, Any]) -> dict[str, Any]:
    """One enrolment request: orchd's answer (``user`` and ``password``, or ``error``)."""
    node = cfg.node_id
    nc = await nats.connect(servers=opts["servers"], tls=opts.get("tls"), connect_timeout=2,
                            user=f"enrol-{node}", password=cfg.enrol_token, inbox_prefix=f"_INBOX.{node}.enrol",
                            allow_reconnect=False, max_reconnect_attempts=0, error_cb=opts["error_cb"],
                            name=f"orch-agent-enrol-{node}")
    try:
        msg = await nc.request(f"orch.enrol.{node}", cfg.enrol_token.encode(), timeout=5)
    finally:
        await nc.close()
    reply = json.loads(msg.data)
    if not isinstance(reply, dict):
        raise ValueError("enrolment reply is not a JSON object")
    return reply


def _store(path: Path, user: str, password: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"user": user, "password": password}, f)
