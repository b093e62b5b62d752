"""Outbox: JetStream events that must reach orchd, buffered across NATS outages.

Role: the agent keeps training while NATS is down; what matters (notices, generation started,
checkpoint committed, ranks exited, leaving) waits here and is published in order once the server is
back, each with its ``Nats-Msg-Id`` so a publish that timed out but was stored anyway is deduplicated
by the stream (FACTS: a timed-out ``js.publish`` may still be stored after reconnect).

Concurrency contract: ``put`` is synchronous and never blocks (callable from any coroutine in the
agent's loop); one ``run`` task publishes, strictly one message at a time, retrying the head of the
queue with capped backoff until it is acknowledged. Urgent messages (notices) jump the queue.
Bounded: past ``max_items`` the oldest non-urgent message is dropped and counted.

``NodePublisher`` is what the agent's parts publish through: a node's events and notices on their
subjects, with their ids as ``Nats-Msg-Id``, into the outbox (set once connected).
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass

import anyio
import anyio.abc
import structlog
from nats.js import JetStreamContext

from wire import NodeEvent, NodeId, PreemptionNotice, encode, subject_node_event, subject_notice

log = structlog.get_logger("agent.outbox")


@dataclass(frozen=True, slots=True)
class Pending:
    subject: str
    payload: bytes
    msg_id: str
    urgent: bool = False


class Outbox:
    def __init__(self, js: JetStreamContext, *, max_items: int = 10_000, publish_timeout_s: float = 2.0,
                 retry_max_s: float = 2.0) -> None:
        self.js = js
        self.max_items = max_items
        self.publish_timeout_s = publish_timeout_s
        self.retry_max_s = retry_max_s
        self._q: collections.deque[Pending] = collections.deque()
        self._wake = anyio.Event()
        self._empty = anyio.Event()
        self._empty.set()
        self.published = 0
        self.duplicates = 0
        self.dropped = 0
        self.failures = 0

    def __len__(self) -> int:
        return len(self._q)

    def put(self, subject: str, payload: bytes, msg_id: str, *, urgent: bool = False) -> None:
        item = Pending(subject, payload, msg_id, urgent)
        if urgent:
            self._q.appendleft(item)
        else:
            if len(self._q) >= self.max_items:
                for i, old in enumerate(self._q):
                    if not old.urgent:
                        del self._q[i]
                        self.dropped += 1
                        log.warning("outbox_dropped", msg_id=old.msg_id, subject=old.subject)
                        break
            self._q.append(item)
        self._empty = anyio.Event() if self._empty.is_set() else self._empty
        self._wake.set()

    async def flush(self, timeout_s: float) -> bool:
        """Wait until everything queued so far is acknowledged (or the timeout); True when empty."""
        with anyio.move_on_after(timeout_s):
            await self._empty.wait()
        return not self._q

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        backoff = 0.05
        while True:
            if not self._q:
                self._empty.set()
                self._wake = anyio.Event()
                await self._wake.wait()
                continue
            item = self._q[0]
            try:
                ack = await self.js.publish(item.subject, item.payload, timeout=self.publish_timeout_s,
                                            headers={"Nats-Msg-Id": item.msg_id})
            except anyio.get_cancelled_exc_class():
                raise
            except Exception as e:  # any publish failure: keep the item, retry later
                self.failures += 1
                log.debug("outbox_publish_failed", msg_id=item.msg_id, error=repr(e), pending=len(self._q))
                await anyio.sleep(backoff)
                backoff = min(self.retry_max_s, backoff * 2)
                continue
            backoff = 0.05
            if self._q and self._q[0] is item:
                self._q.popleft()
            else:  # an urgent item was put in front while we published: remove ours where it is
                with contextlib.suppress(ValueError):
                    self._q.remove(item)
            self.published += 1
            if getattr(ack, "duplicate", False):
                self.duplicates += 1


class NodePublisher:
    """One node's JetStream messages, queued in ``outbox`` (None until the agent is connected)."""

    def __init__(self, node_id: NodeId) -> None:
        self.node_id = node_id
        self.outbox: Outbox | None = None

    def _queue(self) -> Outbox:
        if self.outbox is None:
            raise RuntimeError("not connected: no outbox yet")
        return self.outbox

    def event(self, ev: NodeEvent, *, urgent: bool = False) -> None:
        """On ``orch.node.<node>.event``."""
        self._queue().put(subject_node_event(self.node_id), encode(ev), ev.id, urgent=urgent)

    def notice(self, ev: PreemptionNotice) -> None:
        """On ``orch.notice.<cloud>.<node>``, ahead of everything queued."""
        self._queue().put(subject_notice(ev.cloud, self.node_id), encode(ev), ev.id, urgent=True)
