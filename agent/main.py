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
  ``NodeLeaving``, flush, exit 0.

Concurrency contract: one asyncio event loop driven by anyio; every task lives in the agent's task
group. NATS callbacks (commands) run in nats-py's subscription task and only do quick work (spawn,
signal, enqueue); long waits are separate tasks.
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

import anyio
import anyio.abc
import msgspec
import nats
import structlog
from nats.aio.msg import Msg

from agent.config import AgentConfig, ConfigError, load_config
from agent.heartbeat import SystemSampler
from agent.logship import LogShipper, ensure_logs_stream
from agent.outbox import Outbox
from agent.ranks import RankGroup, resume_step
from agent.warm import WarmPool
from agent.watchers import AzureWatcher, Notice, make_watcher
from wire import sdnotify
from wire import (
    AbandonGenerationCmd,
    AgentCommand,
    AgentState,
    CheckpointCmd,
    CheckpointCommitted,
    CommandAck,
    DrainCmd,
    GenerationStarted,
    Heartbeat,
    InstanceId,
    JobId,
    NodeId,
    NodeLeaving,
    NodeRegistered,
    NoticeKind,
    PreemptionNotice,
    RanksExited,
    StartGenerationCmd,
    StopCmd,
    WireError,
    decode,
    encode,
    subject_command,
    subject_heartbeat,
    subject_node_event,
    subject_notice,
)
from trainer import contract

log = structlog.get_logger("agent")
AGENT_VERSION = "0.1.0"


class Agent:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.node_id = NodeId(cfg.node_id)
        self.work_dir = Path(cfg.work_dir).resolve()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.boot_id = uuid.uuid4().hex[:12]
        self.state = AgentState.IDLE
        self.fencing_token = 0
        self._acks: collections.OrderedDict[str, CommandAck] = collections.OrderedDict()
        self.group: RankGroup | None = None
        self.seq = 0
        self.sampler = SystemSampler()
        kw = {"poll_s": cfg.metadata_poll_s} if cfg.metadata in ("aws", "azure") else (
            {"notice_s": cfg.gcp_notice_s} if cfg.metadata == "gcp" else {})
        self.watcher = make_watcher(cfg.metadata, cfg.metadata_endpoint, **kw)
        self.cloud_name = cfg.cloud_name or (cfg.metadata if cfg.metadata != "none" else "local")
        self.notices: list[Notice] = []
        self._azure_unacked: list[Notice] = []
        self._committed: set[tuple[str, int, str]] = set()
        self._shutdown = anyio.Event()
        self.shutdown_reason = ""
        self.stopped = anyio.Event()
        self.nc: nats.NATS | None = None
        self.outbox: Outbox | None = None
        self.logs: LogShipper | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self.warm = WarmPool(cfg.warm_ranks, str(self.work_dir)) if cfg.warm_ranks > 0 else None

    # --- lifecycle -------------------------------------------------------------------------------

    async def _connect(self) -> nats.NATS:
        c = self.cfg

        async def on_error(e: Exception) -> None:
            log.debug("nats_error", error=repr(e))

        async def on_disconnect() -> None:
            log.warning("nats_disconnected")

        async def on_reconnect() -> None:
            log.info("nats_reconnected", pending_events=len(self.outbox) if self.outbox else 0)

        opts: dict = dict(servers=list(c.nats_urls), name=f"orch-agent-{c.node_id}", max_reconnect_attempts=-1,
                          reconnect_time_wait=0.5, connect_timeout=2, ping_interval=10, max_outstanding_pings=2,
                          error_cb=on_error, disconnected_cb=on_disconnect, reconnected_cb=on_reconnect)
        if c.nats_user:
            opts.update(user=c.nats_user, password=c.nats_password)
        if c.nats_token:
            opts["token"] = c.nats_token
        if c.nats_creds_file:
            opts["user_credentials"] = c.nats_creds_file
        if c.nats_tls_ca_file:
            import ssl

            opts["tls"] = ssl.create_default_context(cafile=c.nats_tls_ca_file)
        if c.enrol_token and not (c.nats_user or c.nats_token or c.nats_creds_file):
            user, password = await self._node_credential(opts)
            # agent_permissions (orchestrator/nats_auth.py): replies only on the node's own inbox prefix
            opts.update(user=user, password=password, inbox_prefix=f"_INBOX.{c.node_id}")
        wait = 0.2
        while True:
            try:
                return await nats.connect(**opts)
            except Exception as e:  # noqa: BLE001 - server not up yet: keep trying (a daemon must not give up)
                log.warning("nats_connect_failed", error=repr(e), retry_s=wait)
                await anyio.sleep(wait)
                wait = min(2.0, wait * 2)

    async def _node_credential(self, opts: dict) -> tuple[str, str]:
        """This node's NATS user and password: from ``<work_dir>/nats-credential.json`` when enrolled
        before (an agent restart), else by redeeming the enrolment token (orchestrator/credentials.py):
        connect as ``enrol-<node>`` with the token as password, request ``orch.enrol.<node>``, store the
        answer (0600). Retries until orchd answers; a refusal (expired, reused...) is logged and retried
        slowly - the node stays unregistered and orchd replaces it after the heartbeat timeout."""
        import json

        path = self.work_dir / "nats-credential.json"
        if path.exists():
            stored = json.loads(path.read_text())
            return stored["user"], stored["password"]
        node = self.cfg.node_id
        wait = 0.2
        while True:
            try:
                nc = await nats.connect(servers=opts["servers"], tls=opts.get("tls"), connect_timeout=2,
                                        user=f"enrol-{node}", password=self.cfg.enrol_token,
                                        inbox_prefix=f"_INBOX.{node}.enrol", allow_reconnect=False,
                                        max_reconnect_attempts=0, error_cb=opts["error_cb"],
                                        name=f"orch-agent-enrol-{node}")
                try:
                    reply = json.loads((await nc.request(f"orch.enrol.{node}", self.cfg.enrol_token.encode(),
                                                         timeout=5)).data)
                finally:
                    await nc.close()
            except Exception as e:  # noqa: BLE001 - NATS or orchd not up yet: keep trying
                log.warning("enrol_retry", error=type(e).__name__, retry_s=wait)
                await anyio.sleep(wait)
                wait = min(2.0, wait * 2)
                continue
            if "error" in reply:
                log.error("enrol_refused", reason=reply["error"], retry_s=30)
                await anyio.sleep(30)
                continue
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"user": reply["user"], "password": reply["password"]}, f)
            log.info("enrolled", user=reply["user"])
            return reply["user"], reply["password"]

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.nc = nc = await self._connect()
        self.outbox = Outbox(nc.jetstream())
        self.logs = LogShipper(nc, self.node_id, self.work_dir)
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                await tg.start(self.outbox.run)
                tg.start_soon(self.logs.run)
                tg.start_soon(_ensure_logs_stream_quietly, nc)
                if self.warm is not None:
                    await self.warm.refill()  # before commands can arrive: the first generation starts warm
                sub = await nc.subscribe(subject_command(self.node_id), cb=self._on_command_msg)
                with anyio.move_on_after(2):
                    await nc.flush()  # the server knows the subscription before orchd hears of us
                self._register()
                tg.start_soon(self._heartbeat_loop)
                if self.watcher is not None:
                    tg.start_soon(self.watcher.run, self._on_notice)
                if self.cfg.exit_with_parent:
                    tg.start_soon(self._parent_watch, os.getppid())
                log.info("agent_started", node_id=self.node_id, metadata=self.cfg.metadata, work_dir=str(self.work_dir))
                sdnotify.notify_ready(f"node {self.node_id}: registered, idle")
                wd = sdnotify.watchdog_interval_s()
                if wd is not None:
                    tg.start_soon(self._watchdog, wd)
                task_status.started()
                await self._shutdown.wait()
                await self._leave(sub)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                if self.group is not None and self.group.running:
                    self.group.abandon()
                if self.warm is not None:
                    await self.warm.close()
                self.logs.close()
                with anyio.move_on_after(2):
                    await nc.close()
                self.stopped.set()

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
            self._shutdown.set()

    async def _leave(self, sub: object) -> None:
        """Checkpoint, wait for the ranks, say goodbye, flush what is buffered."""
        self.state = AgentState.DRAINING
        g = self.group
        if g is not None and g.running:
            now = time.time()
            deadline = now + self.cfg.sigterm_grace_s
            g.request_checkpoint(contract.CheckpointRequest(request_id=f"leave-{self.boot_id}",
                                                            reason=self.shutdown_reason or "sigterm",
                                                            deadline_ts=deadline, issued_ts=now))
            with anyio.move_on_after(self.cfg.sigterm_grace_s + 5):
                await g.done.wait()
            if g.running:
                g.abandon()
                with anyio.move_on_after(5):
                    await g.done.wait()
        try:
            await sub.unsubscribe()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - connection already closed
            pass
        self._publish_event(NodeLeaving(id=f"leave-{self.node_id}-{self.boot_id}", node_id=self.node_id,
                                        reason=self.shutdown_reason or "sigterm", ts=time.time()))
        assert self.outbox is not None and self.logs is not None
        flushed = await self.outbox.flush(5.0)
        await self.logs.flush(1.0)
        self.state = AgentState.STOPPED
        log.info("agent_leaving", reason=self.shutdown_reason, outbox_flushed=flushed)

    async def _parent_watch(self, parent: int) -> None:
        while os.getppid() == parent:
            await anyio.sleep(1.0)
        log.warning("parent_exited", parent=parent)
        self.request_shutdown("parent_exited")

    # --- publishing ------------------------------------------------------------------------------

    def _publish_event(self, ev: msgspec.Struct, *, urgent: bool = False) -> None:
        assert self.outbox is not None
        self.outbox.put(subject_node_event(self.node_id), encode(ev), ev.id, urgent=urgent)  # type: ignore[attr-defined]

    def _register(self) -> None:
        self._publish_event(NodeRegistered(
            id=f"reg-{self.node_id}-{self.boot_id}", node_id=self.node_id,
            instance_id=InstanceId(self.cfg.instance_id) if self.cfg.instance_id else None,
            pool=self.cfg.pool, agent_version=AGENT_VERSION, host=self.cfg.advertise_host or socket.gethostname(), ts=time.time()))

    def heartbeat(self) -> Heartbeat:
        self.seq += 1
        g = self.group
        cpu, mem = self.sampler.cpu_mem()
        return Heartbeat(
            node_id=self.node_id, seq=self.seq, ts=time.time(), state=self.state,
            job_id=JobId(g.job_id) if g else None, generation=g.generation if g else 0,
            step=g.last_step if g else 0, loss=g.last_loss if g else None,
            tokens_per_s=g.tokens_per_s if g else None, step_time_s=g.step_time_s if g else None,
            cpu_pct=cpu, mem_pct=mem, gpus=self.sampler.gpus(), fencing_token=self.fencing_token)

    async def _heartbeat_loop(self) -> None:
        assert self.nc is not None
        while True:
            if self.nc.is_connected:  # latest value matters, not history: nothing is buffered
                try:
                    await self.nc.publish(subject_heartbeat(self.node_id), encode(self.heartbeat()))
                except Exception as e:  # noqa: BLE001
                    log.debug("heartbeat_failed", error=repr(e))
            await anyio.sleep(self.cfg.heartbeat_s)

    # --- notices ---------------------------------------------------------------------------------

    async def _on_notice(self, notice: Notice) -> None:
        self.notices.append(notice)
        ev = PreemptionNotice(id=f"notice-{self.node_id}-{notice.ref}", node_id=self.node_id, cloud=self.cloud_name,
                              kind=notice.kind, deadline_ts=notice.deadline_ts, observed_ts=notice.observed_ts,
                              source="metadata")
        assert self.outbox is not None
        self.outbox.put(subject_notice(self.cloud_name, self.node_id), encode(ev), ev.id, urgent=True)
        log.info("spot_notice_received", kind=str(notice.kind), cloud=notice.cloud,
                 deadline_s=None if notice.deadline_ts is None else round(notice.deadline_ts - time.time(), 1))
        if notice.kind is not NoticeKind.TERMINATE:
            return
        g = self.group
        running = g is not None and g.running
        if running and self.cfg.checkpoint_on_notice and not g.checkpoint_requested:  # type: ignore[union-attr]
            self.state = AgentState.CHECKPOINTING
            g.request_checkpoint(contract.CheckpointRequest(  # type: ignore[union-attr]
                request_id=f"notice-{notice.ref}", reason="preemption_notice", deadline_ts=notice.deadline_ts,
                issued_ts=notice.observed_ts))
        if isinstance(self.watcher, AzureWatcher):
            if running:
                self._azure_unacked.append(notice)
            else:
                await self._ack_azure(notice)

    async def _ack_azure(self, notice: Notice) -> None:
        assert isinstance(self.watcher, AzureWatcher)
        try:
            await self.watcher.acknowledge(notice)
        except Exception as e:  # noqa: BLE001 - the eviction proceeds at NotBefore anyway
            log.warning("azure_ack_failed", error=repr(e))

    def _ack_pending_azure(self) -> None:
        pending, self._azure_unacked = self._azure_unacked, []
        if self._tg is not None:
            for n in pending:
                self._tg.start_soon(self._ack_azure, n)

    # --- commands --------------------------------------------------------------------------------

    async def _on_command_msg(self, msg: Msg) -> None:
        ack = await self.handle_command(msg.data)
        if msg.reply:
            try:
                await msg.respond(encode(ack))
            except Exception as e:  # noqa: BLE001 - orchd retries with the same cmd_id
                log.warning("command_reply_failed", cmd_id=ack.cmd_id, error=repr(e))

    def _ack(self, cmd_id: str, error: str | None) -> CommandAck:
        return CommandAck(cmd_id=cmd_id, node_id=self.node_id, ok=error is None, error=error, ts=time.time())

    async def handle_command(self, data: bytes) -> CommandAck:
        try:
            cmd = decode(data, AgentCommand)
        except WireError as e:
            log.warning("command_rejected", reason=e.reason)
            return self._ack("", f"bad_command:{e.reason}")
        if cmd.node_id != self.node_id:
            return self._ack(cmd.cmd_id, "wrong_node")
        cached = self._acks.get(cmd.cmd_id)
        if cached is not None:  # a retry of a command already executed: same answer, no second effect
            return cached
        if cmd.fencing_token < self.fencing_token:
            log.warning("command_stale_fencing_token", cmd_id=cmd.cmd_id, token=cmd.fencing_token, highest=self.fencing_token)
            return self._ack(cmd.cmd_id, "stale_fencing_token")
        self.fencing_token = cmd.fencing_token
        try:
            error = await self._execute(cmd)
        except Exception as e:  # noqa: BLE001 - reported to orchd in the ack, not a crash of the agent
            log.exception("command_failed", cmd_id=cmd.cmd_id)
            error = f"internal:{type(e).__name__}"
        ack = self._ack(cmd.cmd_id, error)
        self._acks[cmd.cmd_id] = ack
        while len(self._acks) > 1000:
            self._acks.popitem(last=False)
        log.info("command_handled", kind=type(cmd).__name__, cmd_id=cmd.cmd_id, generation=cmd.generation, ok=ack.ok,
                 error=error)
        return ack

    def _matches(self, cmd: AgentCommand) -> bool:
        g = self.group
        if g is None:
            return False
        return (not cmd.job_id or cmd.job_id == g.job_id) and (not cmd.generation or cmd.generation == g.generation)

    async def _execute(self, cmd: AgentCommand) -> str | None:
        match cmd:
            case StartGenerationCmd():
                return await self._start_generation(cmd)
            case CheckpointCmd():
                g = self.group
                if g is None or not self._matches(cmd):
                    return "unknown_generation"
                if g.running and not g.checkpoint_requested:
                    self.state = AgentState.CHECKPOINTING
                    g.request_checkpoint(contract.CheckpointRequest(request_id=cmd.cmd_id, reason=cmd.reason,
                                                                    deadline_ts=cmd.deadline_ts, issued_ts=cmd.issued_ts))
                return None
            case StopCmd():
                g = self.group
                if g is not None and g.running:
                    if cmd.checkpoint_first:
                        g.stopped = True
                        now = time.time()
                        g.request_checkpoint(contract.CheckpointRequest(
                            request_id=cmd.cmd_id, reason=cmd.reason, issued_ts=now,
                            deadline_ts=now + self.cfg.sigterm_grace_s))
                    else:
                        g.stop(checkpoint_first=False)
                return None
            case AbandonGenerationCmd():
                g = self.group
                if g is not None and g.running:
                    if not self._matches(cmd):
                        return "unknown_generation"
                    g.abandon()
                return None
            case DrainCmd():
                self.request_shutdown(f"drain:{cmd.reason}")
                return None
        return "unknown_command"

    async def _start_generation(self, cmd: StartGenerationCmd) -> str | None:
        if self._shutdown.is_set():
            return "draining"
        old = self.group
        if old is not None and old.job_id == (cmd.job_id or "job") and old.generation == cmd.generation:
            return None  # already started (a retry with a new cmd_id)
        if old is not None and old.running:
            if old.job_id == (cmd.job_id or "job") and old.generation > cmd.generation:
                return "stale_generation"
            log.warning("abandoning_previous_generation", generation=old.generation, new=cmd.generation)
            old.abandon()
            with anyio.move_on_after(10):
                await old.done.wait()
        assert self._tg is not None and self.logs is not None
        job = cmd.job_id or "job"
        shipper = self.logs
        gen = cmd.generation
        group = RankGroup(
            cmd=cmd, work_dir=self.work_dir, on_report=self._on_report,
            on_log=lambda rank, stream, line: shipper.ship(job, gen, rank, stream, line),
            step_log=str(self.work_dir / "steps" / f"{job}.jsonl"),
            sigterm_grace_s=self.cfg.sigterm_grace_s, collective_timeout_s=self.cfg.collective_timeout_s,
            warm=self.warm)
        self.group = group
        self.state = AgentState.STARTING
        first = resume_step(cmd.resume_from)
        try:
            await self._tg.start(self._run_generation, group)
        except Exception as e:  # noqa: BLE001 - e.g. the trainer command does not exist
            while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
                e = e.exceptions[0]  # type: ignore[assignment]
            log.error("generation_start_failed", error=repr(e))
            self.state = AgentState.IDLE
            return f"spawn_failed:{type(e).__name__}"
        self._publish_event(GenerationStarted(
            id=f"gen-{job}-{gen}-{self.node_id}", node_id=self.node_id, job_id=JobId(job), generation=gen,
            first_step=(first + 1) if first is not None else 0, ts=time.time()))
        if self.warm is not None and group.warm_used:
            self._tg.start_soon(self.warm.refill)  # at low priority: see agent/warm.py
        return None

    async def _run_generation(self, group: RankGroup, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        result = await group.run(task_status=task_status)
        self._publish_event(RanksExited(
            id=f"exit-{group.job_id}-{group.generation}-{self.node_id}", node_id=self.node_id,
            job_id=JobId(group.job_id), generation=group.generation, exit_code=result.exit_code,
            reason=result.reason, last_step=result.last_step, ts=time.time()))
        if self.group is group and self.state is not AgentState.DRAINING:
            self.state = AgentState.IDLE
        self._ack_pending_azure()

    def _on_report(self, rank: int, report: contract.StepReport | contract.CheckpointReport | contract.ExitReport) -> None:
        g = self.group
        if g is None:
            return
        if isinstance(report, contract.StepReport):
            if self.state is AgentState.STARTING:
                self.state = AgentState.TRAINING
        elif isinstance(report, contract.CheckpointReport):
            key = (g.job_id, report.generation, report.checkpoint_id)
            if key in self._committed:  # every local rank reports the same commit: one event per node
                return
            self._committed.add(key)
            self._publish_event(CheckpointCommitted(
                id=f"ckpt-{g.job_id}-{report.generation}-{report.checkpoint_id}-{self.node_id}", node_id=self.node_id,
                job_id=JobId(g.job_id), generation=report.generation, step=report.step,
                checkpoint_id=report.checkpoint_id, url=report.url, save_s=report.save_s,
                deadline_margin_s=report.deadline_margin_s, emergency=report.emergency, ts=report.ts))
            log.info("checkpoint_committed", generation=report.generation, step=report.step, emergency=report.emergency,
                     save_s=report.save_s, deadline_margin_s=report.deadline_margin_s)
            if report.emergency:
                self._ack_pending_azure()


async def _ensure_logs_stream_quietly(nc: nats.NATS) -> None:
    """A node user (per-node credential, agent_permissions) has no $JS.API access: the stream info
    request times out. The stream is then the operator's or orchd's to create; the agent goes on."""
    try:
        await ensure_logs_stream(nc)
    except Exception as e:  # noqa: BLE001
        log.info("logs_stream_not_checked", error=repr(e))


# --- command line -----------------------------------------------------------------------------------


async def _amain(cfg: AgentConfig) -> int:
    agent = Agent(cfg)

    async def signals() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
            async for s in sigs:
                log.info("signal_received", signal=signal.Signals(s).name)
                agent.request_shutdown("sigterm" if s == signal.SIGTERM else "sigint")
                if agent.nc is None:  # still trying to reach NATS: nothing to checkpoint or report
                    tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(signals)
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
