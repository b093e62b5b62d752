"""A wire-level fake of the three clouds' instance metadata services, one per local node.

Role: the cloud edge of the local provider and of the agent's watcher tests. One HTTP server answers
the paths and formats of all three clouds, so a node can be watched as an AWS, GCP or Azure VM:

- AWS IMDSv2: ``PUT /latest/api/token`` (header ``X-aws-ec2-metadata-token-ttl-seconds``) returns a
  session token; ``GET /latest/meta-data/spot/instance-action`` (header ``X-aws-ec2-metadata-token``)
  returns ``{"action": "terminate", "time": "2026-11-21T20:31:05Z"}`` once a notice is injected, 404
  before; ``GET /latest/meta-data/events/recommendations/rebalance`` returns ``{"noticeTime": ...}``
  or 404. Missing/unknown token: 401.
- GCP: ``GET /computeMetadata/v1/instance/preempted`` (header ``Metadata-Flavor: Google``, else 403)
  returns ``FALSE``/``TRUE`` with an ``ETag``; ``?wait_for_change=true`` blocks until the value differs
  from ``last_etag`` (or from the value at call time) or ``timeout_sec`` passes.
- Azure: ``GET /metadata/scheduledevents?api-version=...`` (header ``Metadata: true``, else 400)
  returns ``{"DocumentIncarnation": n, "Events": [...]}`` with an ``EventType: "Preempt"`` event whose
  ``NotBefore`` is the deadline (RFC 1123); ``POST`` the same path with
  ``{"StartRequests": [{"EventId": ...}]}`` acknowledges it (recorded in ``acks``).

Concurrency contract: a ``ThreadingHTTPServer`` on loopback in a daemon thread; ``inject_*``/``clear``
are thread-safe (one Condition, which also wakes GCP long polls).
"""

from __future__ import annotations

import email.utils
import json
import secrets
import threading
import time
import uuid
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

AWS_TOKEN_PATH = "/latest/api/token"
AWS_ACTION_PATH = "/latest/meta-data/spot/instance-action"
AWS_REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
GCP_PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
AZURE_EVENTS_PATH = "/metadata/scheduledevents"


def iso_z(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class MetadataServer:
    """The fake metadata service of one node. ``url`` is valid after ``start``."""

    def __init__(self, instance_name: str = "vm-local", host: str = "127.0.0.1") -> None:
        self.instance_name = instance_name
        self._cond = threading.Condition()
        self._tokens: dict[str, float] = {}  # token -> expiry (monotonic)
        self.deadline_ts: float | None = None  # terminate notice
        self.rebalance_ts: float | None = None
        self.azure_event_id: str | None = None
        self.azure_status = "Scheduled"
        self.incarnation = 1
        self.etag_n = 1
        self.acks: list[str] = []  # Azure EventIds acknowledged by POST
        self.requests: list[tuple[str, str]] = []  # (method, path) for tests
        self._stopped = False
        self._host = host
        self._httpd = ThreadingHTTPServer((host, 0), self._handler_class())
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self._httpd.server_address[1]}"

    def start(self) -> MetadataServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fake-metadata", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopped = True  # ends GCP long polls in flight
            self._cond.notify_all()
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> MetadataServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- injection -------------------------------------------------------------------------------

    def inject_terminate(self, deadline_ts: float) -> None:
        """The cloud announces that this VM is reclaimed at ``deadline_ts`` (all three formats)."""
        with self._cond:
            self.deadline_ts = deadline_ts
            self.azure_event_id = str(uuid.uuid4()).upper()
            self.azure_status = "Scheduled"
            self.incarnation += 1
            self.etag_n += 1
            self._cond.notify_all()

    def inject_rebalance(self, notice_ts: float | None = None) -> None:
        with self._cond:
            self.rebalance_ts = notice_ts if notice_ts is not None else time.time()
            self._cond.notify_all()

    def clear(self) -> None:
        with self._cond:
            self.deadline_ts = None
            self.rebalance_ts = None
            self.azure_event_id = None
            self.incarnation += 1
            self.etag_n += 1
            self._cond.notify_all()

    # --- formats (callers hold the lock) ---------------------------------------------------------

    def _gcp_value(self) -> tuple[str, str]:
        return ("TRUE" if self.deadline_ts is not None else "FALSE"), f"{self.etag_n:016x}"

    def _azure_doc(self) -> dict[str, Any]:
        events = []
        if self.deadline_ts is not None and self.azure_event_id is not None:
            events.append({
                "EventId": self.azure_event_id,
                "EventStatus": self.azure_status,
                "EventType": "Preempt",
                "ResourceType": "VirtualMachine",
                "Resources": [self.instance_name],
                "NotBefore": email.utils.formatdate(self.deadline_ts, usegmt=True),
                "Description": "Virtual machine is being evicted from Azure Spot.",
                "EventSource": "Platform",
                "DurationInSeconds": -1,
            })
        return {"DocumentIncarnation": self.incarnation, "Events": events}

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        return type("Handler", (_Handler,), {"meta": self})


class _Handler(BaseHTTPRequestHandler):
    """One request to a ``MetadataServer`` (``meta``, set on the subclass each server makes)."""

    protocol_version = "HTTP/1.1"
    meta: MetadataServer

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def _send(self, code: int, body: bytes | str, ctype: str = "text/plain",
              extra: dict[str, str] | None = None) -> None:
        data = body.encode() if isinstance(body, str) else body
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        try:
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            # The client went away mid long-poll: its node was killed (a preemption). Normal here.
            self.close_connection = True

    def _aws_ok(self) -> bool:
        token = self.headers.get("X-aws-ec2-metadata-token", "")
        with self.meta._cond:
            exp = self.meta._tokens.get(token)
        if exp is None or exp < time.monotonic():
            self._send(401, "")
            return False
        return True

    def do_PUT(self) -> None:
        path = urlsplit(self.path).path
        self.meta.requests.append(("PUT", path))
        if path != AWS_TOKEN_PATH:
            self._send(404, "")
            return
        ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
        if ttl is None or not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
            self._send(400, "")
            return
        token = secrets.token_urlsafe(32)
        with self.meta._cond:
            self.meta._tokens[token] = time.monotonic() + int(ttl)
        self._send(200, token, extra={"X-aws-ec2-metadata-token-ttl-seconds": ttl})

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        self.meta.requests.append(("GET", parts.path))
        route = {AWS_ACTION_PATH: self._aws_action, AWS_REBALANCE_PATH: self._aws_rebalance,
                 GCP_PREEMPTED_PATH: self._gcp_preempted, AZURE_EVENTS_PATH: self._azure_events}.get(parts.path)
        if route is None:
            self._send(404, "")
        else:
            route(parse_qs(parts.query))

    def _aws_action(self, query: dict[str, list[str]]) -> None:
        if not self._aws_ok():
            return
        with self.meta._cond:
            d = self.meta.deadline_ts
        if d is None:
            self._send(404, "")
        else:
            self._send(200, json.dumps({"action": "terminate", "time": iso_z(d)}), "text/plain")

    def _aws_rebalance(self, query: dict[str, list[str]]) -> None:
        if not self._aws_ok():
            return
        with self.meta._cond:
            r = self.meta.rebalance_ts
        if r is None:
            self._send(404, "")
        else:
            self._send(200, json.dumps({"noticeTime": iso_z(r)}), "text/plain")

    def _gcp_preempted(self, query: dict[str, list[str]]) -> None:
        if self.headers.get("Metadata-Flavor") != "Google":
            self._send(403, "Missing Metadata-Flavor:Google header.")
            return
        wait = query.get("wait_for_change", ["false"])[0].lower() == "true"
        timeout = float(query.get("timeout_sec", ["300"])[0])
        meta = self.meta
        with meta._cond:
            value, etag = meta._gcp_value()
            if wait:
                last = query.get("last_etag", [""])[0] or etag
                end = time.monotonic() + timeout
                while etag == last and time.monotonic() < end and not meta._stopped:
                    meta._cond.wait(min(0.5, max(0.0, end - time.monotonic())))
                    value, etag = meta._gcp_value()
        self._send(200, value, "application/text", {"ETag": etag, "Metadata-Flavor": "Google"})

    def _azure_events(self, query: dict[str, list[str]]) -> None:
        if self.headers.get("Metadata", "").lower() != "true" or "api-version" not in query:
            self._send(400, json.dumps({"error": "Bad request. Required metadata header not specified"}),
                       "application/json")
            return
        with self.meta._cond:
            doc = self.meta._azure_doc()
        self._send(200, json.dumps(doc), "application/json")

    def do_POST(self) -> None:
        parts = urlsplit(self.path)
        self.meta.requests.append(("POST", parts.path))
        if parts.path != AZURE_EVENTS_PATH or self.headers.get("Metadata", "").lower() != "true":
            self._send(400, "")
            return
        n = int(self.headers.get("Content-Length", "0"))
        try:
            body = json.loads(self.rfile.read(n) or b"{}")
            ids = [r["EventId"] for r in body["StartRequests"]]
        except (ValueError, KeyError, TypeError):
            self._send(400, "")
            return
        meta = self.meta
        with meta._cond:
            for eid in ids:
                meta.acks.append(eid)
                if eid == meta.azure_event_id:
                    meta.azure_status = "Started"
                    meta.incarnation += 1
        self._send(200, "")
