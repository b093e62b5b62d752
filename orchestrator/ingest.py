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
import json
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog
from nats.aio.msg import Msg

from orchestrator.metrics import Metrics

log = structlog.get_logger("orchd.ingest")


@dataclass
class ShellItem:
    """An input from the shell: a core event (optionally answered after persist) or an executor result."""

    event: Any
    reply: asyncio.Future | None = None


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
    hb: list[Msg] = field(default_factory=list)
    shell: list[ShellItem] = field(default_factory=list)
    _wake: anyio.Event = field(default_factory=anyio.Event)
    _room: anyio.Event = field(default_factory=anyio.Event)
    hb_dropped: int = 0

    def put_shell(self, item: ShellItem) -> None:
        self.shell.append(item)
        self._wake.set()

    async def on_heartbeat(self, msg: Msg) -> None:
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

    def take(self, max_hb: int | None = None) -> Batch:
        """Everything buffered, but at most ``max_hb`` heartbeats: a bounded batch keeps a notice that
        arrives behind a heartbeat backlog from waiting for the whole backlog to be decided."""
        if max_hb is None or len(self.hb) <= max_hb:
            hb, self.hb = self.hb, []
        else:
            hb, self.hb = self.hb[:max_hb], self.hb[max_hb:]
        batch = Batch(self.js, hb, self.shell)
        self.js, self.shell = [], []
        self._wake = anyio.Event()
        if self.hb:
            self._wake.set()
        self._room.set()
        return batch

    async def pull_forever(self, nc: Any, stream: str, consumer: str, kind: str, batch: int = 1000,
                           expires_s: float = 5.0) -> None:
        """Pull from one durable consumer until cancelled; survives server restarts and outages.

        One outstanding pull request at a time on our own inbox (nats-py's ``fetch`` waits for a full
        batch or its timeout once the first message arrived, which would add up to ``timeout`` of
        latency to a lone notice): messages go to the buffer as they arrive; a new request is issued
        when the previous one is fulfilled, expired (408), or found nothing."""
        inbox = nc.new_inbox()
        state = {"delivered": 0, "done": anyio.Event()}

        async def on_msg(msg: Msg) -> None:
            status = msg.headers.get("Status") if msg.headers else None
            if status and not msg.data:
                if status != "100":  # 100 = idle heartbeat / flow control; others end the request
                    state["done"].set()
                return
            self.js.append((kind, msg))
            self._wake.set()
            state["delivered"] += 1
            if state["delivered"] >= batch:
                state["done"].set()

        sub = await nc.subscribe(inbox, cb=on_msg, pending_msgs_limit=10 * batch + 1000)
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        request = json.dumps({"batch": batch, "expires": int(expires_s * 1e9)}).encode()
        try:
            while True:
                if len(self.js) >= self.max_js:
                    self._room = anyio.Event()
                    await self._room.wait()
                    continue
                state["delivered"] = 0
                state["done"] = anyio.Event()
                try:
                    await nc.publish(subject, request, reply=inbox)
                except Exception as e:  # disconnected: wait for the reconnect
                    log.debug("pull_request_failed", consumer=consumer, error=type(e).__name__)
                    await anyio.sleep(0.25)
                    continue
                with anyio.move_on_after(expires_s + 1.0):  # a lost request (server restart) is re-issued
                    await state["done"].wait()
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await sub.unsubscribe()
                except Exception:
                    pass
