"""Preemption-notice watchers for the three clouds' instance metadata services.

Role: turn what a cloud's metadata service says into ``Notice`` values, each reported once. One poll
loop (``Watcher``) serves every cloud; what differs per cloud is a ``MetadataService``: how it is read
(HTTP) and how one response is parsed (a notice, or nothing). The endpoint is configurable (the real
link-local address by default, a local fake in tests and in the local provider):

- ``AwsMetadata``: IMDSv2. A session token from ``PUT /latest/api/token`` (renewed before its TTL, and
  on a 401), then reads ``spot/instance-action`` (``{"action": "terminate"|"stop", "time": ...Z}``,
  404 while none) and ``events/recommendations/rebalance`` (``{"noticeTime": ...}``).
- ``GcpMetadata``: ``instance/preempted`` with ``Metadata-Flavor: Google`` as a long poll
  (``wait_for_change=true&last_etag=...``); GCP gives no deadline, the documented ~30 s is assumed.
- ``AzureMetadata``: Scheduled Events (``Metadata: true``); an ``EventType: "Preempt"`` event is a notice
  with ``NotBefore`` as the deadline. Its ``acknowledge`` hook POSTs ``StartRequests`` for the event: the
  agent calls it after the emergency checkpoint committed (it lets Azure proceed at once). The other
  clouds have nothing to acknowledge: their hook does nothing.

A parser raises ``HttpError`` for an unexpected status and ``ValueError`` for a body it cannot read;
the loop logs either and polls again (after ``retry_s``), and keeps the other documents of the poll.

Concurrency contract: ``Watcher.run(on_notice)`` is one long-running coroutine per watcher, cancelled
by its parent task group; it never raises for HTTP or parse errors, and re-raises cancellation.
``on_notice`` is awaited inline, so keep it quick (the agent enqueues).
"""

from __future__ import annotations

import email.utils
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol
from urllib.parse import urlsplit

import anyio
import structlog

from agent.http import HttpError, Response, request
from wire import NoticeKind

log = structlog.get_logger("agent.watchers")

DEFAULT_ENDPOINT = "http://169.254.169.254"
GCP_NOTICE_S = 30.0  # GCP's documented preemption notice (the metadata value has no deadline)
AZURE_NOTICE_S = 30.0  # a Preempt event without NotBefore: Azure's documented minimum notice

AWS_ACTION_PATH = "/latest/meta-data/spot/instance-action"
AWS_REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
GCP_PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
AZURE_EVENTS_PATH = "/metadata/scheduledevents"


@dataclass(frozen=True, slots=True)
class Notice:
    cloud: str  # the metadata flavour that reported it: aws | gcp | azure
    kind: NoticeKind
    deadline_ts: float | None
    observed_ts: float
    ref: str  # stable identity of this notice at the cloud (dedup key, part of the message id)


OnNotice = Callable[[Notice], Awaitable[None]]


class MetadataService(Protocol):
    """One cloud's metadata service, as the poll loop uses it."""

    cloud: str
    poll_s: float  # pause after a successful poll (0 for a long poll: the read itself waits)
    retry_s: float  # pause after a failed one

    async def read(self) -> list[Response]:
        """One poll: the responses of every document to look at (raises HttpError when unreachable)."""
        ...

    def parse(self, resp: Response, observed_ts: float) -> list[Notice]:
        """The notices one response announces (empty: none); HttpError/ValueError when it is bad."""
        ...

    def failed(self) -> None:
        """A poll failed (the next read starts afresh)."""
        ...

    async def acknowledge(self, notice: Notice) -> None:
        """Tell the cloud the node is ready to go (after the emergency checkpoint)."""
        ...


def parse_iso_z(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _path(resp: Response) -> str:
    return urlsplit(resp.url).path


def _json_object(resp: Response) -> dict[str, Any]:
    doc = json.loads(resp.body)  # JSONDecodeError is a ValueError
    if not isinstance(doc, dict):
        raise ValueError(f"{_path(resp)}: expected a JSON object, got {type(doc).__name__}")
    return doc


def _text(doc: dict[str, Any], key: str, where: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: {key!r} missing or not a string")
    return value


class AwsMetadata:
    cloud = "aws"

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, *, poll_s: float = 0.5, token_ttl_s: int = 21600) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.poll_s = self.retry_s = poll_s
        self.token_ttl_s = token_ttl_s
        self._token: str | None = None
        self._token_expiry = 0.0

    async def _get_token(self) -> str:
        if self._token is None or time.monotonic() > self._token_expiry:
            resp = await request("PUT", f"{self.endpoint}/latest/api/token",
                                 headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl_s)})
            if resp.status != 200:
                raise HttpError(f"IMDSv2 token: HTTP {resp.status}")
            self._token = resp.text().strip()
            self._token_expiry = time.monotonic() + self.token_ttl_s * 0.9
        return self._token

    async def _get(self, path: str) -> Response:
        url = f"{self.endpoint}{path}"
        resp = await request("GET", url, headers={"X-aws-ec2-metadata-token": await self._get_token()})
        if resp.status == 401:  # token expired or the IMDS restarted: one more try with a new token
            self._token = None
            resp = await request("GET", url, headers={"X-aws-ec2-metadata-token": await self._get_token()})
        return resp

    async def read(self) -> list[Response]:
        return [await self._get(AWS_ACTION_PATH), await self._get(AWS_REBALANCE_PATH)]

    def parse(self, resp: Response, observed_ts: float) -> list[Notice]:
        path = _path(resp)
        if resp.status == 404:  # no notice (yet)
            return []
        if resp.status != 200:
            raise HttpError(f"{path}: HTTP {resp.status}")
        doc = _json_object(resp)
        if path == AWS_REBALANCE_PATH:
            return [Notice("aws", NoticeKind.REBALANCE, None, observed_ts, f"aws-rebalance-{doc.get('noticeTime')}")]
        when = _text(doc, "time", path)
        return [Notice("aws", NoticeKind.TERMINATE, parse_iso_z(when), observed_ts, f"aws-{doc.get('action')}-{when}")]

    def failed(self) -> None:
        """Nothing to reset: the token is renewed on a 401."""

    async def acknowledge(self, notice: Notice) -> None:
        """AWS has nothing to acknowledge."""


class GcpMetadata:
    cloud = "gcp"
    poll_s = 0.0  # a long poll: the next read waits for a change itself
    retry_s = 1.0

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, *, notice_s: float = GCP_NOTICE_S,
                 long_poll_s: float = 60.0) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.notice_s = notice_s
        self.long_poll_s = long_poll_s
        self._etag: str | None = None
        self._wait = False  # the first read returns at once (current value + etag), then long polls
        self._reported = False

    async def read(self) -> list[Response]:
        url = f"{self.endpoint}{GCP_PREEMPTED_PATH}"
        wait, self._wait = self._wait, True
        if wait:
            url += f"?wait_for_change=true&timeout_sec={int(self.long_poll_s)}"
            if self._etag:
                url += f"&last_etag={self._etag}"
        return [await request("GET", url, headers={"Metadata-Flavor": "Google"},
                              timeout_s=(self.long_poll_s + 5) if wait else 5.0)]

    def parse(self, resp: Response, observed_ts: float) -> list[Notice]:
        if resp.status != 200:
            raise HttpError(f"instance/preempted: HTTP {resp.status}")
        value = resp.text().strip().upper()
        if value not in ("TRUE", "FALSE"):
            raise ValueError(f"instance/preempted: expected TRUE or FALSE, got {value[:40]!r}")
        self._etag = resp.headers.get("etag", self._etag)
        if value == "FALSE":
            self._reported = False
            return []
        if self._reported:
            return []
        self._reported = True
        return [Notice("gcp", NoticeKind.TERMINATE, observed_ts + self.notice_s, observed_ts,
                       f"gcp-preempted-{self._etag}")]

    def failed(self) -> None:
        self._wait = False

    async def acknowledge(self, notice: Notice) -> None:
        """GCP has nothing to acknowledge."""


class AzureMetadata:
    cloud = "azure"
    API_VERSION = "2020-07-01"

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, *, poll_s: float = 0.5) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.poll_s = self.retry_s = poll_s
        self._url = f"{self.endpoint}{AZURE_EVENTS_PATH}?api-version={self.API_VERSION}"

    async def read(self) -> list[Response]:
        return [await request("GET", self._url, headers={"Metadata": "true"})]

    def parse(self, resp: Response, observed_ts: float) -> list[Notice]:
        if resp.status != 200:
            raise HttpError(f"scheduledevents: HTTP {resp.status}")
        events = _json_object(resp).get("Events", [])
        if not isinstance(events, list) or not all(isinstance(ev, dict) for ev in events):
            raise ValueError("scheduledevents: 'Events' is not a list of objects")
        out = []
        for ev in events:
            if ev.get("EventType") != "Preempt":
                continue
            event_id = _text(ev, "EventId", "scheduledevents")
            not_before = ev.get("NotBefore") or ""
            if not isinstance(not_before, str):
                raise ValueError(f"scheduledevents: NotBefore of {event_id} is not a string")
            deadline = (email.utils.parsedate_to_datetime(not_before).timestamp() if not_before
                        else observed_ts + AZURE_NOTICE_S)
            out.append(Notice("azure", NoticeKind.TERMINATE, deadline, observed_ts, f"azure-{event_id}"))
        return out

    def failed(self) -> None:
        """Nothing to reset."""

    async def acknowledge(self, notice: Notice) -> None:
        """Approve the Preempt event (POST StartRequests): the VM may go at once after this."""
        event_id = notice.ref.removeprefix("azure-")
        body = json.dumps({"StartRequests": [{"EventId": event_id}]}).encode()
        resp = await request("POST", self._url, headers={"Metadata": "true", "Content-Type": "application/json"},
                             body=body)
        if resp.status != 200:
            raise HttpError(f"scheduledevents ack: HTTP {resp.status}")
        log.info("azure_event_acknowledged", event_id=event_id)


class Watcher:
    """The poll loop, for any cloud: read, parse each response, report each notice once."""

    def __init__(self, service: MetadataService) -> None:
        self.service = service
        self.failures = 0
        self._streak = 0  # consecutive failed polls: logged at 1, 2, 4, 8 ... (not once per poll)
        self._seen: set[str] = set()

    @property
    def cloud(self) -> str:
        return self.service.cloud

    async def check(self) -> list[Notice]:
        """One poll; returns the notices not reported before. A failure is logged and counted; the
        documents of the poll that could be parsed still count."""
        try:
            responses = await self.service.read()
        except (HttpError, ValueError) as e:  # unreachable, or an endpoint URL that cannot be used
            self._failed(e)
            return []
        observed = time.time()
        before = self.failures
        fresh: list[Notice] = []
        for resp in responses:
            try:
                notices = self.service.parse(resp, observed)
            except (HttpError, ValueError) as e:
                self._failed(e)
                continue
            for notice in notices:
                if notice.ref not in self._seen:
                    self._seen.add(notice.ref)
                    fresh.append(notice)
        if self._streak and self.failures == before:
            log.info("metadata_poll_recovered", cloud=self.cloud, failed_polls=self._streak)
            self._streak = 0
        return fresh

    def _failed(self, e: Exception) -> None:
        self.failures += 1
        self._streak += 1
        self.service.failed()
        if self._streak & (self._streak - 1) == 0:
            log.warning("metadata_poll_failed", cloud=self.cloud, error=str(e), failed_polls=self._streak)

    async def run(self, on_notice: OnNotice) -> None:
        while True:
            failures = self.failures
            for notice in await self.check():
                await on_notice(notice)
            await anyio.sleep(self.service.poll_s if self.failures == failures else self.service.retry_s)

    async def acknowledge(self, notice: Notice) -> None:
        """The cloud's acknowledgement hook (Azure: approve the event; elsewhere nothing)."""
        await self.service.acknowledge(notice)


def make_watcher(cloud: str, endpoint: str = DEFAULT_ENDPOINT, *, poll_s: float = 0.5,
                 notice_s: float = GCP_NOTICE_S) -> Watcher | None:
    """The watcher for a metadata flavour; None for 'none' (no metadata service, e.g. bare metal).
    ``poll_s``: AWS/Azure poll period (GCP long-polls); ``notice_s``: GCP's assumed notice length."""
    service: MetadataService
    match cloud:
        case "aws":
            service = AwsMetadata(endpoint, poll_s=poll_s)
        case "gcp":
            service = GcpMetadata(endpoint, notice_s=notice_s)
        case "azure":
            service = AzureMetadata(endpoint, poll_s=poll_s)
        case "none" | "":
            return None
        case _:
            raise ValueError(f"unknown metadata flavour {cloud!r} (aws, gcp, azure, none)")
    return Watcher(service)
