"""Run the trainer ranks of one generation on this node, per the agent <-> trainer contract.

Role: spawn one process per local rank with the contract's environment (trainer/contract.py), read
their stdout/stderr line by line (report lines -> ``on_report``, everything else -> ``on_log``), relay
checkpoint requests (request file + SIGUSR1), stop them (SIGTERM = checkpoint within the grace) or
kill them (abandon), and classify how the generation ended.

Signals before readiness: SIGUSR1's default action terminates a process, and a Python rank installs
its handler only after importing torch. A checkpoint request therefore reaches a rank as a signal only
after that rank has printed its first report line; before that the request file waits in the control
directory and the signal is sent when the rank reports.

Process groups: each rank runs in its own session, so an abandon kills the rank *and* its children
(async checkpoint writers) with one ``killpg``.

Concurrency contract: ``run`` is one task in the agent's task group (started with ``tg.start``; it
reports started once every rank is spawned) and returns when every rank has exited; callbacks are
called from the reader tasks in the agent's event loop and must not block.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.abc
import msgspec
import structlog

from agent.warm import WarmPool, module_of, rank_base_env
from trainer import contract
from wire import MAX_EXIT_DETAIL, StartGenerationCmd

log = structlog.get_logger("agent.ranks")

OnReport = Callable[[int, "contract.StepReport | contract.CheckpointReport | contract.ExitReport"], None]
OnLog = Callable[[int, str, str], None]  # (rank, stream, line)


@dataclass(slots=True)
class GenerationResult:
    exit_codes: dict[int, int]  # global rank -> exit code
    reason: str  # completed | emergency_checkpoint | checkpoint_failed | storage_error | no_usable_checkpoint
    #              | peer_lost | failed | abandoned | stopped
    exit_code: int
    last_step: int
    detail: str = ""  # a replica_unusable exit: the first rank's reason (which replica, what failed)


def classify(codes: list[int], *, abandoned: bool = False, stopped: bool = False,
             storage_error: bool = False, spec_error: bool = False) -> tuple[str, int]:
    """How a generation ended on this node, from its ranks' exit codes (``storage_error``: a rank's ExitReport
    said its EXIT_CHECKPOINT_FAILED was a storage error)."""
    nonzero = [c for c in codes if c != 0]
    code = nonzero[0] if nonzero else 0
    if abandoned:
        return "abandoned", code
    if not nonzero:
        return contract.EXIT_REASONS[contract.EXIT_COMPLETED], 0
    if all(c in (0, contract.EXIT_PREEMPTED) for c in codes):
        return (("stopped" if stopped else contract.EXIT_REASONS[contract.EXIT_PREEMPTED]), contract.EXIT_PREEMPTED)
    for special in (contract.EXIT_PEER_LOST, contract.EXIT_NO_CHECKPOINT, contract.EXIT_CHECKPOINT_FAILED,
                    contract.EXIT_REPLICA_UNUSABLE):
        if special in codes:
            if special == contract.EXIT_CHECKPOINT_FAILED and storage_error:
                return contract.STORAGE_ERROR_REASON, special
            return contract.EXIT_REASONS[special], special
    if spec_error:  # a rank's ExitReport: the spec names an unusable model or dataset (orchd fails the job)
        return contract.SPEC_ERROR_REASON, code
    return contract.EXIT_REASONS[contract.EXIT_FAILED], code


def resume_step(resume_from: str | None) -> int | None:
    """The step the commit marker of a local checkpoint URL names (0 for a fresh start); None when unknown
    (no or malformed marker, ``latest``, an object store). Never the directory's name: a directory called
    ``step_000000123`` proves nothing, and the trainer refuses (exit 78) when no checkpoint verifies."""
    if not resume_from:
        return 0
    if ("://" in resume_from and not resume_from.startswith("file://")) or resume_from == "latest":
        return None
    path = Path(resume_from.removeprefix("file://")) / contract.CHECKPOINT_COMMIT_MARKER
    try:
        with open(path, "rb") as f:
            return contract.commit_marker_step(f.read(1 << 20))
    except OSError:
        return None


@dataclass(slots=True)
class _Rank:
    rank: int
    local_rank: int
    proc: anyio.abc.Process | None = None
    ready: bool = False  # printed a report line: its signal handlers are installed
    signal_pending: bool = False
    exit_code: int | None = None


@dataclass(slots=True)
class RankGroup:
    cmd: StartGenerationCmd
    work_dir: Path
    on_report: OnReport
    on_log: OnLog
    step_log: str | None = None
    sigterm_grace_s: float = 30.0
    collective_timeout_s: float = 60.0
    ranks: list[_Rank] = field(default_factory=list)
    last_step: int = 0
    last_loss: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    first_step_ts: float | None = None
    abandoned: bool = False
    stopped: bool = False
    storage_error: bool = False  # some rank's ExitReport reason is "storage_error: ..."
    spec_error: bool = False  # some rank's ExitReport reason is "spec_error: ..."
    replica_detail: str = ""  # the first ExitReport reason "replica_unusable: ..."
    replica_lag_max: int | None = None  # the largest StepReport.replica_lag of any rank (trainer.replicas)
    checkpoint_requested: bool = False
    result: GenerationResult | None = None
    done: anyio.Event = field(default_factory=anyio.Event)
    warm: WarmPool | None = None
    warm_used: int = 0
    ready: anyio.Event = field(default_factory=anyio.Event)  # every rank printed its first report line
    extra_env: dict[str, str] = field(default_factory=dict)  # the agent's own additions (replicas: agent/replicas.py)

    @property
    def job_id(self) -> str:
        return self.cmd.job_id or "job"

    @property
    def generation(self) -> int:
        return self.cmd.generation

    @property
    def control_dir(self) -> Path:
        return self.work_dir / "control" / self.job_id / f"gen{self.generation}"

    def _argv(self) -> list[str]:
        spec = self.cmd.trainer
        if spec.command:
            return list(spec.command)
        return [sys.executable, "-m", "trainer"]

    def _env(self, r: _Rank) -> dict[str, str]:
        c = self.cmd
        env = rank_base_env()
        env.update({
            "RANK": str(r.rank), "WORLD_SIZE": str(c.world_size), "LOCAL_RANK": str(r.local_rank),
            "LOCAL_WORLD_SIZE": str(c.gpus_per_node), "GROUP_RANK": str(c.node_rank), "NODE_RANK": str(c.node_rank),
            "MASTER_ADDR": c.master_addr, "MASTER_PORT": str(c.master_port),
            contract.ENV_JOB_ID: self.job_id,
            contract.ENV_GENERATION: str(c.generation),
            contract.ENV_CKPT_URL: c.checkpoint_url,
            contract.ENV_RESUME_FROM: c.resume_from or "",
            contract.ENV_TOTAL_STEPS: str(c.total_steps),
            contract.ENV_CONTROL_DIR: str(self.control_dir),
            contract.ENV_COLLECTIVE_TIMEOUT_S: str(self.collective_timeout_s),
            contract.ENV_TRAINER_ARGS: json.dumps(dict(c.trainer.args)),
            contract.ENV_SIGTERM_GRACE_S: str(self.sigterm_grace_s),
            "PYTHONUNBUFFERED": "1",
        })
        if self.step_log:
            env[contract.ENV_STEP_LOG] = self.step_log
        if c.checkpoint_interval_s is not None:
            env[contract.ENV_CKPT_INTERVAL_S] = str(c.checkpoint_interval_s)
        env.update(c.trainer.env)  # the job's own settings win (e.g. ORCH_COLLECTIVE_TIMEOUT_S)
        env.update(self.extra_env)  # but not over the replica holder's address and this generation's key
        # but not over the cluster's identity (it names the owner of the checkpoint root): orchd's, else the agent's
        env[contract.ENV_CLUSTER_ID] = c.cluster_id or os.environ.get(contract.ENV_CLUSTER_ID, "")
        # where models and data may come from is orchd's configuration to say (trainer.hf.source), never the job's
        env.pop(contract.ENV_MODEL_SCHEMES, None)
        if not isinstance(c.model_schemes, msgspec.UnsetType):
            env[contract.ENV_MODEL_SCHEMES] = ",".join(c.model_schemes)
        return env

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> GenerationResult:
        c = self.cmd
        self.control_dir.mkdir(parents=True, exist_ok=True)
        (self.control_dir / contract.CHECKPOINT_REQUEST_FILE).unlink(missing_ok=True)
        if self.step_log:
            Path(self.step_log).parent.mkdir(parents=True, exist_ok=True)
        self.ranks = [_Rank(rank=c.node_rank * c.gpus_per_node + i, local_rank=i) for i in range(c.gpus_per_node)]
        ended = False
        try:
            async with anyio.create_task_group() as tg:
                for r in self.ranks:
                    r.proc = await self._spawn(r)
                    log.info("rank_started", job_id=self.job_id, generation=c.generation, rank=r.rank, pid=r.proc.pid,
                             warm=self.warm_used > 0)
                    tg.start_soon(self._read, r, "stdout")
                    tg.start_soon(self._read, r, "stderr")
                    tg.start_soon(self._wait, r)
                task_status.started()
            ended = True
        finally:
            with anyio.CancelScope(shield=True):
                for r in self.ranks:  # never leave a rank behind (cancelled agent, spawn error)
                    if r.proc is not None and r.proc.returncode is None:
                        self._killpg(r)
                        await r.proc.wait()
                        r.exit_code = r.proc.returncode
            if not ended:  # a spawn error or cancellation: whoever waits on ``done`` must not hang
                codes = {r.rank: (r.exit_code if r.exit_code is not None else contract.EXIT_FAILED) for r in self.ranks}
                self.result = GenerationResult(codes, "failed", contract.EXIT_FAILED, self.last_step)
                self.done.set()
        codes = {r.rank: (r.exit_code if r.exit_code is not None else -9) for r in self.ranks}
        reason, code = classify(list(codes.values()), abandoned=self.abandoned, stopped=self.stopped,
                                storage_error=self.storage_error, spec_error=self.spec_error)
        detail = self.replica_detail if code == contract.EXIT_REPLICA_UNUSABLE else ""
        self.result = GenerationResult(codes, reason, code, self.last_step, detail)
        self.done.set()
        log.info("ranks_exited", job_id=self.job_id, generation=c.generation, reason=reason, exit_codes=codes)
        return self.result

    async def _spawn(self, r: _Rank) -> anyio.abc.Process:
        argv, env = self._argv(), self._env(r)
        module = module_of(argv)
        proc = self.warm.take() if (self.warm is not None and module is not None) else None
        if proc is not None and module is not None and proc.stdin is not None:
            req = json.dumps({"env": env, "cwd": str(self.work_dir), "argv": [module, *argv[3:]], "module": module})
            try:
                await proc.stdin.send(req.encode() + b"\n")
                await proc.stdin.aclose()
                self.warm_used += 1
                return proc
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                log.warning("warm_process_unusable", rank=r.rank)
        return await anyio.open_process(argv, env=env, cwd=str(self.work_dir), start_new_session=True,
                                        stdin=subprocess.DEVNULL)

    async def _wait(self, r: _Rank) -> None:
        assert r.proc is not None
        r.exit_code = await r.proc.wait()

    async def _read(self, r: _Rank, stream_name: str) -> None:
        assert r.proc is not None
        stream = r.proc.stdout if stream_name == "stdout" else r.proc.stderr
        assert stream is not None
        buf = b""
        async for chunk in stream:
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                self._line(r, stream_name, raw.decode("utf-8", errors="replace"))
        if buf:
            self._line(r, stream_name, buf.decode("utf-8", errors="replace"))

    def _line(self, r: _Rank, stream_name: str, line: str) -> None:
        report = contract.parse_report(line) if stream_name == "stdout" else None
        if report is None:
            self.on_log(r.rank, stream_name, line)
            return
        if not r.ready:
            r.ready = True
            if r.signal_pending:
                self._signal(r, signal.SIGUSR1)
            if all(x.ready for x in self.ranks):
                self.ready.set()
        if isinstance(report, contract.StepReport):
            if self.first_step_ts is None:
                self.first_step_ts = time.time()
            if isinstance(report.replica_lag, int):
                self.replica_lag_max = max(self.replica_lag_max or 0, report.replica_lag)
            if report.step >= self.last_step:
                self.last_step = report.step
                self.last_loss = report.loss
                self.tokens_per_s = report.tokens_per_s
                self.step_time_s = report.step_time_s
        elif isinstance(report, contract.ExitReport) and report.reason.startswith(contract.STORAGE_ERROR_REASON):
            self.storage_error = True
        elif isinstance(report, contract.ExitReport) and report.reason.startswith(contract.SPEC_ERROR_REASON):
            self.spec_error = True
        elif (isinstance(report, contract.ExitReport) and report.exit_code == contract.EXIT_REPLICA_UNUSABLE
              and not self.replica_detail):
            self.replica_detail = report.reason[:MAX_EXIT_DETAIL]
        self.on_report(r.rank, report)

    # --- control ---------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return not self.done.is_set()

    def request_checkpoint(self, request: contract.CheckpointRequest) -> None:
        """Relay an emergency checkpoint request to every rank (file, then SIGUSR1 once each is ready)."""
        self.control_dir.mkdir(parents=True, exist_ok=True)
        contract.write_checkpoint_request(str(self.control_dir), request)
        self.checkpoint_requested = True
        for r in self.ranks:
            if r.ready:
                self._signal(r, signal.SIGUSR1)
            else:
                r.signal_pending = True
        log.info("checkpoint_relayed", job_id=self.job_id, generation=self.generation, reason=request.reason,
                 deadline_ts=request.deadline_ts)

    def stop(self, *, checkpoint_first: bool) -> None:
        """SIGTERM (the trainer checkpoints within its grace) or, without a checkpoint, SIGKILL."""
        self.stopped = True
        for r in self.ranks:
            if checkpoint_first:  # a rank not ready yet: the default SIGTERM action loses nothing either
                self._signal(r, signal.SIGTERM)
            else:
                self._killpg(r)

    def abandon(self) -> None:
        """Kill every rank of this generation now (its peers are gone; nothing to save)."""
        self.abandoned = True
        for r in self.ranks:
            self._killpg(r)

    def _signal(self, r: _Rank, sig: signal.Signals) -> None:
        if r.proc is not None and r.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(r.proc.pid, sig)
        r.signal_pending = False

    def _killpg(self, r: _Rank) -> None:
        if r.proc is not None and r.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(r.proc.pid, signal.SIGKILL)
