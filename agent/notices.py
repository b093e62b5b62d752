"""The notice relay: a preemption notice from the cloud's metadata -> NATS, the ranks and the cloud.

Role: each ``Notice`` the watcher reports is published at once as a ``PreemptionNotice`` on
``orch.notice.<cloud>.<node>`` (ahead of everything in the outbox). A terminate notice is, unless
``checkpoint_on_notice`` is off, relayed to the running ranks as an emergency checkpoint with the cloud's
deadline: the checkpoint does not depend on NATS being up, and orchd's own checkpoint command for the
same generation then finds the request already placed. The watcher's acknowledgement hook (Azure:
approve the Preempt event so the VM may go) is called after the emergency checkpoint committed or the
ranks exited (``release``), and at once when no ranks run; on the other clouds the hook does nothing.

Concurrency contract: ``on_notice`` is awaited by the watcher task and does quick work only; the
acknowledgements run as tasks of the agent's task group (``attach``).
"""

from __future__ import annotations

import time

import anyio.abc
import structlog

from agent.generations import GenerationRunner
from agent.outbox import NodePublisher
from agent.watchers import Notice, Watcher
from trainer import contract
from wire import NoticeKind, PreemptionNotice

log = structlog.get_logger("agent")


class NoticeRelay:
    def __init__(self, publisher: NodePublisher, generations: GenerationRunner, watcher: Watcher | None, *,
                 cloud_name: str, checkpoint_on_notice: bool = True) -> None:
        self.publisher = publisher
        self.generations = generations
        self.watcher = watcher
        self.cloud_name = cloud_name
        self.checkpoint_on_notice = checkpoint_on_notice
        self.notices: list[Notice] = []
        self._unacked: list[Notice] = []
        self._tg: anyio.abc.TaskGroup | None = None

    def attach(self, tg: anyio.abc.TaskGroup) -> None:
        self._tg = tg

    async def on_notice(self, notice: Notice) -> None:
        self.notices.append(notice)
        node = self.publisher.node_id
        self.publisher.notice(PreemptionNotice(
            id=f"notice-{node}-{notice.ref}", node_id=node, cloud=self.cloud_name, kind=notice.kind,
            deadline_ts=notice.deadline_ts, observed_ts=notice.observed_ts, source="metadata"))
        log.info("spot_notice_received", kind=str(notice.kind), cloud=notice.cloud,
                 deadline_s=None if notice.deadline_ts is None else round(notice.deadline_ts - time.time(), 1))
        if notice.kind is not NoticeKind.TERMINATE:
            return
        running = self.generations.running is not None
        if running and self.checkpoint_on_notice:
            self.generations.emergency_checkpoint(contract.CheckpointRequest(
                request_id=f"notice-{notice.ref}", reason="preemption_notice", deadline_ts=notice.deadline_ts,
                issued_ts=notice.observed_ts))
        if running:
            self._unacked.append(notice)  # acknowledged once the checkpoint committed (``release``)
        else:
            await self._acknowledge(notice)

    def release(self) -> None:
        """The emergency checkpoint committed or the ranks exited: acknowledge what was held back."""
        pending, self._unacked = self._unacked, []
        if self._tg is not None:
            for notice in pending:
                self._tg.start_soon(self._acknowledge, notice)

    async def _acknowledge(self, notice: Notice) -> None:
        if self.watcher is None:
            return
        try:
            await self.watcher.acknowledge(notice)
        except Exception as e:  # any failure: the eviction proceeds at the deadline anyway
            log.warning("notice_ack_failed", cloud=notice.cloud, error=repr(e))
