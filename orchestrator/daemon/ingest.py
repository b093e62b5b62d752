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

import contextlib
import json
import time
from collections import deque
from dataclasses import dataclass, field

import anyio
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.ratelimit import SenderLimiter, sender_of
from orchestrator.daemon.records import Batch, Result, ShellItem

log = structlog.get_logger("orchd.ingest")


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

    def put_result(self, result: Result) -> None:
        """The channel the executor reports a finished command's result on (decided with the next batch)."""
        self.put_shell(ShellItem(result))

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

    def take_urgent(self) -> Batch | None:
        """What is buffered except heartbeats (JetStream messages and shell inputs, in arrival order): what
        the decide loop handles before its next bulk stage; None when nothing is."""
        if not (self.js or self.shell):
            return None
        batch = Batch(self.js, [], self.shell)
        self.js, self.shell = [], []
        self._room.set()
        return batch

    def take_split(self, max_hb: int | None = None) -> tuple[Batch | None, Batch | None]:
        """``take``, split in (urgent part, heartbeat part), each None when empty: notices, node events,
        executor results and admin intents are decided, persisted and dispatched before the heartbeats taken
        with them (the decide loop also takes the urgent inputs that arrive meanwhile before each bulk stage:
        ``take_urgent``)."""
        batch = self.take(max_hb)
        urgent = Batch(batch.js, [], batch.shell) if batch.js or batch.shell else None
        return urgent, (Batch([], batch.hb, []) if batch.hb else None)

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
