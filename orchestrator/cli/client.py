"""Typed client of orchd's admin service (used by ``orchctl``, the demo and tests).

Role: one method per admin endpoint, typed request in, typed reply out. Errors are typed too:

    AdminUnreachable   no NATS server, or no orchd answering (no responders / no reply in time)
    AdminError         orchd answered with an error (code 400/404/409/500, message)

Inbox: replies come on ``_INBOX.orchctl.>`` (``ORCHCTL_INBOX``), the only inbox the operator role
(``orchctl_permissions``) may subscribe to; nats-py's default ``_INBOX.>`` would be a subscription
violation there, and every reply lost.

Fail fast: the connection does not reconnect (``allow_reconnect=False``, one attempt), so a dead server
is reported within ``timeout_s`` instead of nats-py's default two minutes of retries; a live server
without orchd gives ``NoRespondersError`` at once.

Concurrency contract: asyncio coroutines; one client per task (or share it: nats-py multiplexes requests).
"""

from __future__ import annotations

import contextlib
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors

import wire as ev
from orchestrator.security.nats_auth import ORCHCTL_INBOX
from orchestrator.settings import NatsSettings
from wire import logs
from wire.admin import DeadListReply, DeadListRequest, DeadReplayRequest

T = TypeVar("T")


class AdminUnreachable(Exception):
    pass


class AdminError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class AdminClient:
    def __init__(self, nc: Any, timeout_s: float) -> None:
        self.nc = nc
        self.timeout_s = timeout_s

    @classmethod
    async def connect(cls, urls: list[str] | tuple[str, ...], *, timeout_s: float = 5.0,
                      nats_settings: NatsSettings | None = None) -> AdminClient:
        from orchestrator.bus import auth_options

        async def quiet(_e: Exception) -> None:
            pass

        opts = auth_options(nats_settings) if nats_settings else {}
        logs.quiet_asyncio_ssl_eof()  # orchctl over TLS: no asyncio noise on stderr (wire/logs.py)
        try:
            nc = await nats.connect(
                servers=list(urls), allow_reconnect=False, max_reconnect_attempts=1, reconnect_time_wait=0.1,
                connect_timeout=min(timeout_s, 2.0), error_cb=quiet, name="orchctl", inbox_prefix=ORCHCTL_INBOX,
                **opts,
            )
        except Exception as e:  # NoServersError, OSError, TimeoutError, auth failures
            raise AdminUnreachable(f"cannot connect to NATS at {', '.join(urls)}: {type(e).__name__}: {e}") from None
        return cls(nc, timeout_s)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.nc.close()

    async def __aenter__(self) -> AdminClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def call(self, resource: str, verb: str, request: msgspec.Struct | None = None) -> Any:
        req_type, reply_type = ev.ADMIN_ENDPOINTS[(resource, verb)]
        payload = ev.encode(request if request is not None else req_type())
        subject = ev.admin_subject(resource, verb)
        try:
            msg = await self.nc.request(subject, payload, timeout=self.timeout_s)
        except nats.errors.NoRespondersError:
            raise AdminUnreachable(f"orchd is not running: no responders on {subject}") from None
        except nats.errors.TimeoutError:
            raise AdminUnreachable(f"orchd did not answer {subject} within {self.timeout_s}s") from None
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError) as e:
            raise AdminUnreachable(f"connection to NATS lost: {type(e).__name__}") from None
        headers = msg.headers or {}
        code = headers.get("Nats-Service-Error-Code")
        if code:
            message = headers.get("Nats-Service-Error", "")
            with contextlib.suppress(ev.WireError):
                message = ev.decode(msg.data, ev.AdminErrorBody).message
            raise AdminError(int(code) if code.isdigit() else 500, message)
        try:
            return ev.decode(msg.data, reply_type)
        except ev.WireError as e:
            raise AdminError(500, f"undecodable reply from orchd: {e}") from None

    # --- typed endpoints --------------------------------------------------------------------------

    async def status(self) -> ev.StatusReply:
        return await self.call("status", "get")

    async def submit(self, spec: ev.JobSpec, job_id: str | None = None) -> ev.SubmitJobReply:
        return await self.call("jobs", "submit", ev.SubmitJobRequest(spec=spec, job_id=job_id))

    async def jobs(self, include_finished: bool = True) -> ev.JobsReply:
        return await self.call("jobs", "list", ev.ListJobsRequest(include_finished=include_finished))

    async def job(self, job_id: str) -> ev.JobReply:
        return await self.call("jobs", "show", ev.JobRequest(job_id=job_id))

    async def cancel(self, job_id: str, reason: str = "admin") -> ev.OkReply:
        return await self.call("jobs", "cancel", ev.JobRequest(job_id=job_id, reason=reason))

    async def explain(self, job_id: str, limit: int = 200) -> ev.ExplainReply:
        return await self.call("jobs", "explain", ev.JobRequest(job_id=job_id, limit=limit))

    async def nodes(self, job_id: str | None = None) -> ev.NodesReply:
        return await self.call("nodes", "list", ev.ListNodesRequest(job_id=job_id))

    async def drain(self, node_id: str, reason: str = "admin") -> ev.OkReply:
        return await self.call("nodes", "drain", ev.DrainNodeRequest(node_id=node_id, reason=reason))

    async def prices(self) -> ev.PricesReply:
        return await self.call("prices", "list")

    async def events(self, after_seq: int = 0, limit: int = 100) -> ev.EventsReply:
        return await self.call("events", "tail", ev.TailEventsRequest(after_seq=after_seq, limit=limit))

    async def reap(self, dry_run: bool = True) -> ev.ReapReply:
        return await self.call("reap", "run", ev.ReapRequest(dry_run=dry_run))

    async def dead(self, limit: int = 100) -> DeadListReply:
        return await self.call("dead", "list", DeadListRequest(limit=limit))

    async def replay(self, seq: int) -> ev.OkReply:
        return await self.call("dead", "replay", DeadReplayRequest(seq=seq))
