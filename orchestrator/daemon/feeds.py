"""Price feeds inside orchd: poll a provider's prices, publish ``PriceTick`` on JetStream.

Role: every ``interval_s`` call ``provider.prices()`` in a worker thread and publish one ``PriceTick``
per quote on ``orch.price.<cloud>.<region>`` (stream ORCH_MARKET, defined in orchestrator/bus.py), exactly
as an external publisher would, so the core cannot tell (and need not care) where a price came from.

De-duplication: each tick's id - and its ``Nats-Msg-Id`` - is derived from (pool, ts). A publish
that timed out is retried with the same id (a timed-out publish may still have been stored), and a
standby daemon replaying the same quote is dropped by the server inside the stream's duplicate window.

Concurrency contract: ``run_price_feed`` is an anyio task (asyncio backend: nats-py is asyncio only),
started with ``await tg.start(run_price_feed, js, provider, ...)``; it signals readiness after the first
round and runs until cancelled (cancellation is re-raised, never swallowed). The blocking SDK call runs
in ``anyio.to_thread.run_sync`` under the optional per-cloud ``limiter`` (share the executor's).
A failing round (``ProviderError``) is logged and counted; the next round happens on schedule.

Logging: a round is a debug line (``price_feed_round``); at info, one ``price_feed_summary`` per cloud
every ``summary_s`` (default 300 s) with the rounds, quotes, published ticks, duplicates and failures
since the previous summary. A round that fails still logs its own warning at once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import structlog
from nats.js import JetStreamContext

from providers.base import CloudProvider, PriceQuote, ProviderError
from wire import PoolKey, PriceTick, encode, subject_price

log = structlog.get_logger("orch.feeds")

SUMMARY_S = 300.0
"""How often a running feed logs its ``price_feed_summary`` at info."""

def tick_id(pool: PoolKey, ts: float) -> str:
    """Stable id of the price of ``pool`` at ``ts``: the tick's ``id`` and its Nats-Msg-Id."""
    return "px-" + hashlib.sha256(f"{pool.name}@{ts:.3f}".encode()).hexdigest()[:32]


def tick_from_quote(q: PriceQuote) -> PriceTick:
    return PriceTick(
        id=tick_id(q.pool, q.ts),
        pool=q.pool,
        gpu_type=q.gpu_type,
        gpus_per_node=q.gpus_per_node,
        price_usd_h=q.price_usd_h,
        on_demand_usd_h=q.on_demand_usd_h,
        capacity_hint=q.capacity_hint,
        ts=q.ts,
    )


@dataclass(frozen=True, slots=True)
class FeedRound:
    cloud: str
    quotes: int = 0
    published: int = 0
    duplicates: int = 0
    failed: int = 0
    error: str | None = None


async def publish_quotes(js: JetStreamContext, quotes: Sequence[PriceQuote], *, attempts: int = 3,
                         timeout_s: float = 5.0) -> tuple[int, int, int]:
    """Publish quotes as ticks; returns (published, duplicates, failed)."""
    import nats.errors

    published = duplicates = failed = 0
    for q in quotes:
        tick = tick_from_quote(q)
        subject = subject_price(q.pool.cloud, q.pool.region)
        for attempt in range(1, attempts + 1):
            try:
                ack = await js.publish(subject, encode(tick), timeout=timeout_s, headers={"Nats-Msg-Id": tick.id})
            except nats.errors.Error as e:  # timeout, no responders (no stream), reconnecting, JetStream API errors
                if attempt == attempts:
                    failed += 1
                    log.warning("price_publish_failed", pool=q.pool.name, error=type(e).__name__)
                else:
                    await anyio.sleep(0.2 * attempt)
                continue
            if ack.duplicate:
                duplicates += 1
            else:
                published += 1
            break
    return published, duplicates, failed


async def feed_once(js: JetStreamContext, provider: CloudProvider, *, pools: Sequence[PoolKey] | None = None,
                    limiter: anyio.CapacityLimiter | None = None) -> FeedRound:
    """One round: fetch prices in a worker thread, publish them. Never raises ProviderError."""
    try:
        quotes = await anyio.to_thread.run_sync(provider.prices, pools, limiter=limiter)
    except ProviderError as e:
        log.warning("price_feed_failed", cloud=provider.cloud, error=str(e), reason=e.reason, retryable=e.retryable)
        return FeedRound(provider.cloud, error=f"{type(e).__name__}: {e}")
    except Exception as e:  # a provider bug must not take the daemon's task group down
        log.exception("price_feed_crashed", cloud=provider.cloud)
        return FeedRound(provider.cloud, error=f"{type(e).__name__}: {e}")
    published, duplicates, failed = await publish_quotes(js, quotes)
    r = FeedRound(provider.cloud, len(quotes), published, duplicates, failed)
    log.debug("price_feed_round", cloud=provider.cloud, quotes=r.quotes, published=published,
             duplicates=duplicates, failed=failed)
    return r


async def run_price_feed(
    js: Any,
    provider: CloudProvider,
    *,
    interval_s: float,
    pools: Sequence[PoolKey] | None = None,
    limiter: anyio.CapacityLimiter | None = None,
    on_round: Callable[[FeedRound], Any] | None = None,
    summary_s: float = SUMMARY_S,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run rounds every ``interval_s`` (from the start of one round to the next) until cancelled; a
    summary at info every ``summary_s``."""
    first = True
    summary = _Summary(provider.cloud, anyio.current_time())
    while True:
        started = anyio.current_time()
        r = await feed_once(js, provider, pools=pools, limiter=limiter)
        summary.add(r)
        if started - summary.since >= summary_s:
            summary = summary.log_and_restart(started)
        if on_round is not None:
            on_round(r)
        if first:
            first = False
            task_status.started()
        await anyio.sleep(max(0.0, interval_s - (anyio.current_time() - started)))


@dataclass(slots=True)
class _Summary:
    """What a feed did since its last ``price_feed_summary`` line."""

    cloud: str
    since: float
    rounds: int = 0
    quotes: int = 0
    published: int = 0
    duplicates: int = 0
    failed: int = 0
    failed_rounds: int = 0

    def add(self, r: FeedRound) -> None:
        self.rounds += 1
        self.quotes += r.quotes
        self.published += r.published
        self.duplicates += r.duplicates
        self.failed += r.failed
        self.failed_rounds += r.error is not None

    def log_and_restart(self, now: float) -> _Summary:
        log.info("price_feed_summary", cloud=self.cloud, period_s=round(now - self.since, 1), rounds=self.rounds,
                 quotes=self.quotes, published=self.published, duplicates=self.duplicates, failed=self.failed,
                 failed_rounds=self.failed_rounds)
        return _Summary(self.cloud, now)
