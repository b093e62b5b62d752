"""The systemd watchdog watches the decide loop: orchd pings ``WATCHDOG=1`` while its loop turns, stops once
the loop has been stuck for ``daemon.stall_after_s`` while connected, and pings again once it moves.

A real orchd (in this process, the real core) with the fake cloud, on a real nats-server, under a real
AF_UNIX datagram socket as ``NOTIFY_SOCKET`` and ``WATCHDOG_USEC`` 2 s (pings every 0.75 s here: the
smaller of half WatchdogSec and a quarter of stall_after_s). The fault is a storage quota: the state
bucket's stream capped at its size with discard new, so JetStream refuses a new key (503 "maximum bytes
exceeded") and the store retries it; a price tick for a new pool makes that write. Bounds are generous:
the assertions are about pings stopping and resuming, not about their exact timing.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator

import anyio
import nats
import pytest
from nats.js.api import DiscardPolicy

import wire as ev
from orchestrator import bus
from orchestrator.core.model import pool_record_key
from orchestrator.daemon.run import run_daemon
from orchestrator.settings import load_settings
from simulations.fakecloud import FakeCloud
from tests.integration import helpers as h

pytestmark = pytest.mark.anyio

STALL_AFTER_S = 3.0
PING_S = 0.75  # min(WATCHDOG_USEC / 2, stall_after_s / 4): orchestrator/daemon/run.py _feed_watchdog
SLACK_S = 3.0  # a loaded machine: scheduling, the store's retry backoff
NEW_POOL = ev.PoolKey(cloud="fake", region="r1", zone="r1b", instance_type="gpu.quota", market=ev.Market.SPOT)
STATE_STREAM = f"KV_{bus.KV_STATE}"


class Pings:
    """The datagrams sent to ``NOTIFY_SOCKET`` (an abstract AF_UNIX socket), with their arrival times."""

    def __init__(self) -> None:
        self.name = f"orch-wd-{uuid.uuid4().hex}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.name)
        self.sock.settimeout(0.1)
        self.got: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="notify-socket", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            self.got.append((time.monotonic(), data.decode()))

    def watchdog(self, since: float = 0.0) -> list[float]:
        return [t for t, msg in list(self.got) if msg == "WATCHDOG=1" and t >= since]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.fixture
def pings(monkeypatch: pytest.MonkeyPatch) -> Iterator[Pings]:
    p = Pings()
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + p.name)
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    yield p
    p.close()


async def _set_state_limit(js, max_bytes: int | None) -> int:
    """The state stream's ``max_bytes`` (None: its bytes now, the quota reached), discard new (as a KV
    bucket is created); the previous ``max_bytes``."""
    info = await js.stream_info(STATE_STREAM)
    cfg, old = info.config, info.config.max_bytes
    cfg.max_bytes = max(1, info.state.bytes) if max_bytes is None else max_bytes
    cfg.discard = DiscardPolicy.NEW
    await js.update_stream(cfg)
    return int(old)


def _progress(d) -> float:
    return float(d.metrics.decide_progress._value.get())  # noqa: SLF001 - the gauge orchd serves


async def _silent_for(pings: Pings, quiet_s: float, timeout_s: float) -> float:
    """Wait until no ping came for ``quiet_s``; the time of the last one."""
    with anyio.fail_after(timeout_s):
        while True:
            last = max(pings.watchdog(), default=0.0)
            if time.monotonic() - last >= quiet_s:
                return last
            await anyio.sleep(0.1)


async def test_the_watchdog_stops_while_the_decide_loop_is_stuck_and_resumes(server, tmp_path, pings) -> None:
    settings = load_settings(h.write_config(tmp_path, server.url),
                             env={"ORCH_DAEMON__STALL_AFTER_S": str(STALL_AFTER_S)})
    assert settings.daemon.stall_after_s == STALL_AFTER_S
    nc = await nats.connect(server.url)
    js = nc.jetstream(timeout=5.0)
    async with anyio.create_task_group() as tg:
        d = await tg.start(lambda task_status: run_daemon(settings, {"fake": FakeCloud()}, feeds=False,
                                                                     task_status=task_status))
        await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL, 1.0, 3.0))
        await h.wait_for(lambda: h.POOL.name in d.state.pools)

        # healthy: pings come regularly and the loop's timestamp moves
        t0, p0 = time.monotonic(), _progress(d)
        await anyio.sleep(4.0)
        healthy = pings.watchdog(since=t0)
        assert len(healthy) >= 3, healthy
        assert max(b - a for a, b in zip([t0, *healthy], healthy, strict=False)) < 2.0  # within WatchdogSec
        assert _progress(d) > p0

        # the quota reached, then a record with a new key: refused, retried, the loop stuck
        original = await _set_state_limit(js, None)
        fault = time.monotonic()
        await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(NEW_POOL, 1.0, 3.0))
        last = await _silent_for(pings, quiet_s=STALL_AFTER_S, timeout_s=STALL_AFTER_S + PING_S + 3 * SLACK_S)
        assert last - fault <= STALL_AFTER_S + PING_S + SLACK_S, (last - fault, pings.watchdog(since=fault))
        assert d.stalled_s() > STALL_AFTER_S
        stuck = _progress(d)
        assert time.time() - stuck > STALL_AFTER_S
        await anyio.sleep(1.5)  # three ticks
        assert _progress(d) == stuck
        assert not pings.watchdog(since=last + 0.01)

        # the quota lifted: the refused record is stored on its next retry, the loop and the pings resume
        await _set_state_limit(js, original)
        lifted = time.monotonic()
        await h.wait_for(lambda: pings.watchdog(since=lifted), timeout=2.0 + PING_S + SLACK_S)
        await h.wait_for(lambda: _progress(d) > stuck, timeout=SLACK_S)
        kv = await js.key_value(bus.KV_STATE)
        entry = await kv.get(pool_record_key(NEW_POOL.name))
        assert entry.value and NEW_POOL.instance_type.encode() in entry.value
        t1 = time.monotonic()
        await anyio.sleep(3.0)
        assert len(pings.watchdog(since=t1)) >= 2
        d.request_stop()
    await nc.close()
