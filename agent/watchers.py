"""Preemption-notice watchers for the three clouds' instance metadata services.

Role: turn what a cloud's metadata service says into ``Notice`` values, each reported once. The
endpoint is configurable (the real link-local address by default, a local fake in tests and in the
local provider):

- ``AwsWatcher``: IMDSv2. A session token from ``PUT /latest/api/token`` (renewed before its TTL, and
  on a 401), then polls ``spot/instance-action`` (``{"action": "terminate"|"stop", "time": ...Z}``,
  404 while none) and ``events/recommendations/rebalance`` (``{"noticeTime": ...}``).
- ``GcpWatcher``: ``instance/preempted`` with ``Metadata-Flavor: Google`` as a long poll
  (``wait_for_change=true&last_etag=...``); GCP gives no deadline, the documented ~30 s is assumed.
- ``AzureWatcher``: Scheduled Events (``Metadata: true``); an ``EventType: "Preempt"`` event is a notice
  with ``NotBefore`` as the deadline. ``acknowledge`` POSTs ``StartRequests`` for it: the agent calls
  it after the emergency checkpoint committed (it lets Azure proceed at once).

Concurrency contract: ``run(on_notice)`` is one long-running coroutine per watcher, cancelled by its
parent task group; it never raises for HTTP errors (logs them and retries with a short wait), and
re-raises cancellation. ``on_notice`` is awaited inline, so keep it quick (the agent enqueues).
"""

from __future__ import annotations

import email.utils
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime

import anyio
import structlog

from agent.http import HttpError, request
from wire import NoticeKind

log = structlog.get_logger("agent.watchers")

DEFAULT_ENDPOINT = "http://169.254.169.254"
GCP_NOTICE_S = 30.0  # GCP's documented preemption notice (the metadata value has no deadline)


@dataclass(frozen=True, slots=True)
class Notice:
    cloud: str  # the metadata flavour that reported it: aws | gcp | azure
    kind: NoticeKind
    deadline_ts: float | None
    observed_ts: float
    ref: str  # stable identity of this notice at the cloud (dedup key, part of the message id)


OnNotice = Callable[[Notice], Awaitable[None]]


def parse_iso_z(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class AwsWatcher:
    cloud = "aws"

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, *, poll_s: float = 0.5, token_ttl_s: int = 21600) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.poll_s = poll_s
        self.token_ttl_s = token_ttl_s
        self._token: str | None = None
        self._token_expiry = 0.0
        self._seen: set[str] = set()

    async def _get_token(self) -> str:
        if self._token is None or time.monotonic() > self._token_expiry:
            resp = await request("PUT", f"{self.endpoint}/latest/api/token",
                                 headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl_s)})
            if resp.status != 200:
                raise HttpError(f"IMDSv2 token: HTTP {resp.status}")
            self._token = resp.text().strip()
            self._token_expiry = time.monotonic() + self.token_ttl_s * 0.9
        return self._token

    async def _get(self, path: str) -> tuple[int, str]:
        for _ in range(2):
            token = await self._get_token()
            resp = await request("GET", f"{self.endpoint}{path}", headers={"X-aws-ec2-metadata-token": token})
            if resp.status == 401:  # token expired or the IMDS restarted: fetch a new one once
                self._token = None
                continue
            return resp.status, resp.text()
        return 401, ""

    async def check(self) -> list[Notice]:
        """One poll of both documents; returns the notices not reported before."""
        out: list[Notice] = []
        now = time.time()
        status, text = await self._get("/latest/meta-data/spot/instance-action")
        if status == 200:
            doc = json.loads(text)
            ref = f"aws-{doc.get('action')}-{doc.get('time')}"
            if ref not in self._seen:
                self._seen.add(ref)
                out.append(Notice("aws", NoticeKind.TERMINATE, parse_iso_z(doc["time"]), now, ref))
        elif status != 404:
            raise HttpError(f"spot/instance-action: HTTP {status}")
        status, text = await self._get("/latest/meta-data/events/recommendations/rebalance")
        if status == 200:
            doc = json.loads(text)
            ref = f"aws-rebalance-{doc.get('noticeTime')}"
            if ref not in self._seen:
                self._seen.add(ref)
                out.append(Notice("aws", NoticeKind.REBALANCE, None, now, ref))
        elif status != 404:
            raise HttpError(f"events/recommendations/rebalance: HTTP {status}")
        return out

    async def run(self, on_notice: OnNotice) -> None:
        while True:
            try:
                for notice in await self.check():
                    await on_notice(notice)
            except (HttpError, ValueError, KeyError) as e:
                log.warning("metadata_poll_failed", cloud=self.cloud, error=str(e))
            await anyio.sleep(self.poll_s)

    async def acknowledge(self, notice: Notice) -> None:
        """AWS has nothing to acknowledge."""


class GcpWatcher:
    cloud = "gcp"

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, *, notice_s: float = GCP_NOTICE_S,
                 long_poll_s: float = 60.0) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.notice_s = notice_s
        self.long_poll_s = long_poll_s
        self._etag: str | None = None
        self._reported = False

    async def check(self, wait: bool) -> list[Notice]:
        url = f"{self.endpoint}/computeMetadata/v1/instance/preempted"
        if wait:
            url += f"?wait_for_change=true&timeout_sec={int(self.long_poll_s)}"
            if self._etag:
                url += f"&last_etag={self._etag}"
        resp = await request("GET", url, headers={"Metadata-Flavor": "Google"},
                             timeout_s=(self.long_poll_s + 5) if wait else 5.0)
        if resp.status != 200:
            raise HttpError(f"instance/preempted: HTTP {resp.status}")
        self._etag = resp.headers.get("etag", self._etag)
        if resp.text().strip().upper() == "TRUE" and not self._reported:
            self._reported = True
            now = time.time()
            return [Notice("gcp", NoticeKind.TERMINATE, now + self.notice_s, now, f"gcp-preempted-{self._etag}")]
        if resp.text().strip().upper() == "FALSE":
            self._reported = False
        return []

    async def run(self, on_notice: OnNotice) -> None:
        wait = False  # the first read returns at once (current value + etag), then long polls
        while True:
            try:
                for notice in await self.check(wait):
                    await on_notice(notice)
                wait = True
            except (HttpError, ValueError) as e:
                log.warning("metadata_poll_failed", cloud=self.cloud, error=str(e))
                wait = False
                await anyio.sleep(1.0)

    async def acknowledge(self, notice: Notice) -> None:
        """GCP has nothing to acknowledge."""


class AzureWatcher:
    cloud = "azure"
    API_VERSION = "2020-07-01"

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, *, poll_s: float = 0.5) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.poll_s = poll_s
        self._seen: set[str] = set()
        self._url = f"{self.endpoint}/metadata/scheduledevents?api-version={self.API_VERSION}"

    async def check(self) -> list[Notice]:
        resp = await request("GET", self._url, headers={"Metadata": "true"})
        if resp.status != 200:
            raise HttpError(f"scheduledevents: HTTP {resp.status}")
        doc = json.loads(resp.body)
        out = []
        now = time.time()
        for ev in doc.get("Events", []):
            if ev.get("EventType") != "Preempt" or ev.get("EventId") in self._seen:
                continue
            self._seen.add(ev["EventId"])
            not_before = ev.get("NotBefore") or ""
            deadline = email.utils.parsedate_to_datetime(not_before).timestamp() if not_before else now + 30.0
            out.append(Notice("azure", NoticeKind.TERMINATE, deadline, now, f"azure-{ev['EventId']}"))
        return out

    async def run(self, on_notice: OnNotice) -> None:
        while True:
            try:
                for notice in await self.check():
                    await on_notice(notice)
            except (HttpError, ValueError, KeyError, TypeError) as e:
                log.warning("metadata_poll_failed", cloud=self.cloud, error=str(e))
            await anyio.sleep(self.poll_s)

    async def acknowledge(self, notice: Notice) -> None:
        """Approve the Preempt event (POST StartRequests): the VM may go at once after this."""
        event_id = notice.ref.removeprefix("azure-")
        body = json.dumps({"StartRequests": [{"EventId": event_id}]}).encode()
        resp = await request("POST", self._url, headers={"Metadata": "true", "Content-Type": "application/json"},
                             body=body)
        if resp.status != 200:
            raise HttpError(f"scheduledevents ack: HTTP {resp.status}")
        log.info("azure_event_acknowledged", event_id=event_id)


Watcher = AwsWatcher | GcpWatcher | AzureWatcher


def make_watcher(cloud: str, endpoint: str = DEFAULT_ENDPOINT, **kw: float) -> Watcher | None:
    """The watcher for a metadata flavour; None for 'none' (no metadata service, e.g. bare metal)."""
    match cloud:
        case "aws":
            return AwsWatcher(endpoint, **kw)
        case "gcp":
            return GcpWatcher(endpoint, **kw)
        case "azure":
            return AzureWatcher(endpoint, **kw)
        case "none" | "":
            return None
        case _:
            raise ValueError(f"unknown metadata flavour {cloud!r} (aws, gcp, azure, none)")
