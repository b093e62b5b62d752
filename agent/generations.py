"""The node's generations: start the ranks orchd assigns, relay checkpoints, report what the ranks say.

Role: one ``GenerationRunner`` per agent holds the current ``RankGroup`` and the node's work state
(idle, starting, training, checkpointing; draining and stopped are set by the agent on its way out).
It starts a generation (abandoning an older one still running), places checkpoint requests (orchd's
command, a preemption notice, the agent's own SIGTERM), stops or abandons the ranks, and turns their
reports into events: ``GenerationStarted``, one ``CheckpointCommitted`` per checkpoint per node, and
``RanksExited``. ``on_emergency_end`` is called when an emergency checkpoint committed and when the
ranks exited (the notice relay then acknowledges what it held back).

Progress in ``orchctl logs``: the ranks' step reports are not log lines, so the runner ships a short
``step N loss L ...`` line per rank (stream stdout) for the first step of a generation and then at
most one every ``step_line_interval_s`` (``STEP_LINE_INTERVAL_S``, 10 s): a sane rate whatever the
step time.

Concurrency contract: used from the agent's event loop only. ``attach`` gives it the agent's task group
and log shipper once connected; each generation runs as a task in that group (``tg.start``: started
once every rank is spawned). Report callbacks come from the rank reader tasks and do quick work.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.abc
import anyio.to_thread
import msgspec
import structlog

from agent.config import AgentConfig
from agent.logship import LogShipper
from agent.outbox import NodePublisher
from agent.ranks import RankGroup, resume_step
from agent.replicas import ReplicaHolder
from agent.warm import WarmPool
from trainer import contract, rootowner
from trainer.replicas.protocol import ENV_STEP, ProtocolError
from wire import (
    AbandonGenerationCmd,
    AgentState,
    CheckpointCmd,
    CheckpointCommitted,
    GenerationStarted,
    JobId,
    RanksExited,
    StartGenerationCmd,
    StopCmd,
)

log = structlog.get_logger("agent")

Report = contract.StepReport | contract.CheckpointReport | contract.ExitReport

STEP_LINE_INTERVAL_S = 10.0
"""At most one progress line per rank per this many seconds in the shipped logs (plus each first step)."""


class GenerationRunner:
    def __init__(self, cfg: AgentConfig, work_dir: Path, publisher: NodePublisher, *, warm: WarmPool | None = None,
                 on_emergency_end: Callable[[], None] = lambda: None) -> None:
        self.cfg = cfg
        self.work_dir = work_dir
        self.publisher = publisher
        self.node_id = publisher.node_id
        self.warm = warm
        self.on_emergency_end = on_emergency_end
        self.state = AgentState.IDLE
        self.group: RankGroup | None = None
        self.accepting = True  # False once the agent is leaving: no new generation
        self.job_completed = False  # a generation here ran the job to its last step (exit "completed")
        self._committed: set[tuple[str, int, str]] = set()
        self._tg: anyio.abc.TaskGroup | None = None
        self._logs: LogShipper | None = None
        self.step_line_interval_s = STEP_LINE_INTERVAL_S
        self._step_line_ts: dict[tuple[int, int], float] = {}  # (generation, rank) -> last progress line
        self.replicas = ReplicaHolder(cfg.advertise_host or socket.gethostname())

    def attach(self, tg: anyio.abc.TaskGroup, logs: LogShipper) -> None:
        self._tg = tg
        self._logs = logs

    @property
    def running(self) -> RankGroup | None:
        """The current generation while its ranks run."""
        g = self.group
        return g if g is not None and g.running else None

    def _matches(self, cmd: CheckpointCmd | AbandonGenerationCmd) -> bool:
        g = self.group
        if g is None:
            return False
        return (not cmd.job_id or cmd.job_id == g.job_id) and (not cmd.generation or cmd.generation == g.generation)

    # --- commands --------------------------------------------------------------------------------

    async def start(self, cmd: StartGenerationCmd) -> str | None:
        """Start the generation (idempotent); an error code for the ack, or None."""
        if not self.accepting:
            return "draining"
        job = cmd.job_id or "job"
        old = self.group
        if old is not None and old.job_id == job and old.generation == cmd.generation:
            return None  # already started (a retry with a new cmd_id)
        if old is not None and old.running:
            if old.job_id == job and old.generation > cmd.generation:
                return "stale_generation"
            log.warning("abandoning_previous_generation", generation=old.generation, new=cmd.generation)
            old.abandon()
            with anyio.move_on_after(10):
                await old.done.wait()
        if self._tg is None or self._logs is None:
            raise RuntimeError("generation runner not attached to the agent's task group")
        if (owned := await root_problem(cmd)) is not None:
            log.error("checkpoint_root_refused", job_id=job, generation=cmd.generation, error=owned)
            return f"{contract.ROOT_OWNED_REASON}: {owned}"
        try:
            replica_env = await self.replicas.prepare(cmd)
        except (OSError, RuntimeError, ProtocolError) as e:  # the job trains on, resumes from its checkpoint
            log.error("replica_holder_failed", job_id=job, error=f"{type(e).__name__}: {e}")
            replica_env = {}
        group = self._new_group(cmd, self._logs)
        group.extra_env = replica_env
        self.group = group
        self.state = AgentState.STARTING
        try:
            await self._tg.start(self._run, group)
        except Exception as e:  # any failure to spawn (e.g. the trainer command does not exist): in the ack
            while isinstance(e, ExceptionGroup) and len(e.exceptions) == 1:
                e = e.exceptions[0]
            log.error("generation_start_failed", error=repr(e))
            self.state = AgentState.IDLE
            return f"spawn_failed:{type(e).__name__}"
        first = int(replica_env[ENV_STEP]) if ENV_STEP in replica_env else resume_step(cmd.resume_from)
        self.publisher.event(GenerationStarted(
            id=f"gen-{job}-{cmd.generation}-{self.node_id}", node_id=self.node_id, job_id=JobId(job),
            generation=cmd.generation, first_step=(first + 1) if first is not None else 0, ts=time.time()))
        if self.warm is not None and group.warm_used:
            self._tg.start_soon(self.warm.refill)  # at low priority: see agent/warm.py
        return None

    def _new_group(self, cmd: StartGenerationCmd, logs: LogShipper) -> RankGroup:
        job, gen = cmd.job_id or "job", cmd.generation
        return RankGroup(
            cmd=cmd, work_dir=self.work_dir, on_report=self._on_report,
            on_log=lambda rank, stream, line: logs.ship(job, gen, rank, stream, line),
            step_log=str(self.work_dir / "steps" / f"{job}.jsonl"),
            sigterm_grace_s=self.cfg.sigterm_grace_s, collective_timeout_s=self.cfg.collective_timeout_s,
            warm=self.warm)

    def checkpoint(self, cmd: CheckpointCmd) -> str | None:
        g = self.group
        if g is None or not self._matches(cmd):
            return "unknown_generation"
        self.emergency_checkpoint(contract.CheckpointRequest(
            request_id=cmd.cmd_id, reason=cmd.reason, deadline_ts=cmd.deadline_ts, issued_ts=cmd.issued_ts))
        return None

    def stop(self, cmd: StopCmd) -> None:
        g = self.running
        if g is None:
            return
        if not cmd.checkpoint_first:
            g.stop(checkpoint_first=False)
            return
        g.stopped = True
        now = time.time()
        g.request_checkpoint(contract.CheckpointRequest(request_id=cmd.cmd_id, reason=cmd.reason, issued_ts=now,
                                                        deadline_ts=now + self.cfg.sigterm_grace_s))

    def abandon(self, cmd: AbandonGenerationCmd) -> str | None:
        g = self.running
        if g is None:
            return None
        if not self._matches(cmd):
            return "unknown_generation"
        g.abandon()
        return None

    # --- checkpoints outside of commands -----------------------------------------------------------

    def emergency_checkpoint(self, request: contract.CheckpointRequest) -> None:
        """Place the request with the running ranks, unless one is placed already."""
        g = self.running
        if g is not None and not g.checkpoint_requested:
            self.state = AgentState.CHECKPOINTING
            g.request_checkpoint(request)

    async def wind_down(self, request_id: str, reason: str) -> None:
        """The agent is leaving: checkpoint (deadline now + the SIGTERM grace), wait for the ranks,
        kill them if they outlast the grace."""
        g = self.running
        if g is None:
            return
        now = time.time()
        grace = self.cfg.sigterm_grace_s
        g.request_checkpoint(contract.CheckpointRequest(request_id=request_id, reason=reason,
                                                        deadline_ts=now + grace, issued_ts=now))
        with anyio.move_on_after(grace + 5):
            await g.done.wait()
        if g.running:
            g.abandon()
            with anyio.move_on_after(5):
                await g.done.wait()

    def abandon_now(self) -> None:
        g = self.running
        if g is not None:
            g.abandon()

    # --- the ranks ---------------------------------------------------------------------------------

    async def _run(self, group: RankGroup, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        result = await group.run(task_status=task_status)
        held = await self.replicas.inventory(group.job_id)
        if result.reason == "completed":
            self.job_completed = True
        self.publisher.event(RanksExited(
            id=f"exit-{group.job_id}-{group.generation}-{self.node_id}", node_id=self.node_id,
            job_id=JobId(group.job_id), generation=group.generation, exit_code=result.exit_code,
            reason=result.reason, last_step=result.last_step, ts=time.time(),
            last_loss=msgspec.UNSET if group.last_loss is None else group.last_loss, replicas=held,
            detail=result.detail or msgspec.UNSET,
            replica_lag_max=msgspec.UNSET if group.replica_lag_max is None else group.replica_lag_max))
        if self.group is group and self.state is not AgentState.DRAINING:
            self.state = AgentState.IDLE
        self.on_emergency_end()

    def _on_report(self, rank: int, report: Report) -> None:
        g = self.group
        if g is None:
            return
        if isinstance(report, contract.StepReport):
            if self.state is AgentState.STARTING:
                self.state = AgentState.TRAINING
            self._step_line(g, report)
        elif isinstance(report, contract.CheckpointReport):
            self._on_commit(g, report)

    def _step_line(self, g: RankGroup, r: contract.StepReport) -> None:
        """A progress line for ``orchctl logs``, rate-limited per rank (see the module docstring)."""
        key = (r.generation, r.rank)
        now = time.monotonic()
        last = self._step_line_ts.get(key)
        if self._logs is None or (last is not None and now - last < self.step_line_interval_s):
            return
        if last is None and len(self._step_line_ts) > 64:  # forget older generations' ranks
            self._step_line_ts = {k: v for k, v in self._step_line_ts.items() if k[0] >= r.generation}
        self._step_line_ts[key] = now
        parts = [f"step {r.step}/{g.cmd.total_steps}", f"loss {r.loss:.4f}", f"step_time {r.step_time_s:.3f}s"]
        if r.tokens_per_s is not None:
            parts.append(f"tokens/s {r.tokens_per_s:.0f}")
        if r.grad_norm is not None:
            parts.append(f"grad_norm {r.grad_norm:.3f}")
        self._logs.ship(g.job_id, r.generation, r.rank, "stdout", " ".join(parts))

    def _on_commit(self, g: RankGroup, report: contract.CheckpointReport) -> None:
        key = (g.job_id, report.generation, report.checkpoint_id)
        if key in self._committed:  # every local rank reports the same commit: one event per node
            return
        self._committed.add(key)
        self.publisher.event(CheckpointCommitted(
            id=f"ckpt-{g.job_id}-{report.generation}-{report.checkpoint_id}-{self.node_id}", node_id=self.node_id,
            job_id=JobId(g.job_id), generation=report.generation, step=report.step,
            checkpoint_id=report.checkpoint_id, url=report.url, save_s=report.save_s,
            deadline_margin_s=report.deadline_margin_s, emergency=report.emergency, ts=report.ts))
        log.info("checkpoint_committed", generation=report.generation, step=report.step, emergency=report.emergency,
                 save_s=report.save_s, deadline_margin_s=report.deadline_margin_s)
        if report.emergency:
            self.on_emergency_end()


ROOT_CHECK_TIMEOUT_S = 30.0


async def root_problem(cmd: StartGenerationCmd) -> str | None:
    """Why the generation may not write its checkpoint root (another job's or cluster's, inside or above
    another root, holding another named job's checkpoints): checked before any rank starts. Whether a root
    of the previous release with checkpoints of no named job may be adopted is left to the trainer's claim
    (it knows whether it resumes) and to orchd's check at submit; so is a store this node cannot read."""
    if not cmd.checkpoint_url:
        return None
    options = cmd.trainer.args.get("storage_options")
    cluster = cmd.cluster_id or os.environ.get(contract.ENV_CLUSTER_ID, "")
    try:
        with anyio.fail_after(ROOT_CHECK_TIMEOUT_S):
            return await anyio.to_thread.run_sync(
                lambda: rootowner.problem(cmd.checkpoint_url, cmd.job_id or "job", cluster,
                                          options if isinstance(options, dict) else None,
                                          adopt=True),
                abandon_on_cancel=True)
    except rootowner.RootOwned as e:
        return str(e)
    except Exception as e:
        log.warning("checkpoint_root_unchecked", url=cmd.checkpoint_url, error=f"{type(e).__name__}: {e}")
        return None
