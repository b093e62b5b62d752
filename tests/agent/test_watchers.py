"""The three metadata watchers against the local wire-level fake (real HTTP, the clouds' formats)."""

from __future__ import annotations

import json
import time
import urllib.request

import anyio
import pytest

from agent.watchers import AwsWatcher, AzureWatcher, GcpWatcher, Notice, make_watcher
from wire import NoticeKind
from providers.local.metadata import MetadataServer


@pytest.fixture
def md():
    with MetadataServer(instance_name="vm-test") as server:
        yield server


def _first_notice(watcher, inject, timeout_s: float = 3.0) -> tuple[Notice, float]:
    async def go() -> tuple[Notice, float]:
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

    return anyio.run(go)


def test_fake_aws_imdsv2_requires_a_token(md: MetadataServer) -> None:
    req = urllib.request.Request(md.url + "/latest/meta-data/spot/instance-action")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=2)
    assert e.value.code == 401


def test_aws_instance_action_becomes_one_notice(md: MetadataServer) -> None:
    w = AwsWatcher(md.url, poll_s=0.2)
    deadline = int(time.time()) + 120
    notice, latency = _first_notice(w, lambda: md.inject_terminate(deadline))
    assert notice.kind is NoticeKind.TERMINATE and notice.cloud == "aws"
    assert notice.deadline_ts == deadline
    assert latency < 1.0
    assert ("PUT", "/latest/api/token") in md.requests
    assert anyio.run(w.check) == []  # reported once


def test_aws_rebalance_recommendation(md: MetadataServer) -> None:
    w = AwsWatcher(md.url, poll_s=0.2)
    notice, _ = _first_notice(w, md.inject_rebalance)
    assert notice.kind is NoticeKind.REBALANCE and notice.deadline_ts is None


def test_gcp_preempted_long_poll(md: MetadataServer) -> None:
    w = GcpWatcher(md.url, notice_s=30)
    notice, latency = _first_notice(w, lambda: md.inject_terminate(time.time() + 30))
    assert notice.kind is NoticeKind.TERMINATE and notice.cloud == "gcp"
    assert 25 < notice.deadline_ts - time.time() <= 30
    assert latency < 0.5  # wait_for_change returns at once, no polling interval
    # the fake really checks the header
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(md.url + "/computeMetadata/v1/instance/preempted", timeout=2)
    assert e.value.code == 403


def test_azure_preempt_event_and_ack(md: MetadataServer) -> None:
    w = AzureWatcher(md.url, poll_s=0.2)
    deadline = int(time.time()) + 30
    notice, latency = _first_notice(w, lambda: md.inject_terminate(deadline))
    assert notice.kind is NoticeKind.TERMINATE and notice.cloud == "azure"
    assert notice.deadline_ts == deadline
    assert latency < 1.0
    anyio.run(w.acknowledge, notice)
    assert md.acks == [md.azure_event_id]
    req = urllib.request.Request(md.url + "/metadata/scheduledevents?api-version=2020-07-01", headers={"Metadata": "true"})
    doc = json.loads(urllib.request.urlopen(req, timeout=2).read())
    assert doc["Events"][0]["EventStatus"] == "Started"
    assert doc["Events"][0]["EventType"] == "Preempt"


def test_watchers_survive_a_dead_endpoint() -> None:
    async def go() -> None:
        w = make_watcher("aws", "http://127.0.0.1:9", poll_s=0.05)
        with anyio.move_on_after(0.5):
            await w.run(lambda n: anyio.sleep(0))  # logs failures and keeps polling

    anyio.run(go)
    assert make_watcher("none") is None
