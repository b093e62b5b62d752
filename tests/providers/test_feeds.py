"""Price feed -> real nats-server JetStream: ticks land on orch.price.<cloud>.<region>, dedup by msg id."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import anyio
import nats
import nats.js.errors
import pytest
from nats.js import JetStreamContext

from orchestrator import bus
from orchestrator.daemon.feeds import FeedRound, feed_once, run_price_feed, tick_id
from providers.base import PriceQuote, TransientError
from simulations.fakecloud import FakeCloud
from tests.providers.helpers import pool
from wire import Market, PoolKey, PriceTick, decode

pytestmark = pytest.mark.anyio

P1 = pool("aws", "us-east-1", "us-east-1a", "g5.xlarge")
P2 = pool("aws", "us-west-2", "us-west-2b", "g5.xlarge")
P3 = pool("aws", "us-west-2", "us-west-2b", "g5.xlarge", Market.ON_DEMAND)


def _cloud(now: list[float]) -> FakeCloud:
    c = FakeCloud("aws", clock=lambda: now[0], gpu_type="A10G")
    c.set_price(P1, 0.40, 1.006)
    c.set_price(P2, 0.45, 1.006)
    c.set_price(P3, 1.006, 1.006)
    return c


class Failing(FakeCloud):
    def prices(self, pools: Sequence[PoolKey] | None = None) -> list[PriceQuote]:
        raise TransientError("RequestLimitExceeded: injected")


async def _stream_ticks(js: JetStreamContext, subject: str = "orch.price.>") -> list[PriceTick]:
    sub = await js.pull_subscribe(subject, stream=bus.STREAM_MARKET)
    out = []
    try:
        while True:
            msgs = await sub.fetch(50, timeout=1.0)
            for m in msgs:
                out.append(decode(m.data, PriceTick))
                assert m.headers["Nats-Msg-Id"] == out[-1].id
                await m.ack()
    except (nats.errors.TimeoutError, TimeoutError):  # an empty batch fetch can raise the plain asyncio one
        pass
    await sub.unsubscribe()
    return out


async def test_feed_publishes_ticks_and_dedups(nats_url: str) -> None:
    nc = await nats.connect(nats_url, error_cb=_ignore)
    try:
        js = nc.jetstream()
        await bus.ensure_topology(nc)
        await js.purge_stream(bus.STREAM_MARKET)
        now = [1_800_000_000.0]
        cloud = _cloud(now)
        r1 = await feed_once(js, cloud)
        r2 = await feed_once(js, cloud)  # same quotes, same ts: a replay (retry, standby) is dropped
        # a publish that timed out on a loaded box and was retried shows up as a duplicate: both are stored once
        assert (r1.quotes, r1.published + r1.duplicates, r1.failed) == (3, 3, 0)
        assert (r2.published, r2.duplicates) == (0, 3)
        info = await js.stream_info(bus.STREAM_MARKET)
        assert info.state.messages == 3
        west = await _stream_ticks(js, "orch.price.aws.us-west-2")
        assert sorted((t.pool.market, t.price_usd_h) for t in west) == [(Market.ON_DEMAND, 1.006), (Market.SPOT, 0.45)]
        t = west[0]
        assert t.id == tick_id(t.pool, now[0]) and t.gpu_type == "A10G" and t.ts == now[0]
    finally:
        await nc.close()


async def test_feed_task_rounds_and_survives_provider_errors(nats_url: str) -> None:
    nc = await nats.connect(nats_url, error_cb=_ignore)
    try:
        js = nc.jetstream()
        await bus.ensure_topology(nc)
        await js.purge_stream(bus.STREAM_MARKET)
        now = [1_800_000_100.0]
        cloud = _cloud(now)
        rounds = []

        def on_round(r: FeedRound) -> None:
            rounds.append(r)
            now[0] += 60  # the next round sees new prices

        failing = Failing("aws")
        bad_rounds = []
        async with anyio.create_task_group() as tg:
            await tg.start(lambda task_status: run_price_feed(js, cloud, interval_s=0.05, on_round=on_round,
                                                              task_status=task_status))
            await tg.start(lambda task_status: run_price_feed(js, failing, interval_s=0.05,
                                                              on_round=bad_rounds.append, task_status=task_status))
            with anyio.fail_after(30):
                while len(rounds) < 3 or len(bad_rounds) < 2:
                    await anyio.sleep(0.02)
            tg.cancel_scope.cancel()
        assert all(r.published + r.duplicates == 3 and r.failed == 0 for r in rounds[:3])
        assert all(r.error and "RequestLimitExceeded" in r.error for r in bad_rounds)
        ticks = await _stream_ticks(js, "orch.price.aws.us-east-1")
        assert len(ticks) >= 3 and len({t.id for t in ticks}) == len(ticks)
    finally:
        await nc.close()


async def _ignore(e: Exception) -> None:
    pass


async def test_real_provider_prices_reach_the_stream(nats_url: str) -> None:
    """The GCP provider (real REST client -> catalog fake) through the feed onto JetStream."""
    from providers.gcp import Config, GcpProvider
    from tests.providers.fakes.gcp import FakeGcp, sku

    fake = FakeGcp().start()
    nc = await nats.connect(nats_url, error_cb=_ignore)
    try:
        where = ["us-central1"]
        fake.skus = [sku("Spot Preemptible Nvidia L4 GPU running in Americas", "GPU", "Preemptible", 0.22, where),
                     sku("Spot Preemptible G2 Instance Core running in Americas", "CPU", "Preemptible", 0.009, where),
                     sku("Spot Preemptible G2 Instance Ram running in Americas", "RAM", "Preemptible", 0.001, where,
                         "GiBy.h")]
        provider = GcpProvider(Config.from_raw({"project": "p", "zones": ["us-central1-a"],
                                                "machine_types": ["g2-standard-4"], "markets": ["spot"],
                                                "billing_endpoint": fake.url, "anonymous": True}))
        js = nc.jetstream()
        await bus.ensure_topology(nc)
        r = await feed_once(js, provider, limiter=anyio.CapacityLimiter(1))
        assert (r.quotes, r.published + r.duplicates) == (1, 1)
        (tick,) = await _stream_ticks(js, "orch.price.gcp.us-central1")
        assert tick.pool.instance_type == "g2-standard-4" and tick.gpu_type == "L4"
        assert tick.price_usd_h == pytest.approx(4 * 0.009 + 16 * 0.001 + 0.22)
        assert tick.on_demand_usd_h == pytest.approx(0.707)  # no on-demand SKUs: the bundled list price
    finally:
        await nc.close()
        fake.stop()


async def test_no_stream_counts_failures_without_crashing(nats_url: str) -> None:
    nc = await nats.connect(nats_url, error_cb=_ignore)
    try:
        js = nc.jetstream()
        with contextlib.suppress(nats.js.errors.NotFoundError):  # already gone: what this test needs
            await js.delete_stream(bus.STREAM_MARKET)
        now = [1_800_000_000.0]
        cloud = FakeCloud("nowhere", clock=lambda: now[0])
        cloud.set_price(pool("nowhere", "r1", "r1-a", "t"), 1.0)
        r = await feed_once(js, cloud)
        assert (r.quotes, r.published, r.failed) == (1, 0, 1)
    finally:
        await nc.close()


def test_quote_ts_changes_id() -> None:
    q = PriceQuote(pool=P1, gpu_type="A10G", gpus_per_node=1, price_usd_h=0.4, ts=1.0)
    assert tick_id(q.pool, 1.0) != tick_id(q.pool, 2.0) != tick_id(P2, 2.0)
