"""Attacks on the deposed-leader hand-back: what is in flight when orchd stops deciding.

Admin requests.

orchd's admin endpoints handle one request at a time each (nats.micro: one subscription, one callback
task), so a submit that comes while another is being decided waits in the endpoint's queue and reaches
the decide loop only once the first is answered. When the loop stops right after the first (lease lost,
SIGTERM), the second is taken in after the loop's last batch: the final batch (``Daemon.finish``)
decides it, or hands it back when the lease is gone. Its answer must reach the client: 503
``not_leader`` when it was handed back, ``created`` when it was decided - never silence while the job
was written (the client, told nothing, would submit it again).

JetStream messages. A message the held leader took in reaches the new leader at takeover (it is
nak'ed once the held leader's pull loops stopped), not after the consumers' ack wait, and it is not
dead-lettered for the deliveries the hand-back costs.

Real nats-server, real orchd (in-process ``run_daemon``, two of them in HA), the real core behind a
wrapper that holds the event loop on one event (a GC pause; a long batch) or asks the daemon to stop
there (SIGTERM); the client is ``AdminClient`` (orchctl's).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio
import nats
import pytest

import wire as ev
from orchestrator import bus
from orchestrator.cli.client import AdminClient, AdminError, AdminUnreachable
from orchestrator.core.inputs import JobSubmitted
from orchestrator.daemon.coreapi import CoreApi, default_core
from orchestrator.daemon.registry import known_instance_types
from orchestrator.daemon.run import EXIT_LEASE_LOST, run_daemon
from orchestrator.jobspec import parse_jobspec
from orchestrator.natsserver import NatsServer
from orchestrator.settings import Settings, load_settings
from simulations.fakecloud import FakeCloud
from tests.integration import helpers as h

pytestmark = pytest.mark.anyio
TTL = 2.0


def _settings(tmp_path, url: str, name: str, *, ha: bool) -> Settings:
    (tmp_path / name).mkdir()
    cfg = h.write_config(tmp_path / name, url)
    extra = f"ha = true\nlease_ttl_s = {TTL}\n" if ha else ""
    # a Tick every 5 s: the loop does not pick the queued submit up in a Tick's urgent round
    cfg.write_text(cfg.read_text().replace("[daemon]\n", f"[daemon]\n{extra}").replace("tick_s = 0.5", "tick_s = 5.0"))
    return load_settings(cfg, env={})


def _is_s1(event: object) -> bool:
    return isinstance(event, JobSubmitted) and event.job_id == "s1"


def _core(settings: Settings, cloud: FakeCloud, on_first: Callable[[], None],
          first: Callable[[object], bool] = _is_s1) -> CoreApi:
    """The real core; ``on_first()`` runs when an event ``first`` picks is decided (default: job s1's submission)."""
    real = default_core(settings, known_instance_types({"fake": cloud}))

    def decide(state: Any, event: Any, now: float) -> Any:
        if first(event):
            on_first()
        return real.decide(state, event, now)

    return dataclasses.replace(real, decide=decide)


def _spec(name: str) -> ev.JobSpec:
    return parse_jobspec(h.JOB_TOML.format(nodes=1).replace("orch-itest-ckpt", f"orch-attack-{name}"))


async def _submit(client: AdminClient, job_id: str, out: dict[str, tuple[str, object]]) -> None:
    try:
        reply = await client.submit(_spec(job_id), job_id=job_id)
        out[job_id] = ("ok", reply.created)
    except AdminError as e:
        out[job_id] = ("error", e.code, e.message)
    except AdminUnreachable as e:
        out[job_id] = ("unreachable", str(e))


async def _two_submits(url: str, out: dict[str, tuple[str, object]]) -> None:
    """s1, and s2 while s1 is being decided (s2 waits in the endpoint's queue)."""
    client = await AdminClient.connect([url], timeout_s=8.0)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_submit, client, "s1", out)
            await anyio.sleep(0.2)
            tg.start_soon(_submit, client, "s2", out)
    finally:
        await client.close()


async def test_a_submit_queued_at_sigterm_is_answered(tmp_path) -> None:
    """Single orchd (no HA: it may always act): a stop while s1 is decided. s2 is decided by the final
    batch - and the client is told so, not left to time out with the job written."""
    server = NatsServer(tmp_path / "nats").start()
    cloud = FakeCloud()
    stop = anyio.Event()
    settings = _settings(tmp_path, server.url, "a", ha=False)

    def sigterm() -> None:
        stop.set()
        time.sleep(0.5)  # s2 reaches orchd meanwhile

    out: dict[str, tuple[str, object]] = {}
    nc = await nats.connect(server.url)
    try:
        async with anyio.create_task_group() as tg:
            d = await tg.start(lambda task_status: run_daemon(settings, {"fake": cloud}, stop=stop, feeds=False,
                                                              core=_core(settings, cloud, sigterm),
                                                              task_status=task_status))
            await h.publish_js(nc.jetstream(), ev.subject_price("fake", "r1"), h.price(h.POOL, 1.0, 3.0))
            await _two_submits(server.url, out)
        assert d.state is not None
        print(f"\noutcomes {out}; jobs {sorted(d.state.jobs)}")
        assert out["s1"] == ("ok", True)
        for job_id in ("s1", "s2"):
            assert out[job_id][0] != "unreachable", f"{job_id}: {out[job_id]}"
            assert (job_id in d.state.jobs) == (out[job_id] == ("ok", True)), (job_id, out[job_id])
    finally:
        await nc.close()
        server.cleanup()


async def test_submits_in_flight_when_the_lease_is_lost_fail_503_not_leader(tmp_path) -> None:
    """HA: a pause longer than the lease TTL while s1 is decided (the loop is held: a GC pause, a long
    batch). s1's persist ends past the lease's deadline, s2 is taken in after the loop stopped: both are
    handed back, and both clients read 503 not_leader (not a time-out). Retried, the standby that took
    over creates them."""
    server = NatsServer(tmp_path / "nats").start()
    cloud = FakeCloud()
    sa = _settings(tmp_path, server.url, "a", ha=True)
    sb = _settings(tmp_path, server.url, "b", ha=True)
    out: dict[str, tuple[str, object]] = {}
    nc = await nats.connect(server.url)
    try:
        async with anyio.create_task_group() as tg:
            a = await tg.start(lambda task_status: run_daemon(sa, {"fake": cloud}, feeds=False, task_status=task_status,
                                                              core=_core(sa, cloud, lambda: time.sleep(TTL + 0.2))))
            b_handle: list = []
            tg.start_soon(_standby, sb, cloud, b_handle)
            await h.publish_js(nc.jetstream(), ev.subject_price("fake", "r1"), h.price(h.POOL, 1.0, 3.0))
            t0 = time.monotonic()
            await _two_submits(server.url, out)
            answered_s = time.monotonic() - t0
            b = await h.wait_for(lambda: b_handle and b_handle[0], timeout=20)
            print(f"\noutcomes {out} within {answered_s:.2f} s; A exit {a.exit_code}")
            assert a.exit_code == EXIT_LEASE_LOST
            for job_id in ("s1", "s2"):
                kind, *rest = out[job_id]
                assert kind == "error" and rest[0] == 503 and "lost the leader lease" in str(rest[1]), (job_id, out)
                assert f"--id {job_id}" in str(rest[1])  # s1 was written: a retry under a new id would be a 2nd job
            print(f"s1 known to the new leader before the retry: {'s1' in b.state.jobs}")
            async with await AdminClient.connect([server.url], timeout_s=8.0) as client:
                for job_id in ("s1", "s2"):  # the retry reaches the new leader
                    reply = await client.submit(_spec(job_id), job_id=job_id)
                    assert reply.job_id == job_id
            assert {"s1", "s2"} <= set(b.state.jobs)
            b.request_stop()
    finally:
        await nc.close()
        server.cleanup()


async def _all_acked(nc: Any) -> None:
    """Until the market consumer has nothing pending or unacked (30 s at most)."""
    js = nc.jetstream()
    with anyio.fail_after(30):
        while True:
            info = await js.consumer_info(bus.STREAM_MARKET, bus.CONSUMER_MARKET)
            if info.num_ack_pending == 0 and info.num_pending == 0:
                return
            await anyio.sleep(0.05)


async def _standby(settings: Settings, cloud: FakeCloud, sink: list) -> None:
    class Started:
        def started(self, value: object = None) -> None:
            sink.append(value)

    await run_daemon(settings, {"fake": cloud}, feeds=False, task_status=Started())  # type: ignore[arg-type]


_PUBLISH = """
import asyncio, sys, nats
async def main():
    nc = await nats.connect(sys.argv[1])
    await nc.jetstream().publish(sys.argv[2], sys.argv[3].encode(), headers={"Nats-Msg-Id": sys.argv[4]})
    await nc.close()
asyncio.run(main())
"""


async def test_a_tick_taken_in_by_a_paused_leader_reaches_the_new_one_at_takeover(tmp_path) -> None:
    """HA: a price tick published while the leader is held past its lease (another process publishes it
    then: the leader's pull request takes it in). The paused leader hands it back (nak): the new leader
    decides it once it pulls, well within the consumers' ack wait (10 s here) - and it is not parked as
    delivered too often (``dead_after_deliveries``: a nak is a delivery)."""
    server = NatsServer(tmp_path / "nats").start()
    cloud = FakeCloud()
    sa = _settings(tmp_path, server.url, "a", ha=True)
    sb = _settings(tmp_path, server.url, "b", ha=True)
    tick = h.price(h.POOL, 1.7, 3.0)
    publisher: list[subprocess.Popen[bytes]] = []

    def pause() -> None:
        publisher.append(subprocess.Popen([sys.executable, "-c", _PUBLISH, server.url, ev.subject_price("fake", "r1"),
                                           ev.encode(tick).decode(), tick.id]))
        publisher[0].wait(timeout=20)  # the tick is in the stream, and delivered to the held leader's pull
        time.sleep(TTL)

    out: dict[str, tuple[str, object]] = {}
    nc = await nats.connect(server.url)
    try:
        async with anyio.create_task_group() as tg:
            a = await tg.start(lambda task_status: run_daemon(sa, {"fake": cloud}, feeds=False, task_status=task_status,
                                                              core=_core(sa, cloud, pause)))
            b_handle: list = []
            tg.start_soon(_standby, sb, cloud, b_handle)
            await h.publish_js(nc.jetstream(), ev.subject_price("fake", "r1"), h.price(h.POOL, 1.0, 3.0))
            await _two_submits(server.url, out)
            b = await h.wait_for(lambda: b_handle and b_handle[0], timeout=20)
            ready = time.monotonic()
            assert a.exit_code == EXIT_LEASE_LOST and publisher[0].returncode == 0

            await _new_leader_has_the_tick(b, nc, ready)
            b.request_stop()
    finally:
        await nc.close()
        server.cleanup()


async def _new_leader_has_the_tick(b, nc, ready: float) -> None:
    """The new leader ``b`` has the 1.7 tick in its prices, acked, soon after it was ready (handed back:
    nak'ed at once, not redelivered after the consumer's ack wait), and nothing was dead-lettered."""

    def priced() -> bool:
        return any(p.pool == h.POOL and p.price_usd_h == 1.7 for p in b.state.pools.values())

    await h.wait_for(priced, timeout=30)
    await _all_acked(nc)  # by the new leader: the held one acked nothing of it
    took = time.monotonic() - ready
    dead = await nc.jetstream().stream_info(bus.STREAM_DEAD)
    print(f"\nthe new leader had the tick {took:.2f} s after it was ready; dead letters {dead.state.messages}")
    assert took < bus.ack_wait_s(TTL) / 2, took
    assert dead.state.messages == 0


async def test_a_tick_whose_persist_outlived_the_lease_reaches_the_new_leader_at_takeover(tmp_path) -> None:
    """HA: the leader is held past its lease while it decides a price tick (so its persist ends after the
    deadline). The tick is nak'ed while the leader's pull request is still open - the server may hand it
    to that same leader again, which stops right after: the new leader must still get it within the ack
    wait, and it must not be dead-lettered."""
    server = NatsServer(tmp_path / "nats").start()
    cloud = FakeCloud()
    sa = _settings(tmp_path, server.url, "a", ha=True)
    sb = _settings(tmp_path, server.url, "b", ha=True)
    tick = h.price(h.POOL, 1.7, 3.0)

    def is_tick(event: object) -> bool:
        return isinstance(event, ev.PriceTick) and event.price_usd_h == 1.7

    nc = await nats.connect(server.url)
    try:
        async with anyio.create_task_group() as tg:
            a = await tg.start(lambda task_status: run_daemon(sa, {"fake": cloud}, feeds=False, task_status=task_status,
                                                              core=_core(sa, cloud, lambda: time.sleep(TTL + 0.2),
                                                                         is_tick)))
            b_handle: list = []
            tg.start_soon(_standby, sb, cloud, b_handle)
            await h.publish_js(nc.jetstream(), ev.subject_price("fake", "r1"), tick)
            b = await h.wait_for(lambda: b_handle and b_handle[0], timeout=20)
            ready = time.monotonic()
            assert a.exit_code == EXIT_LEASE_LOST

            # a nak while the held leader's pull was still open went back to that same pull, and was lost
            # with it: the new leader got the tick only after the ack wait (10 s after the nak)
            await _new_leader_has_the_tick(b, nc, ready)
            b.request_stop()
    finally:
        await nc.close()
        server.cleanup()
