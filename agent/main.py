"""``orch-agent``: the node agent. Registers, heartbeats, watches for preemption notices, runs the
trainer ranks of the generation orchd assigns, relays checkpoint requests and reports commits.

Role (see docs/agent.md):

- NATS: heartbeats on ``orch.node.<node>.hb`` (core NATS, every ``heartbeat_s``); events
  (registered, generation started, checkpoint committed, ranks exited, leaving) on
  ``orch.node.<node>.event`` and notices on ``orch.notice.<cloud>.<node>`` through the Outbox
  (JetStream, ``Nats-Msg-Id`` = the event id, buffered and retried across outages); commands on
  ``orch.cmd.<node>`` (request/reply, a ``CommandAck`` back). Rank logs on ``orch.logs.<job>.<node>``.
- Commands are idempotent: an already seen ``cmd_id`` gets the same ack again; a command whose
  ``fencing_token`` is lower than the highest seen is refused with ``stale_fencing_token``.
- A terminate notice is published at once and, unless disabled, relayed to the ranks as an
  emergency checkpoint right away (orchd's own checkpoint command for the same generation then finds
  the request already placed): the checkpoint does not depend on NATS being up. Azure's Preempt event
  is acknowledged after the emergency checkpoint committed.
- SIGTERM/SIGINT: checkpoint (deadline now + ``sigterm_grace_s``), wait for the ranks, publish
  ``NodeLeaving`` (not after the job completed here: orchd has released the node), flush, exit 0.

``Agent`` only wires the parts, each a module of its own: ``connection`` (NATS, enrolment),
``watchers`` (metadata -> notices), ``notices`` (the notice relay), ``commands`` (dedup, fencing),
``generations`` (ranks, reports, the node's state), ``heartbeat``, ``outbox`` and ``logship``; it runs the
lifecycle (connect, register, serve, leave).

Concurrency contract: one asyncio event loop driven by anyio; every task lives in the agent's task
group. NATS callbacks (commands) run in nats-py's subscription task and only do quick work (spawn,
signal, enqueue); long waits are separate tasks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.abc
import nats
import structlog
from nats.aio.subscription import Subscription

from agent.commands import CommandHandler
from agent.config import AgentConfig, ConfigError, load_config
from agent.connection import close_quietly, connect
from agent.generations import GenerationRunner
from agent.heartbeat import Heartbeats
from agent.logship import LogShipper, creates_logs_stream, ensure_logs_stream
from agent.notices import NoticeRelay
from agent.outbox import NodePublisher, Outbox
from agent.ranks import RankGroup
from agent.warm import WarmPool
from agent.watchers import Notice, make_watcher
from wire import AgentState, Heartbeat, InstanceId, NodeId, NodeLeaving, NodeRegistered, sdnotify, subject_command

__all__ = ["AGENT_VERSION", "Agent", "AgentConfig", "main"]

log = structlog.get_logger("agent")
AGENT_VERSION = "0.1.0"


class Agent:
    """Wires the agent's parts (see the module docstring) and runs its lifecycle: connect, register,
    serve until asked to leave, leave."""

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.node_id = NodeId(cfg.node_id)
        self.work_dir = Path(cfg.work_dir).resolve()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.boot_id = uuid.uuid4().hex[:12]
        self.cloud_name = cfg.cloud_name or (cfg.metadata if cfg.metadata != "none" else "local")
        self.warm = WarmPool(cfg.warm_ranks, str(self.work_dir)) if cfg.warm_ranks > 0 else None
        self.watcher = make_watcher(cfg.metadata, cfg.metadata_endpoint, poll_s=cfg.metadata_poll_s,
                                    notice_s=cfg.gcp_notice_s)
        self.publisher = NodePublisher(self.node_id)
        self.generations = GenerationRunner(cfg, self.work_dir, self.publisher, warm=self.warm,
                                            on_emergency_end=lambda: self.relay.release())
        self.relay = NoticeRelay(self.publisher, self.generations, self.watcher, cloud_name=self.cloud_name,
                                 checkpoint_on_notice=cfg.checkpoint_on_notice)
        self.commands = CommandHandler(self.node_id, self.generations, self.request_shutdown)
        self.heartbeats = Heartbeats(self.node_id, self.generations, lambda: self.commands.fencing_token)
        self._shutdown = anyio.Event()
        self.shutdown_reason = ""
        self.stopped = anyio.Event()
        self.nc: nats.NATS | None = None
        self.outbox: Outbox | None = None
        self.logs: LogShipper | None = None

    # what tests, status lines and heartbeats read
    @property
    def group(self) -> RankGroup | None:
        return self.generations.group

    @property
    def state(self) -> AgentState:
        return self.generations.state

    @property
    def fencing_token(self) -> int:
        return self.commands.fencing_token

    @property
    def notices(self) -> list[Notice]:
        return self.relay.notices

    def heartbeat(self) -> Heartbeat:
        return self.heartbeats.next()

    # --- lifecycle -------------------------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.nc = nc = await connect(self.cfg, self.work_dir, pending=lambda: len(self.outbox or ()))
        self.outbox = self.publisher.outbox = Outbox(nc.jetstream())
        self.logs = logs = LogShipper(nc, self.node_id, self.work_dir)
        try:
            async with anyio.create_task_group() as tg:
                await self._serve(tg, nc, self.outbox, logs, task_status)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                self.generations.abandon_now()
                if self.warm is not None:
                    await self.warm.close()
                logs.close()
                await close_quietly(nc)  # no traceback when the server is gone already
                self.stopped.set()

    async def _serve(self, tg: anyio.abc.TaskGroup, nc: nats.NATS, outbox: Outbox, logs: LogShipper,
                     task_status: anyio.abc.TaskStatus[None]) -> None:
        """Start every task, register, report ready; return once left (after ``request_shutdown``)."""
        self.generations.attach(tg, logs)
        self.relay.attach(tg)
        await tg.start(outbox.run)
        tg.start_soon(logs.run)
        if creates_logs_stream(self.cfg):  # under a credential the stream is orchd's (no $JS.API rights)
            tg.start_soon(_ensure_logs_stream_quietly, nc)
        if self.warm is not None:
            await self.warm.refill()  # before commands can arrive: the first generation starts warm
        sub = await nc.subscribe(subject_command(self.node_id), cb=self.commands.on_msg)
        with anyio.move_on_after(2):
            await nc.flush()  # the server knows the subscription before orchd hears of us
        self._register()
        tg.start_soon(self.heartbeats.run, nc, self.cfg.heartbeat_s)
        if self.watcher is not None:
            tg.start_soon(self.watcher.run, self.relay.on_notice)
        log.info("agent_started", node_id=self.node_id, metadata=self.cfg.metadata, work_dir=str(self.work_dir))
        sdnotify.notify_ready(f"node {self.node_id}: registered, idle")
        wd = sdnotify.watchdog_interval_s()
        if wd is not None:
            tg.start_soon(self._watchdog, wd)
        task_status.started()
        await self._shutdown.wait()
        await self._leave(sub, outbox, logs)

    async def _watchdog(self, interval_s: float) -> None:
        """WATCHDOG=1 from the event loop (a wedged loop stops the pings), STATUS= with the progress."""
        while True:
            sdnotify.notify_watchdog()
            g = self.group
            sdnotify.notify_status(f"node {self.node_id}: {self.state}" + (
                f", job {g.job_id} generation {g.generation} step {g.last_step}" if g else ""))
            await anyio.sleep(interval_s)

    def request_shutdown(self, reason: str) -> None:
        if not self._shutdown.is_set():
            sdnotify.notify_stopping(f"node {self.node_id}: leaving ({reason})")
            self.shutdown_reason = reason
            self.generations.accepting = False
            self._shutdown.set()

    async def _leave(self, sub: Subscription, outbox: Outbox, logs: LogShipper) -> None:
        """Checkpoint, wait for the ranks (commands are still served meanwhile), say goodbye, flush
        what is buffered."""
        reason = self.shutdown_reason or "sigterm"
        self.generations.state = AgentState.DRAINING
        await self.generations.wind_down(f"leave-{self.boot_id}", reason)
        with contextlib.suppress(Exception):  # any failure: the connection is closed already
            await sub.unsubscribe()
        # After its job completed here, orchd releases the node and forgets it: a goodbye would only reach
        # an orchd that no longer knows the node (and is refused as unknown_node). Otherwise orchd must know.
        announced = not self.generations.job_completed
        if announced:
            self.publisher.event(NodeLeaving(id=f"leave-{self.node_id}-{self.boot_id}", node_id=self.node_id,
                                             reason=reason, ts=time.time()))
        flushed = await outbox.flush(5.0)
        await logs.flush(1.0)
        self.generations.state = AgentState.STOPPED
        log.info("agent_leaving", reason=self.shutdown_reason, outbox_flushed=flushed, announced=announced)

    async def parent_watch(self, parent: int, on_exit: Callable[[], None]) -> None:
        """``--exit-with-parent``: leave once the parent (orchd, for a local node) is gone. Runs from the
        start, before NATS answers: an agent still connecting when its parent died must not wait forever
        (``on_exit`` then ends it, as a signal does)."""
        while os.getppid() == parent:
            await anyio.sleep(1.0)
        log.warning("parent_exited", parent=parent)
        self.request_shutdown("parent_exited")
        on_exit()

    def _register(self) -> None:
        c = self.cfg
        self.publisher.event(NodeRegistered(
            id=f"reg-{self.node_id}-{self.boot_id}", node_id=self.node_id,
            instance_id=InstanceId(c.instance_id) if c.instance_id else None, pool=c.pool,
            agent_version=AGENT_VERSION, host=c.advertise_host or socket.gethostname(), ts=time.time()))


async def _ensure_logs_stream_quietly(nc: nats.NATS) -> None:
    """On an open server only (``creates_logs_stream``): orchd creates the stream too, so any failure
    here is logged and the agent goes on."""
    try:
        await ensure_logs_stream(nc)
    except Exception as e:  # any failure: not ours to fix, the agent goes on
        log.info("logs_stream_not_checked", error=repr(e))


# --- command line -----------------------------------------------------------------------------------


async def _amain(cfg: AgentConfig) -> int:
    agent = Agent(cfg)

    async def signals() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
            async for s in sigs:
                log.info("signal_received", signal=signal.Signals(s).name)
                agent.request_shutdown("sigterm" if s == signal.SIGTERM else "sigint")
                end_if_unconnected()

    def end_if_unconnected() -> None:
        if agent.nc is None:  # still trying to reach NATS: nothing to checkpoint or report
            tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(signals)
        if cfg.exit_with_parent:
            tg.start_soon(agent.parent_watch, os.getppid(), end_if_unconnected)
        await agent.run()
        tg.cancel_scope.cancel()
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(argv)
    except ConfigError as e:
        print(f"orch-agent: {e}", file=sys.stderr)
        return 2
    from wire.logs import configure

    configure(cfg.log_level)
    structlog.contextvars.bind_contextvars(node_id=cfg.node_id)  # one agent per process: safe here
    return anyio.run(_amain, cfg, backend="asyncio")


if __name__ == "__main__":
    sys.exit(main())
