"""Intake of orchd: the buffers that feed the decide loop, filled by NATS subscriptions and the shell.

Role: collect everything the core must see, in arrival order per source, without deciding anything:

    JetStream pull consumers (notices, node events, prices)  -> ``js``   (acked by the loop after persist)
    core-NATS heartbeats (orch.node.*.hb)                      -> ``hb``   (no ack; latest value matters)
    shell inputs: admin intents, executor results, bus state   -> ``shell`` (admin waits on a future)

The decide loop ``take``s everything buffered at once (one batch) and waits on ``wait`` otherwise.
Fetchers stop fetching while ``js`` holds more than ``max_js`` messages (back-pressure: unfetched
messages stay safely in the stream). Heartbeats beyond ``max_hb`` buffered are dropped and counted.

Concurrency contract: everything runs on the daemon's event loop; producers call ``put_*`` (never
block), the single consumer is the decide loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

import wire as ev
from orchestrator.core.inputs import CoreEvent
from orchestrator.core.model import CoreConfig
from orchestrator.core.pricing import MAX_DURATION_S
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.ratelimit import SenderLimiter, sender_of

if TYPE_CHECKING:
    from orchestrator.daemon.executor import Result

log = structlog.get_logger("orchd.ingest")


@dataclass
class ShellItem:
    """An input from the shell: a core event (optionally answered after persist) or an executor result."""

    event: CoreEvent | Result
    reply: asyncio.Future[None] | None = None


@dataclass
class Batch:
    js: list[tuple[str, Msg]]
    hb: list[Msg]
    shell: list[ShellItem]

    def __len__(self) -> int:
        return len(self.js) + len(self.hb) + len(self.shell)


@dataclass
class Intake:
    metrics: Metrics
    max_js: int = 20_000
    max_hb: int = 200_000
    js: list[tuple[str, Msg]] = field(default_factory=list)
    hb: deque[Msg] = field(default_factory=deque)
    shell: list[ShellItem] = field(default_factory=list)
    _wake: anyio.Event = field(default_factory=anyio.Event)
    _room: anyio.Event = field(default_factory=anyio.Event)
    hb_dropped: int = 0
    limiter: SenderLimiter | None = None  # per-sender rate limit (ratelimit.py); None = none
    rate_limited: int = 0

    def _over_limit(self, subject: str) -> bool:
        """The sender of ``subject`` is over its rate: count the refusal (the caller drops the message)."""
        if self.limiter is None or self.limiter.allow(subject, time.monotonic()):
            return False
        self.rate_limited += 1
        sender = sender_of(subject)
        kind = {"hb": "heartbeat", "event": "node_event"}.get(sender[0], sender[0]) if sender else "other"
        self.metrics.rejected.labels(kind, "rate_limited").inc()
        if self.rate_limited & (self.rate_limited - 1) == 0:  # 1st, 2nd, 4th, 8th...: a log that cannot flood
            log.warning("sender_rate_limited", subject=subject, refused_total=self.rate_limited)
        return True

    def put_shell(self, item: ShellItem) -> None:
        self.shell.append(item)
        self._wake.set()

    async def on_heartbeat(self, msg: Msg) -> None:
        if self._over_limit(msg.subject):
            return
        if len(self.hb) >= self.max_hb:
            self.hb_dropped += 1
            self.metrics.rejected.labels("heartbeat", "overload").inc()
            return
        self.hb.append(msg)
        self._wake.set()

    def pending(self) -> int:
        return len(self.js) + len(self.hb) + len(self.shell)

    async def wait(self) -> None:
        if self.pending():
            return
        await self._wake.wait()

    def take_urgent(self) -> Batch:
        """What is buffered except heartbeats (JetStream messages and shell inputs, in arrival order): what
        the decide loop handles before its next bulk stage."""
        batch = Batch(self.js, [], self.shell)
        self.js, self.shell = [], []
        self._room.set()
        return batch

    def take(self, max_hb: int | None = None) -> Batch:
        """Everything buffered, but at most ``max_hb`` heartbeats: a bounded batch keeps a notice that
        arrives behind a heartbeat backlog from waiting for the whole backlog to be decided."""
        if max_hb is None or len(self.hb) <= max_hb:
            hb, self.hb = list(self.hb), deque()
        else:  # O(max_hb), whatever the backlog (a list slice would copy the whole backlog each time)
            popleft = self.hb.popleft
            hb = [popleft() for _ in range(max_hb)]
        batch = Batch(self.js, hb, self.shell)
        self.js, self.shell = [], []
        self._wake = anyio.Event()
        if self.hb:
            self._wake.set()
        self._room.set()
        return batch

    async def pull_forever(self, nc: Client, stream: str, consumer: str, kind: str, batch: int = 1000,
                           expires_s: float = 5.0) -> None:
        """Pull from one durable consumer until cancelled; survives server restarts and outages.

        One outstanding pull request at a time on our own inbox (nats-py's ``fetch`` waits for a full
        batch or its timeout once the first message arrived, which would add up to ``timeout`` of
        latency to a lone notice): messages go to the buffer as they arrive; a new request is issued
        when the previous one is fulfilled, expired (408), or found nothing."""
        inbox = nc.new_inbox()
        state = _PullRequest()

        async def on_msg(msg: Msg) -> None:
            status = msg.headers.get("Status") if msg.headers else None
            if status and not msg.data:
                if status != "100":  # 100 = idle heartbeat / flow control; others end the request
                    state.done.set()
                return
            state.delivered += 1
            if state.delivered >= batch:
                state.done.set()
            if self._over_limit(msg.subject):  # refused before it is buffered: never decided, never redelivered
                with contextlib.suppress(Exception):
                    await msg.term()
                return
            self.js.append((kind, msg))
            self._wake.set()

        sub = await nc.subscribe(inbox, cb=on_msg, pending_msgs_limit=10 * batch + 1000)
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        request = json.dumps({"batch": batch, "expires": int(expires_s * 1e9)}).encode()
        try:
            while True:
                if len(self.js) >= self.max_js:
                    self._room = anyio.Event()
                    await self._room.wait()
                    continue
                state.delivered = 0
                state.done = anyio.Event()
                try:
                    await nc.publish(subject, request, reply=inbox)
                except Exception as e:  # disconnected: wait for the reconnect
                    log.debug("pull_request_failed", consumer=consumer, error=type(e).__name__)
                    await anyio.sleep(0.25)
                    continue
                with anyio.move_on_after(expires_s + 1.0):  # a lost request (server restart) is re-issued
                    await state.done.wait()
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await sub.unsubscribe()


@dataclass(slots=True)
class _PullRequest:
    """The outstanding pull request of ``pull_forever``: messages delivered for it, and whether it ended."""

    delivered: int = 0
    done: anyio.Event = field(default_factory=anyio.Event)


# --- screening: what a schema cannot say -----------------------------------------------------------

_NODE_EVENT_INTS = ("generation", "first_step", "step", "last_step")
# Bounds before arithmetic (no honest publisher exceeds them; the core re-checks prices against its own
# config, these are the CoreConfig defaults): steps and generations fit a float exactly, durations a week
# (MAX_DURATION_S, the cap the core reads them with).
_PRICE_BOUNDS = CoreConfig()
MAX_PRICE_USD_H = _PRICE_BOUNDS.price_ceiling_usd_h()
MAX_SPOT_OVER_ON_DEMAND = _PRICE_BOUNDS.spot_band()
MIN_PRICE_USD_H = 1e-4  # a price is 0 (free) or at least this: no honest feed quotes 5e-324 $/h
MAX_GPUS_PER_NODE = 64
MAX_STEP = 2**53
MAX_GENERATION = 2**31
MAX_SEQ = 2**62


def _finite(x: float | None, *, lo: float | None = 0.0, hi: float | None = None, optional: bool = False) -> bool:
    if x is None:
        return optional
    if x != x or x in (float("inf"), float("-inf")):
        return False
    return (lo is None or x >= lo) and (hi is None or x <= hi)


def screen(subject: str, msg: ev.PriceTick | ev.PreemptionNotice | ev.NodeEvent) -> str | None:
    """A rejection reason for a decoded JetStream message, or None when it may reach the core.

    Decoding checks the shape; this checks what the shape cannot: the subject names the publisher
    (``orch.node.<node>.event`` / ``orch.notice.<cloud>.<node>`` may only carry that node's events -
    per-node NATS permissions mean nothing otherwise; ``orch.price.<cloud>.<region>`` only that
    cloud/region's pools) -> ``subject_mismatch``; numbers that no honest publisher sends (negative or
    non-finite prices, times, steps, generations; prices above ``MAX_PRICE_USD_H``, spot above
    ``MAX_SPOT_OVER_ON_DEMAND`` x the tick's on-demand price; steps above ``MAX_STEP``, generations above
    ``MAX_GENERATION``, save times beyond ``MAX_DURATION_S``; capacity hints outside 0..1;
    gpus_per_node outside 1..64, a non-zero price below ``MIN_PRICE_USD_H``) and empty ids -> ``bad_value``.
    A notice is never refused for its timestamps.
    Pure and cheap: called once per message by the decide pipeline
    (``pipeline.screen_js``)."""
    parts = subject.split(".")
    if isinstance(msg, ev.PriceTick):
        p = msg.pool
        if len(parts) != 4 or parts[2] != p.cloud or parts[3] != p.region:
            return "subject_mismatch"
        if not (msg.id and p.zone and p.instance_type and msg.gpu_type):
            return "bad_value"
        if not 1 <= msg.gpus_per_node <= MAX_GPUS_PER_NODE:
            return "bad_value"
        if 0 < msg.price_usd_h < MIN_PRICE_USD_H or 0 < (msg.on_demand_usd_h or 0) < MIN_PRICE_USD_H:
            return "bad_value"
        if not (_finite(msg.price_usd_h, hi=MAX_PRICE_USD_H)
                and _finite(msg.on_demand_usd_h, hi=MAX_PRICE_USD_H, optional=True)
                and _finite(msg.capacity_hint, hi=1.0, optional=True) and _finite(msg.ts)):
            return "bad_value"
        od = msg.on_demand_usd_h
        if p.market == ev.Market.SPOT and od and msg.price_usd_h > MAX_SPOT_OVER_ON_DEMAND * od:
            return "bad_value"
        return None
    if isinstance(msg, ev.PreemptionNotice):
        # never refused for its timestamps: a host with a wrong clock must still get its checkpoint (the
        # core clamps the deadline into its node's notice window)
        if len(parts) != 4 or parts[2] != msg.cloud or parts[3] != msg.node_id:
            return "subject_mismatch"
        return None if msg.id else "bad_value"
    # node events: orch.node.<node>.event
    if len(parts) != 4 or parts[1] != "node" or parts[2] != msg.node_id:
        return "subject_mismatch"
    if not msg.id or not _finite(msg.ts):
        return "bad_value"
    for name in _NODE_EVENT_INTS:
        if not 0 <= getattr(msg, name, 0) <= MAX_STEP:
            return "bad_value"
    if getattr(msg, "generation", 0) > MAX_GENERATION:
        return "bad_value"
    if isinstance(msg, ev.CheckpointCommitted) and not (
            _finite(msg.save_s, hi=MAX_DURATION_S)
            and _finite(msg.deadline_margin_s, lo=-MAX_DURATION_S, hi=MAX_DURATION_S, optional=True)):
        return "bad_value"
    return None


def screen_heartbeat(subject: str, hb: ev.Heartbeat) -> str | None:
    """``screen`` for a heartbeat (the hot path: two comparisons): its subject must name its node."""
    if subject[10:-3] != hb.node_id:  # "orch.node." + node + ".hb"
        return "subject_mismatch"
    if not (0 <= hb.seq <= MAX_SEQ and 0 <= hb.step <= MAX_STEP and 0 <= hb.generation <= MAX_GENERATION):
        return "bad_value"
    st = hb.step_time_s
    if st is not None and not 0.0 <= st <= MAX_DURATION_S:  # nan fails both comparisons
        return "bad_value"
    return None
