"""Preemption watchers: each cloud's parser on canned responses (a notice, none, a malformed body), the
one poll loop on a scripted service (reported once, errors retried, documents independent), and every
cloud end to end against the local wire-level fake (real HTTP, the clouds' formats)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from email.utils import format_datetime

import anyio
import pytest

from agent.config import AgentConfig
from agent.generations import GenerationRunner
from agent.http import HttpError, Response
from agent.notices import NoticeRelay
from agent.outbox import NodePublisher, Outbox
from agent.watchers import (
    AWS_ACTION_PATH,
    AWS_REBALANCE_PATH,
    AZURE_EVENTS_PATH,
    GCP_PREEMPTED_PATH,
    AwsMetadata,
    AzureMetadata,
    GcpMetadata,
    Notice,
    Watcher,
    make_watcher,
)
from providers.local.metadata import MetadataServer
from wire import NodeId, NoticeKind

pytestmark = pytest.mark.anyio

EP = "http://md"
NOW = 1_800_000_000.0


def _resp(status: int, body: str | bytes, path: str, headers: dict[str, str] | None = None) -> Response:
    data = body.encode() if isinstance(body, str) else body
    return Response(status, headers or {}, data, EP + path)


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- parsers --------------------------------------------------------------------------------------------


def test_aws_parser() -> None:
    aws = AwsMetadata(EP)
    action = json.dumps({"action": "terminate", "time": _iso(NOW + 120)})
    (notice,) = aws.parse(_resp(200, action, AWS_ACTION_PATH), NOW)
    assert (notice.cloud, notice.kind, notice.deadline_ts, notice.observed_ts) == ("aws", "terminate", NOW + 120, NOW)
    assert notice.ref == f"aws-terminate-{_iso(NOW + 120)}"
    (rebalance,) = aws.parse(_resp(200, '{"noticeTime": "t0"}', AWS_REBALANCE_PATH), NOW)
    assert rebalance.kind is NoticeKind.REBALANCE and rebalance.deadline_ts is None
    assert aws.parse(_resp(404, "", AWS_ACTION_PATH), NOW) == []  # no notice yet
    assert aws.parse(_resp(404, "", AWS_REBALANCE_PATH), NOW) == []
    for body in ("not json", "[]", '{"action": "terminate"}', '{"action": "stop", "time": "tomorrow"}'):
        with pytest.raises(ValueError):
            aws.parse(_resp(200, body, AWS_ACTION_PATH), NOW)
    with pytest.raises(HttpError):
        aws.parse(_resp(500, "", AWS_ACTION_PATH), NOW)


def test_gcp_parser() -> None:
    gcp = GcpMetadata(EP, notice_s=30)
    assert gcp.parse(_resp(200, "FALSE", GCP_PREEMPTED_PATH, {"etag": "e1"}), NOW) == []
    (notice,) = gcp.parse(_resp(200, "TRUE", GCP_PREEMPTED_PATH, {"etag": "e2"}), NOW)
    assert (notice.cloud, notice.kind, notice.deadline_ts) == ("gcp", "terminate", NOW + 30)
    assert notice.ref == "gcp-preempted-e2"
    assert gcp.parse(_resp(200, "TRUE", GCP_PREEMPTED_PATH, {"etag": "e2"}), NOW) == []  # the same preemption
    assert gcp.parse(_resp(200, "FALSE", GCP_PREEMPTED_PATH, {"etag": "e3"}), NOW) == []
    (again,) = gcp.parse(_resp(200, "TRUE\n", GCP_PREEMPTED_PATH, {"etag": "e4"}), NOW)  # a new VM life
    assert again.ref == "gcp-preempted-e4"
    with pytest.raises(ValueError):
        gcp.parse(_resp(200, "<html>captive portal</html>", GCP_PREEMPTED_PATH), NOW)
    with pytest.raises(HttpError):
        gcp.parse(_resp(403, "", GCP_PREEMPTED_PATH), NOW)


def test_azure_parser() -> None:
    azure = AzureMetadata(EP)
    not_before = format_datetime(datetime.fromtimestamp(NOW + 30, UTC), usegmt=True)
    doc = {"DocumentIncarnation": 2, "Events": [
        {"EventId": "E-reboot", "EventType": "Reboot", "NotBefore": not_before},
        {"EventId": "E-1", "EventType": "Preempt", "NotBefore": not_before}]}
    (notice,) = azure.parse(_resp(200, json.dumps(doc), AZURE_EVENTS_PATH), NOW)
    assert (notice.cloud, notice.kind, notice.deadline_ts, notice.ref) == ("azure", "terminate", NOW + 30, "azure-E-1")
    no_deadline = {"Events": [{"EventId": "E-2", "EventType": "Preempt", "NotBefore": ""}]}
    (soon,) = azure.parse(_resp(200, json.dumps(no_deadline), AZURE_EVENTS_PATH), NOW)
    assert soon.deadline_ts == NOW + 30
    assert azure.parse(_resp(200, '{"DocumentIncarnation": 1, "Events": []}', AZURE_EVENTS_PATH), NOW) == []
    assert azure.parse(_resp(200, json.dumps({"Events": doc["Events"][:1]}), AZURE_EVENTS_PATH), NOW) == []
    for body in ("{", '{"Events": "none"}', '{"Events": [1]}', '{"Events": [{"EventType": "Preempt"}]}',
                 '{"Events": [{"EventId": "x", "EventType": "Preempt", "NotBefore": "soon"}]}'):
        with pytest.raises(ValueError):
            azure.parse(_resp(200, body, AZURE_EVENTS_PATH), NOW)
    with pytest.raises(HttpError):
        azure.parse(_resp(400, "", AZURE_EVENTS_PATH), NOW)


# --- the one loop ---------------------------------------------------------------------------------------


class ScriptedService:
    """A metadata service whose reads follow a script: each entry a list of responses, or an exception."""

    cloud = "test"
    poll_s = 0.01
    retry_s = 0.05

    def __init__(self, script: list[list[Response] | Exception]) -> None:
        self.script = script
        self.reads = 0
        self.failed_calls = 0
        self.acked: list[Notice] = []

    async def read(self) -> list[Response]:
        step = self.script[min(self.reads, len(self.script) - 1)]
        self.reads += 1
        if isinstance(step, Exception):
            raise step
        return step

    def parse(self, resp: Response, observed_ts: float) -> list[Notice]:
        if resp.status != 200:
            raise HttpError(f"HTTP {resp.status}")
        ref = resp.text()
        if ref == "garbage":
            raise ValueError("malformed")
        return [Notice("test", NoticeKind.TERMINATE, observed_ts + 30, observed_ts, ref)] if ref else []

    def failed(self) -> None:
        self.failed_calls += 1

    async def acknowledge(self, notice: Notice) -> None:
        self.acked.append(notice)


async def _collect(watcher: Watcher, until: int, timeout_s: float = 3.0) -> list[Notice]:
    """Run the loop until ``until`` polls were made; the notices it reported."""
    got: list[Notice] = []

    async def on_notice(n: Notice) -> None:
        got.append(n)

    service = watcher.service
    assert isinstance(service, ScriptedService)
    async with anyio.create_task_group() as tg:
        tg.start_soon(watcher.run, on_notice)
        with anyio.fail_after(timeout_s):
            while service.reads < until:
                await anyio.sleep(0.005)
        tg.cancel_scope.cancel()
    return got


async def test_loop_reports_a_notice_once() -> None:
    ok = Response(200, {}, b"n-1")
    service = ScriptedService([[Response(200, {}, b"")], [ok], [ok], [ok, Response(200, {}, b"n-2")]])
    w = Watcher(service)
    got = await _collect(w, until=6)
    assert [n.ref for n in got] == ["n-1", "n-2"]
    assert w.failures == 0 and await w.check() == []


async def test_loop_retries_after_an_http_error() -> None:
    service = ScriptedService([HttpError("connection refused"), [Response(503, {}, b"")], [Response(200, {}, b"n-1")]])
    w = Watcher(service)
    t0 = time.monotonic()
    got = await _collect(w, until=4)
    assert [n.ref for n in got] == ["n-1"]
    assert w.failures == 2 and service.failed_calls == 2  # the unreachable service and the 503
    assert time.monotonic() - t0 >= 2 * service.retry_s  # a failed poll waits retry_s, not poll_s


async def test_loop_keeps_the_good_documents_of_a_poll() -> None:
    service = ScriptedService([[Response(200, {}, b"garbage"), Response(200, {}, b"n-1")]])
    w = Watcher(service)
    assert [n.ref for n in await w.check()] == ["n-1"]
    assert w.failures == 1
    await w.acknowledge(Notice("test", NoticeKind.TERMINATE, None, NOW, "n-1"))
    assert [n.ref for n in service.acked] == ["n-1"]  # the loop hands acknowledgements to its service


async def test_loop_survives_a_dead_endpoint() -> None:
    w = make_watcher("aws", "http://127.0.0.1:9", poll_s=0.05)
    assert w is not None

    async def on_notice(n: Notice) -> None:
        raise AssertionError(n)

    with anyio.move_on_after(0.5):
        await w.run(on_notice)  # logs failures and keeps polling
    assert w.failures >= 2
    assert make_watcher("none") is None
    with pytest.raises(ValueError):
        make_watcher("oracle")


# --- against the fake metadata service --------------------------------------------------------------------


@pytest.fixture
def md():
    with MetadataServer(instance_name="vm-test") as server:
        yield server


async def _first_notice(watcher: Watcher, inject, timeout_s: float = 3.0) -> tuple[Notice, float]:
    got: list[tuple[Notice, float]] = []
    done = anyio.Event()

    async def on_notice(n: Notice) -> None:
        got.append((n, time.monotonic()))
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watcher.run, on_notice)
        await anyio.sleep(0.3)  # the watcher is polling (GCP: long poll in flight)
        t0 = time.monotonic()
        inject()
        with anyio.fail_after(timeout_s):
            await done.wait()
        tg.cancel_scope.cancel()
    return got[0][0], got[0][1] - t0


def test_fake_aws_imdsv2_requires_a_token(md: MetadataServer) -> None:
    req = urllib.request.Request(md.url + AWS_ACTION_PATH)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=2)
    assert e.value.code == 401


async def test_aws_instance_action_becomes_one_notice(md: MetadataServer) -> None:
    w = Watcher(AwsMetadata(md.url, poll_s=0.2))
    deadline = int(time.time()) + 120
    notice, latency = await _first_notice(w, lambda: md.inject_terminate(deadline))
    assert notice.kind is NoticeKind.TERMINATE and notice.cloud == "aws"
    assert notice.deadline_ts == deadline
    assert latency < 1.0
    assert ("PUT", "/latest/api/token") in md.requests
    assert await w.check() == []  # reported once


async def test_aws_rebalance_recommendation(md: MetadataServer) -> None:
    w = Watcher(AwsMetadata(md.url, poll_s=0.2))
    notice, _ = await _first_notice(w, md.inject_rebalance)
    assert notice.kind is NoticeKind.REBALANCE and notice.deadline_ts is None


async def test_gcp_preempted_long_poll(md: MetadataServer) -> None:
    w = Watcher(GcpMetadata(md.url, notice_s=30))
    notice, latency = await _first_notice(w, lambda: md.inject_terminate(time.time() + 30))
    assert notice.kind is NoticeKind.TERMINATE and notice.cloud == "gcp"
    assert notice.deadline_ts is not None and 25 < notice.deadline_ts - time.time() <= 30
    assert latency < 0.5  # wait_for_change returns at once, no polling interval
    with pytest.raises(urllib.error.HTTPError) as e:  # the fake really checks the header
        urllib.request.urlopen(md.url + GCP_PREEMPTED_PATH, timeout=2)
    assert e.value.code == 403


async def test_azure_preempt_event_is_acknowledged_through_the_relay(md: MetadataServer, tmp_path) -> None:
    """The loop reports the event, the relay publishes it and - no ranks running - acknowledges it
    through the watcher's hook at once: Azure then starts the eviction."""
    watcher = make_watcher("azure", md.url, poll_s=0.2)
    assert watcher is not None
    publisher = NodePublisher(NodeId("n-az"))
    publisher.outbox = Outbox(js=None)  # put() never touches the server
    generations = GenerationRunner(AgentConfig(node_id="n-az"), tmp_path, publisher)
    relay = NoticeRelay(publisher, generations, watcher, cloud_name="azure")
    deadline = int(time.time()) + 30
    async with anyio.create_task_group() as tg:
        tg.start_soon(watcher.run, relay.on_notice)
        await anyio.sleep(0.3)
        md.inject_terminate(deadline)
        with anyio.fail_after(3):
            while not md.acks:
                await anyio.sleep(0.02)
        tg.cancel_scope.cancel()
    assert md.acks == [md.azure_event_id]
    (notice,) = relay.notices
    assert notice.kind is NoticeKind.TERMINATE and notice.cloud == "azure" and notice.deadline_ts == deadline
    assert [p.msg_id for p in publisher.outbox._q] == [f"notice-n-az-azure-{md.azure_event_id}"]
    req = urllib.request.Request(md.url + AZURE_EVENTS_PATH + "?api-version=2020-07-01", headers={"Metadata": "true"})
    doc = json.loads(urllib.request.urlopen(req, timeout=2).read())
    assert doc["Events"][0]["EventStatus"] == "Started"
    assert doc["Events"][0]["EventType"] == "Preempt"


async def test_relay_holds_the_acknowledgement_until_the_checkpoint(tmp_path) -> None:
    """With ranks running, the emergency checkpoint is placed and the acknowledgement waits for
    ``release`` (the commit or the ranks' exit)."""
    service = ScriptedService([[]])
    publisher = NodePublisher(NodeId("n-1"))
    publisher.outbox = Outbox(js=None)  # put() never touches the server
    generations = GenerationRunner(AgentConfig(node_id="n-1"), tmp_path, publisher)
    requests: list[str] = []

    class Running:  # the part of RankGroup the relay uses
        running = True
        checkpoint_requested = False

        def request_checkpoint(self, request) -> None:
            requests.append(request.reason)
            self.checkpoint_requested = True

    generations.group = Running()  # a stand-in for a running RankGroup
    relay = NoticeRelay(publisher, generations, Watcher(service), cloud_name="test")
    async with anyio.create_task_group() as tg:
        relay.attach(tg)
        await relay.on_notice(Notice("test", NoticeKind.TERMINATE, NOW + 30, NOW, "n-1"))
        await relay.on_notice(Notice("test", NoticeKind.REBALANCE, None, NOW, "r-1"))  # nothing to do
        assert requests == ["preemption_notice"] and generations.state == "checkpointing"
        assert service.acked == []
        relay.release()
        await anyio.sleep(0.05)
    assert [n.ref for n in service.acked] == ["n-1"]
    assert len(publisher.outbox) == 2
