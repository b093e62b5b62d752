"""Hostile bytes against a real orchd on a real nats-server.

1. 2 KB of JSON nested ~1,000 levels deep makes msgspec raise ``RecursionError`` (not a DecodeError).
   Sent as a heartbeat (core NATS), on a price subject and on a node event subject (JetStream), it must
   be rejected and counted (``orchd_messages_rejected_total{kind, reason="too_deep"}``), the JetStream
   copies terminated (not redelivered), the state unchanged, and orchd - a real subprocess, the
   production entry point - still running. (The previous release exited with rc 1 on the heartbeat.)
2. Dead letters: a message the core raises on is parked in ``ORCH_DEAD`` at once (``core_error``); a
   message already delivered ``daemon.dead_after_deliveries`` times is parked unread
   (``max_deliveries``); ``orchctl dead list`` shows both, ``orchctl dead replay SEQ`` republishes one
   to its original subject.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats
import pytest

import wire as ev
from orchestrator import bus
from orchestrator.daemon.coreapi import default_core
from orchestrator.daemon.run import run_daemon
from simulations.fakecloud import FakeCloud
from tests.integration import helpers as h
from tests.integration.helpers import actl

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[2]


def deep(depth: int = 1000) -> bytes:
    """A well-formed heartbeat of node n1 with an ignored field nested ``depth`` levels (~2 KB)."""
    hb = ev.encode(ev.Heartbeat(node_id="n1", seq=1, ts=time.time(), state=ev.AgentState.TRAINING))
    return b'{"zz":' + b"[" * depth + b"]" * depth + b"," + hb[1:]




def start_orchd(cfg: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """orchd as a real subprocess (``python -m orchestrator.daemon``); returns it and its /metrics URL."""
    disc = cfg.parent / "state" / "orchd.json"
    with open(log, "a") as err:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.daemon", "--config", str(cfg)],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.time() + 30
    while not disc.exists():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, "orchd did not start"
        time.sleep(0.05)
    return proc, json.loads(disc.read_text())["metrics_url"]


def rejected(metrics_url: str) -> dict[tuple[str, str], float]:
    """``orchd_messages_rejected_total`` by (kind, reason), scraped from /metrics."""
    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        text = r.read().decode()
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("orchd_messages_rejected_total{"):
            labels, value = line[line.index("{") + 1:].split("} ")
            kv = dict(p.split("=", 1) for p in labels.split(","))
            out[kv["kind"].strip('"'), kv["reason"].strip('"')] = float(value)
    return out


async def test_deep_nesting_is_rejected_counted_termed_and_orchd_stays_up(server, tmp_path):
    url = server.url
    fake_file = tmp_path / "fake.json"
    cfg = h.write_config(tmp_path, url,
                         extra=f'[providers]\nenabled = ["fake"]\n[providers.fake]\nstate_file = "{fake_file}"\n')
    log = tmp_path / "orchd.log"
    proc, metrics_url = await anyio.to_thread.run_sync(lambda: start_orchd(cfg, log))
    nc = await nats.connect(url)
    js = nc.jetstream()
    try:
        await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL, 1.0, 3.0))
        with anyio.fail_after(15):
            while not json.loads(before := (await actl(url, "prices", "-o", "json"))[1])["pools"]:
                await anyio.sleep(0.1)

        payload = deep()
        assert len(payload) < 2500
        for _ in range(3):  # the heartbeat that killed the previous release (RecursionError, rc 1)
            await nc.publish(ev.subject_heartbeat("n1"), payload)
        await nc.flush()
        price_ack = await js.publish("orch.price.aws.us-east-1", payload)
        event_ack = await js.publish(ev.subject_node_event("n1"), payload)
        assert (price_ack.stream, event_ack.stream) == (bus.STREAM_MARKET, bus.STREAM_EVENTS)

        want = {("heartbeat", "too_deep"): 3.0, ("price", "too_deep"): 1.0, ("node_event", "too_deep"): 1.0}

        def counted() -> bool:
            got = rejected(metrics_url)
            return all(got.get(k, 0.0) >= n for k, n in want.items())

        await h.wait_for(lambda: proc.poll() is not None or counted(), timeout=15)
        assert proc.poll() is None, "orchd died:\n" + log.read_text()[-3000:]
        assert {k: rejected(metrics_url).get(k) for k in want} == want
        # terminated: nothing pending or waiting for an ack, nothing redelivered
        for stream, consumer in ((bus.STREAM_MARKET, bus.CONSUMER_MARKET), (bus.STREAM_EVENTS, bus.CONSUMER_EVENTS)):
            info = await js.consumer_info(stream, consumer)
            assert (info.num_ack_pending, info.num_pending, info.num_redelivered) == (0, 0, 0), (stream, info)
        # still deciding: a valid price after the attack is taken; the attack changed nothing
        code, after, err = await actl(url, "prices", "-o", "json")
        assert code == 0 and json.loads(after) == json.loads(before), err
        code, out, err = await actl(url, "status", "-o", "json")
        assert code == 0 and json.loads(out)["nodes"] == {}, err
        code, out, err = await actl(url, "dead", "list", "-o", "json")  # rejected: termed, not parked
        assert code == 0 and json.loads(out)["messages"] == [], err
        assert proc.poll() is None
    finally:
        await nc.close()
        proc.terminate()
        rc = await anyio.to_thread.run_sync(lambda: proc.wait(20))
    assert rc == 0, log.read_text()[-3000:]


def poison_core(settings: Any) -> Any:
    """The real core, except that it raises on the price tick with id ``poison`` (a core bug)."""
    base = default_core(settings)

    def decide(state: Any, event: Any, now: float) -> Any:
        if isinstance(event, ev.PriceTick) and event.id == "poison":
            raise RuntimeError("core bug")
        return base.decide(state, event, now)

    return dataclasses.replace(base, decide=decide)


async def nak_times(js: Any, n: int) -> None:
    """Be the durable consumer ``orchd-market`` before orchd runs: take the first message and ``nak``
    it ``n`` times, so orchd gets its (n+1)-th delivery."""
    psub = await js.pull_subscribe(ev.subject_price("fake", "r1"), durable=bus.CONSUMER_MARKET,
                                   stream=bus.STREAM_MARKET)
    for i in range(n):
        (msg,) = await psub.fetch(1, timeout=5)
        assert msg.metadata.num_delivered == i + 1
        await msg.nak()
    await psub.unsubscribe()


async def test_dead_letters_parked_listed_and_replayed(server, tmp_path):
    url = server.url
    settings = h.settings_for(tmp_path, url)
    n = settings.daemon.dead_after_deliveries
    nc = await nats.connect(url)
    topo = await bus.ensure_topology(nc)
    await bus.ensure_consumers(topo.js)
    js = nc.jetstream()
    stuck = h.price(h.POOL, 1.0, 3.0)
    await h.publish_js(js, ev.subject_price("fake", "r1"), stuck)
    await nak_times(js, n - 1)  # delivered n-1 times, never acked (as if orchd had died on it)
    async with anyio.create_task_group() as tg:
        d = await tg.start(lambda task_status: run_daemon(settings, {"fake": FakeCloud()}, core=poison_core(settings),
                                                          task_status=task_status))
        poison = msgspec.structs.replace(h.price(h.POOL_OD, 3.0, 3.0), id="poison")
        await h.publish_js(js, ev.subject_price("fake", "r1"), poison)

        async def parked(count: int) -> list[dict[str, Any]]:
            with anyio.fail_after(15):
                while True:
                    code, out, err = await actl(url, "dead", "list", "-o", "json")
                    assert code == 0, err
                    if len(rows := json.loads(out)["messages"]) >= count:
                        return rows
                    await anyio.sleep(0.1)

        rows = await parked(2)
        assert len(rows) == 2
        by_reason = {r["reason"]: r for r in rows}
        assert set(by_reason) == {"max_deliveries", "core_error"}
        assert by_reason["max_deliveries"]["deliveries"] == n
        assert by_reason["core_error"]["deliveries"] == 1  # the core is deterministic: no retries
        assert {r["subject"] for r in rows} == {ev.subject_price("fake", "r1")}
        assert '"id":"poison"' in by_reason["core_error"]["preview"]
        assert not d.state.pools  # neither reached the state
        for stream, consumer in ((bus.STREAM_MARKET, bus.CONSUMER_MARKET),):
            info = await js.consumer_info(stream, consumer)
            assert (info.num_ack_pending, info.num_pending) == (0, 0)  # both termed
        code, table, err = await actl(url, "dead", "list")
        assert code == 0 and "max_deliveries" in table and "core_error" in table, err

        # replay the stuck one: republished to its subject, decided this time
        code, out, err = await actl(url, "dead", "replay", str(by_reason["max_deliveries"]["seq"]))
        assert code == 0 and "republished to orch.price.fake.r1" in out, err
        await h.wait_for(lambda: h.POOL.name in d.state.pools, timeout=10)
        # replay the poison: the core raises again, parked again
        code, out, err = await actl(url, "dead", "replay", str(by_reason["core_error"]["seq"]))
        assert code == 0, err
        assert len(await parked(3)) == 3
        code, out, err = await actl(url, "dead", "replay", "999")
        assert code == 66 and "404" in err  # EXIT_NOT_FOUND
        d.request_stop()
    await nc.close()
