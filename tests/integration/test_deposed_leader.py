"""A daemon that lost the leader lease hands back what it took in, instead of acking it.

Seen in the partition drills (``nats_minority``): a minority cut delayed the lease's renewal past its
deadline, a standby took over and loaded the state, while the old leader went on deciding, persisting
and *acking* the price ticks it had pulled - so the new leader never saw them (its state lacked them),
though JetStream held them as delivered. Now (``Daemon.process``): a batch taken in by a daemon that may
no longer act is not decided; one whose persist ended after the lease's deadline is not acked. Its
JetStream messages are nak'ed - redelivered at once to the leader that took over, not after the ack
wait -, its admin requests fail with ``NotLeader`` (503: the client retries on the new leader). The
naks come with the final batch (``Daemon.finish``, once the pull loops stopped): nak'ed while its own
pull request is open, a message would go back to that request and be lost with it until the ack wait
(tests/integration/test_ha_attack.py shows it with two orchd).

Real nats-server, the daemon's real durable consumer, ``Store`` and core; the lease is the executor's
``may_act`` (``LeaderLease.valid`` in orchd).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import anyio
import nats
import nats.errors
import pytest

import wire as ev
from orchestrator import bus
from orchestrator.core.inputs import JobCancelled
from orchestrator.daemon.coreapi import default_core
from orchestrator.daemon.executor import Executor
from orchestrator.daemon.loop import Daemon
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.records import Batch, NotLeader, ShellItem
from orchestrator.daemon.store import Store
from orchestrator.settings import Settings

pytestmark = pytest.mark.anyio
POOLS = [ev.PoolKey(cloud="fake", region="r1", zone=f"r1{z}", instance_type="gpu.a", market=ev.Market.SPOT)
         for z in "abc"]


async def _world(nc, lease: Iterator[bool]) -> tuple[Daemon, object]:
    topo = await bus.ensure_topology(nc)
    await bus.ensure_consumers(topo.js)  # ack wait 30 s: a redelivery within seconds is a nak
    settings = Settings()
    d = Daemon(settings, {}, default_core(settings), Metrics())
    d.store = Store(topo, writer=nc)
    d.executor = Executor(settings, {}, nc, lambda r: None, d.metrics, may_act=lambda: next(lease))
    d.state = d.core.empty_state()
    sub = await topo.js.pull_subscribe("orch.price.>", durable=bus.CONSUMER_MARKET, stream=bus.STREAM_MARKET)
    return d, sub


async def _taken_in(js, sub, tag: str) -> list:
    for i, pool in enumerate(POOLS):
        tick = ev.PriceTick(id=f"{tag}-{i}", pool=pool, gpu_type="A100", gpus_per_node=1, price_usd_h=1.0 + i,
                            on_demand_usd_h=3.0, ts=1.0)
        await js.publish(ev.subject_price("fake", "r1"), ev.encode(tick), headers={"Nats-Msg-Id": tick.id})
    return await sub.fetch(len(POOLS), timeout=5)


async def _redelivered(sub) -> list[int]:
    """The delivery counts of what the consumer hands out within 2 s (ack wait: 30 s); one fetch may
    return before all of them came."""
    msgs: list = []
    with anyio.move_on_after(2):
        while len(msgs) < len(POOLS):
            try:
                msgs += await sub.fetch(len(POOLS) - len(msgs), timeout=2)
            except nats.errors.TimeoutError:
                break
    for m in msgs:
        await m.ack()
    return [m.metadata.num_delivered for m in msgs]


def _request() -> tuple[ShellItem, asyncio.Future[None]]:
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    return ShellItem(JobCancelled(job_id=ev.JobId("no-such-job")), fut), fut


async def _process_a_batch(nc, lease: Iterator[bool], tag: str) -> tuple[Daemon, object, asyncio.Future[None]]:
    """The daemon takes in three price ticks and an admin request and processes them as one batch, its
    lease answering from ``lease``: (daemon, the consumer's subscription, the request's future)."""
    d, sub = await _world(nc, lease)
    msgs = await _taken_in(nc.jetstream(), sub, tag)
    item, fut = _request()
    await d.process(Batch([("market", m) for m in msgs], [], [item]))
    return d, sub, fut


def _prices(d: Daemon) -> set[str]:
    assert d.state is not None
    return {ps.pool.name for ps in d.state.pools.values() if ps.price_usd_h is not None
            and ps.pool.market == ev.Market.SPOT}


async def test_a_batch_taken_in_after_the_lease_was_lost_is_handed_back(nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        d, sub, fut = await _process_a_batch(nc, iter(lambda: False, None), "lost")
        assert _prices(d) == set()  # not decided
        with pytest.raises(NotLeader):
            await fut
        await d.finish()  # the pull loops stopped: what was handed back is nak'ed
        assert await _redelivered(sub) == [2, 2, 2]  # nak'ed: at once, to whoever pulls next
    finally:
        await nc.close()


async def test_a_batch_whose_persist_outlived_the_lease_is_not_acked(nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        answers = iter([True])  # valid when the batch starts, past the deadline once it is persisted
        d, sub, fut = await _process_a_batch(nc, iter(lambda: next(answers, False), None), "late")
        assert _prices(d) == {p.name for p in POOLS}  # decided and written...
        with pytest.raises(NotLeader):  # ...but the request is not answered as done
            await fut
        await d.finish()
        assert await _redelivered(sub) == [2, 2, 2]  # and the new leader decides the ticks again
    finally:
        await nc.close()


async def test_a_leader_acks_what_it_persisted(nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        d, sub, fut = await _process_a_batch(nc, iter(lambda: True, None), "held")
        assert _prices(d) == {p.name for p in POOLS}
        with anyio.fail_after(5):
            await fut
        assert await _redelivered(sub) == []
    finally:
        await nc.close()
