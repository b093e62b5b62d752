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
from dataclasses import dataclass, field
from typing import Any

import anyio
import nats.errors
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

    def take(self) -> Batch:
        batch = Batch(self.js, self.hb, self.shell)
        self.js, self.hb, self.shell = [], [], []
        self._wake = anyio.Event()
        self._room.set()
        return batch

    async def fetch_forever(self, kind: str, psub: Any, batch: int = 2000) -> None:
        """Pull from one durable consumer until cancelled; survives server restarts and outages."""
        while True:
            if len(self.js) >= self.max_js:
                self._room = anyio.Event()
                await self._room.wait()
                continue
            try:
                msgs = await psub.fetch(batch=batch, timeout=1.0)
            except nats.errors.TimeoutError:
                continue
            except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError,
                    nats.errors.ConnectionDrainingError, nats.errors.NoRespondersError, OSError) as e:
                log.debug("fetch_unavailable", consumer=kind, error=type(e).__name__)
                await anyio.sleep(0.25)
                continue
            except Exception as e:  # JetStream API errors during a restart: keep trying
                log.warning("fetch_failed", consumer=kind, error=repr(e))
                await anyio.sleep(0.5)
                continue
            if msgs:
                self.js.extend((kind, m) for m in msgs)
                self._wake.set()
