"""The few-lines API any PyTorch training script calls: emergency protocol, checkpoints, exact data.

    from trainer.lib import Session
    from trainer.data import ExactlyOnceSampler

    sess = Session.from_env(ckpt_every=50)                       # dist init, signals, checkpoint manager
    model = sess.wrap(MyModel(), mode="fsdp")                    # optional: FSDP2 or DDP
    opt = torch.optim.AdamW(model.parameters())
    sampler = ExactlyOnceSampler(len(dataset), global_batch=64, seed=0)
    with sess.guard():                                           # exceptions -> contract exit codes
        for step in sess.steps(model, opt, sampler=sampler):     # resumes at the exact next step
            ids = sampler.next_step(sess.rank, sess.world_size)
            loss = ...; loss.backward(); opt.step(); opt.zero_grad()
            sess.step_done(step, loss=loss.item(), sample_ids=[i for i, _ in ids])
        # after the last step: final checkpoint, ExitReport, exit 0 (done by steps())

Role: the driver of the agent <-> trainer contract (trainer.contract) inside a training process: it
prints StepReport / CheckpointReport / ExitReport lines, appends StepRecords to ORCH_STEP_LOG, runs the
per-step agreement, starts periodic async checkpoints, and on an agreed stop saves, commits and exits
with EXIT_PREEMPTED. For a job with ``[tracking]``, rank 0 also hands each step's metrics (loss, grad
norm, tokens/s, MFU, step time, and what ``log_metrics`` added) to the job's MLflow run through
``trainer.tracking.MetricsLogger`` (a queue and a thread of its own: no I/O on the step). Single-threaded:
call it from the training loop only.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import msgspec
import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from trainer import contract
from trainer import dist as tdist
from trainer.checkpoint import CheckpointManager, CommitResult, NoUsableCheckpoint, StorageError, save_failure
from trainer.emergency import EmergencyState, Verdict, agree
from trainer.replicas import protocol as replica_protocol
from trainer.replicas.replicator import Replicator, ReplicaUnusable
from trainer.rootowner import RootOwned
from trainer.tracking import DEFAULT_FLUSH_S, ENV_FLUSH_S, MetricsLogger

# bf16 dense peak FLOP/s per device (vendor datasheets), matched on torch.cuda.get_device_name (no NVML)
PEAK_BF16_FLOPS = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("A100", 312e12),
                   ("L40S", 362e12), ("A10G", 125e12), ("L4", 121e12))


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS:
        if key in name:
            return flops
    return None


class Session:
    def __init__(
        self,
        info: tdist.DistInfo,
        emergency: EmergencyState,
        ckpt: CheckpointManager | None,
        *,
        total_steps: int,
        ckpt_every: int = 0,
        resume_from: str = "",
        generation: int = 0,
        step_log: str | None = None,
        config: dict[str, Any] | None = None,
        tracker: MetricsLogger | None = None,
    ) -> None:
        self.info = info
        self.emergency = emergency
        self.ckpt = ckpt
        self.total_steps = total_steps
        self.ckpt_every = ckpt_every
        self.resume_from = resume_from
        self.generation = generation
        self.config = config or {}
        self.step_log = step_log.replace("{rank}", str(info.rank)) if step_log else None
        self.last_step = 0
        self._t_last = time.monotonic()
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: Any = None
        self._sampler: Any = None
        self.user_state: dict[str, Any] = {}
        self.peak_flops = peak_flops(info.device)
        # orchd's periodic interval (Young/Daly) overrides ckpt_every; agreed per step like a stop
        self.ckpt_interval_s = float(os.environ.get(contract.ENV_CKPT_INTERVAL_S) or 0.0)
        self._last_periodic = time.monotonic()
        self.tracker = tracker if info.rank == 0 else None  # the job's MLflow run (rank 0 logs for all)
        self._step_metrics: dict[str, float] = {}
        self.tracking_flush_s = float(os.environ.get(ENV_FLUSH_S) or DEFAULT_FLUSH_S)
        self.replicas: Replicator | None = None  # shard replicas in peers' memory (trainer.replicas)

    @classmethod
    def from_env(cls, *, device: str = "auto", ckpt_every: int = 0, keep: int = 3, async_mode: str = "thread",
                 total_steps: int | None = None, storage_options: dict[str, Any] | None = None,
                 config: dict[str, Any] | None = None, ckpt_threads: int = 4) -> Session:
        emergency = EmergencyState.from_env()
        emergency.install()  # before the (slow) process-group init: a request during start-up is kept
        rank0 = int(os.environ.get("RANK", "0")) == 0
        tracker = MetricsLogger.from_env() if rank0 else None  # a tracked job without mlflow fails here, clearly
        info = tdist.init(device)
        url = os.environ.get(contract.ENV_CKPT_URL, "")
        job_id = os.environ.get(contract.ENV_JOB_ID, "")
        ckpt = CheckpointManager(url, info, keep=keep, async_mode=async_mode, storage_options=storage_options,
                                 thread_count=ckpt_threads, job_id=job_id) if url else None
        sess = cls(
            info, emergency, ckpt,
            total_steps=(total_steps if total_steps is not None
                         else int(os.environ.get(contract.ENV_TOTAL_STEPS, "100"))),
            ckpt_every=ckpt_every,
            resume_from=os.environ.get(contract.ENV_RESUME_FROM, ""),
            generation=int(os.environ.get(contract.ENV_GENERATION, "0")),
            step_log=os.environ.get(contract.ENV_STEP_LOG) or None,
            config=config,
            tracker=tracker,
        )
        if ckpt is not None:
            sess._claim_root()
            ckpt.warm()
        sess.replicas = Replicator.from_env(info)
        return sess

    def _claim_root(self) -> None:
        """Before any write: the checkpoint root must be this job's (claimed now if nobody's). A root owned by
        another job ends the session with EXIT_FAILED and ``checkpoint_root_owned: <whose>``; a store that
        cannot be reached or lacks credentials with EXIT_CHECKPOINT_FAILED and ``storage_error: ...``."""
        assert self.ckpt is not None
        try:
            self.ckpt.claim_root(os.environ.get(contract.ENV_CLUSTER_ID, ""), adopt=bool(self.resume_from))
        except RootOwned as e:
            print(f"checkpoint_root_owned {e}", flush=True)
            self.exit(contract.EXIT_FAILED, f"{contract.ROOT_OWNED_REASON}: {e}"[:300])
        except StorageError as e:
            self.exit(contract.EXIT_CHECKPOINT_FAILED, str(e)[:300])

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def device(self) -> torch.device:
        return self.info.device

    def wrap(self, model: nn.Module, mode: str = "fsdp", *, bf16: bool | None = None, cpu_offload: bool = False,
             blocks: str | None = None) -> nn.Module:
        """FSDP2 (per child of ``blocks``, e.g. "blocks", then the root) or DDP. bf16 defaults to GPU."""
        model = model.to(self.device)
        if mode == "ddp":
            return tdist.wrap_ddp(model, self.info)
        if mode != "fsdp":
            raise ValueError(f"mode must be fsdp or ddp, not {mode!r}")
        bf16 = self.info.is_gpu if bf16 is None else bf16
        if blocks is None:
            from torch.distributed.fsdp import fully_shard

            fully_shard(model, mesh=self.info.mesh)
            return model
        return tdist.wrap_fsdp(model, self.info, bf16=bf16, cpu_offload=cpu_offload, blocks=blocks)

    # --- reports ---------------------------------------------------------------------------------

    def _print(self, report: contract.StepReport | contract.CheckpointReport | contract.ExitReport) -> None:
        sys.stdout.write(contract.encode_report(report) + "\n")
        sys.stdout.flush()

    def exit(self, code: int, reason: str | None = None) -> NoReturn:
        """Print the ExitReport and leave at once (no teardown that could wait on a dead peer). Metrics still
        queued for MLflow get ORCH_TRACKING_FLUSH_S seconds to leave; the rest is counted lost."""
        if self.tracker is not None:
            c = self.tracker.close(self.tracking_flush_s)
            print(f"tracking_summary logged={c.logged} skipped={c.skipped} lost={c.lost} "
                  f"last_logged_step={self.tracker.last_logged}", flush=True)
        if self.replicas is not None:  # after the last step the commit in flight may finish (bounded), not else
            self.replicas.close(wait_s=2.0 if code == contract.EXIT_COMPLETED else 0.0)
            print(self.replicas.summary(), flush=True)
        self._print(contract.ExitReport(rank=self.rank, generation=self.generation, exit_code=code,
                                        reason=reason or contract.EXIT_REASONS.get(code, "failed"),
                                        last_step=self.last_step, ts=time.time()))
        if self.ckpt is not None:
            self.ckpt.close()
        sys.stderr.flush()
        os._exit(code)

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Map failures to the contract: a lost peer -> EXIT_PEER_LOST, a storage error of a checkpoint
        (StorageError, DCP's CheckpointException) -> EXIT_CHECKPOINT_FAILED, anything else -> EXIT_FAILED."""
        try:
            yield
        except SystemExit:
            raise
        except BaseException as e:  # every failure must become an exit code
            self.fail(e)

    def fail(self, e: BaseException) -> NoReturn:
        """Exit for a failure of the training loop, with the code ``guard`` gives it (its traceback or the
        lost peer's line on stderr first)."""
        print_failure(e)
        if isinstance(e, (StorageError, CheckpointException)):
            self._save_failed(e)
        self.exit(contract.EXIT_PEER_LOST if tdist.is_peer_lost(e) else contract.EXIT_FAILED,
                  f"{type(e).__name__}: {e}"[:300])

    def _save_failed(self, e: BaseException) -> NoReturn:
        """Exit for a failed save or commit: EXIT_PEER_LOST, or EXIT_CHECKPOINT_FAILED with the storage reason
        (``storage_error: ...``) so that orchd holds the job instead of counting a trainer failure."""
        err = save_failure(e)
        if err is None:
            self.exit(contract.EXIT_PEER_LOST, f"{type(e).__name__}: {e}"[:300])
        self.exit(contract.EXIT_CHECKPOINT_FAILED, str(err)[:300])

    # --- resume ----------------------------------------------------------------------------------

    def resume(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, scheduler: Any = None,
               sampler: Any = None) -> int:
        """Register what a checkpoint holds; load the newest valid one if asked. Returns the next step."""
        self._model, self._optimizer, self._scheduler, self._sampler = model, optimizer, scheduler, sampler
        start = 1
        replica_step = int(os.environ.get(replica_protocol.ENV_STEP) or 0)
        if self.replicas is not None and replica_step > 0:  # orchd chose a replicated step over the durable one
            try:
                start = self._apply_extra(self.replicas.restore(replica_step, model, optimizer)) + 1
            except ReplicaUnusable as e:
                why = contract.EXIT_REASONS[contract.EXIT_REPLICA_UNUSABLE]
                print(f"{why} {e}", flush=True)
                self.exit(contract.EXIT_REPLICA_UNUSABLE, f"{why}: {e}"[:300])
        elif self.ckpt is not None and self.resume_from:
            try:
                chosen = self.ckpt.resolve(self.resume_from)
            except NoUsableCheckpoint as e:  # explicit, never a silent restart at step 1
                print(f"no_usable_checkpoint resume_from={self.resume_from} reasons={e}", flush=True)
                why = contract.EXIT_REASONS[contract.EXIT_NO_CHECKPOINT]
                self.exit(contract.EXIT_NO_CHECKPOINT, f"{why}: {e}"[:300])
            if chosen is not None:
                extra = self.ckpt.load(chosen, model, optimizer)
                start = self._apply_extra(extra) + 1
                if self.rank == 0:
                    print(f"resumed_from dir={chosen} step={extra['step']} saved_world_size={extra['world_size']} "
                          f"world_size={self.world_size}", flush=True)
        self.last_step = start - 1
        if self.replicas is not None:
            self.replicas.begin(self.last_step)
        self._t_last = self._last_periodic = time.monotonic()
        return start

    def _apply_extra(self, extra: dict[str, Any]) -> int:
        """Scheduler, data position and user state from a checkpoint's or replica's extra state; its step."""
        if self._scheduler is not None and extra.get("scheduler") is not None:
            self._scheduler.load_state_dict(extra["scheduler"])
        if self._sampler is not None and extra.get("data") is not None:
            self._sampler.load_state_dict(extra["data"])
        self.user_state = extra.get("user", {})
        return int(extra["step"])

    def steps(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, scheduler: Any = None,
              sampler: Any = None) -> Iterator[int]:
        """resume(), then yield step numbers up to total_steps, then finish() (final checkpoint, exit 0)."""
        start = self.resume(model, optimizer, scheduler=scheduler, sampler=sampler)
        yield from range(start, self.total_steps + 1)
        self.finish()

    # --- per step --------------------------------------------------------------------------------

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Extra metrics of ``step`` for the job's MLflow run, sent with the step's own (call it before that
        step's ``step_done`` / ``end_step``). A no-op on ranks other than 0 and for untracked jobs."""
        if self.tracker is not None and step > self.last_step:
            self._step_metrics.update(metrics)

    def _saved(self) -> tuple[nn.Module, torch.optim.Optimizer | None, dict[str, Any]]:
        """What a checkpoint saves: the model and optimizer registered by ``resume``, and the extra state."""
        if self._model is None:
            raise RuntimeError("no model to checkpoint: resume() (or steps()) registers it first")
        return self._model, self._optimizer, self._extra()

    def _extra(self) -> dict[str, Any]:
        return {
            "data": self._sampler.state_dict() if self._sampler is not None else None,
            "scheduler": self._scheduler.state_dict() if self._scheduler is not None else None,
            "config": self.config,
            "user": self.user_state,
        }

    def agree(self, *, loss: float, oom: bool = False) -> Verdict:
        pending, failed = self.ckpt.pending_status() if self.ckpt is not None else (False, False)
        due = self.ckpt_interval_s > 0 and time.monotonic() - self._last_periodic >= self.ckpt_interval_s
        busy = self.replicas is not None and self.replicas.busy()
        return agree(self.emergency, oom=oom, save_pending=pending, save_failed=failed, periodic_due=due,
                     replica_pending=busy, loss=loss, device=self.info.device if self.info.is_gpu else "cpu")

    def step_done(self, step: int, *, loss: float, sample_ids: list[int] | tuple[int, ...] = (),
                  grad_norm: float | None = None, tokens: int | None = None,
                  flops_per_token: float | None = None) -> Verdict:
        """agree() + end_step() for scripts that do not need to act on the verdict before optimizer.step."""
        verdict = self.agree(loss=loss)
        self.end_step(step, verdict, loss_mean=verdict.loss_sum / verdict.world_size, sample_ids=sample_ids,
                      grad_norm=grad_norm, tokens=tokens, flops_per_token=flops_per_token)
        return verdict

    def end_step(self, step: int, verdict: Verdict, *, loss_mean: float,
                 sample_ids: list[int] | tuple[int, ...] = (), grad_norm: float | None = None,
                 tokens: int | None = None, flops_per_token: float | None = None) -> None:
        """After the optimizer step: report, log samples, commit/start checkpoints, and on an agreed stop
        save + commit + exit(EXIT_PREEMPTED). ``tokens`` counts the whole global batch."""
        now = time.monotonic()
        dt_s = max(now - self._t_last, 1e-9)
        self._t_last = now
        self.last_step = step
        tps = tokens / dt_s if tokens else None
        mfu = None
        if tps and flops_per_token and self.peak_flops:
            mfu = flops_per_token * tps / (self.peak_flops * self.world_size)
        lag = self.replicas.lag(step) if self.replicas is not None else msgspec.UNSET
        self._print(contract.StepReport(rank=self.rank, generation=self.generation, step=step, loss=loss_mean,
                                        grad_norm=grad_norm, tokens_per_s=tps, mfu=mfu, step_time_s=dt_s,
                                        ts=time.time(), replica_lag=lag))
        if self.tracker is not None:
            m = self._step_metrics
            self._step_metrics = {}
            m.update(loss=loss_mean, step_time_s=dt_s)
            if grad_norm is not None:
                m["grad_norm"] = grad_norm
            if tps is not None:
                m["tokens_per_s"] = tps
            if mfu is not None:
                m["mfu"] = mfu
            self.tracker.put(step, m)
        if self.step_log:
            rec = contract.StepRecord(generation=self.generation, step=step, rank=self.rank,
                                      world_size=self.world_size, loss=loss_mean,
                                      sample_ids=tuple(int(i) for i in sample_ids), ts=time.time())
            line = json.dumps({f: getattr(rec, f) for f in rec.__struct_fields__}) + "\n"
            with open(self.step_log, "a") as f:
                f.write(line)
        if self.ckpt is not None:
            failed = self._failed_periodic(verdict)
            res = self.ckpt.settle(verdict.saves_done, verdict.save_failed)
            if res is not None:
                self._report_commit(res, emergency=False, reason="periodic", deadline=None)
            if failed is not None:  # every rank agreed on it (save_failed is in the verdict)
                self._save_failed(failed)
        if verdict.stop and step < self.total_steps:
            self._emergency(step, verdict)
        # every input here is agreed (verdict) or identical on all ranks (step, pending): all ranks decide alike
        if self.ckpt_interval_s > 0:
            due = verdict.periodic_due
        else:
            due = bool(self.ckpt_every and step % self.ckpt_every == 0)
        if self.ckpt is not None and due and step < self.total_steps and self.ckpt.pending is None:
            self._last_periodic = time.monotonic()
            try:
                self.ckpt.save_async(step, *self._saved())
            except (StorageError, OSError, CheckpointException) as e:  # the staging or the extra state's write
                print_failure(e)
                self._save_failed(e)
        if self.replicas is not None and self._model is not None:  # after the last step: certify only
            self.replicas.after_step(step, self._model, self._optimizer, self._extra,
                                     all_done=verdict.replicas_done, last=step >= self.total_steps)

    def _failed_periodic(self, verdict: Verdict) -> BaseException | None:
        """The failure of the pending periodic save when the agreement says some rank's save failed."""
        pending = self.ckpt.pending if self.ckpt is not None else None
        if pending is None or not (verdict.saves_done and verdict.save_failed):
            return None
        local = pending.future.exception() if pending.future.done() else None
        return local or StorageError(f"{contract.STORAGE_ERROR_REASON}: async checkpoint of step {pending.step} "
                                     "failed on another rank")

    def _report_commit(self, res: CommitResult, *, emergency: bool, reason: str, deadline: float | None) -> None:
        self._print(contract.CheckpointReport(
            rank=self.rank, generation=self.generation, step=res.step, checkpoint_id=f"step_{res.step:09d}",
            url=res.dir_url, save_s=res.save_s, emergency=emergency,
            deadline_margin_s=(deadline - time.time()) if deadline else None, reason=reason, ts=time.time()))

    def _finish_pending(self, deadline: float | None) -> None:
        """Before a blocking save: wait for the periodic save in flight (bounded by the deadline), agree,
        commit it if every rank finished, abandon it otherwise. Never leaves it half-committed: the
        marker is written only after every rank reported its data durable."""
        assert self.ckpt is not None
        if self.ckpt.pending is None:
            return
        left = None if deadline is None else max(0.0, deadline - time.time() - 1.0)
        still, failed = self.ckpt.wait_pending(left)
        # the training group: only this (main) thread uses it, unlike ckpt_group (a save may still run there)
        v = agree(self.emergency, save_pending=still, save_failed=failed,
                  device=self.info.device if self.info.is_gpu else "cpu")
        if not v.saves_done:
            print(f"abandoning periodic checkpoint of step {self.ckpt.pending.step}: still writing at the deadline",
                  flush=True)
            self.ckpt.pending = None
            return
        res = self.ckpt.settle(True, v.save_failed)
        if res is not None:
            self._report_commit(res, emergency=False, reason="periodic", deadline=None)

    def _emergency(self, step: int, verdict: Verdict) -> None:
        req = self.emergency.request
        reason = req.reason if req is not None else "peer_request"
        t0 = self.emergency.received_monotonic or time.monotonic()
        if self.ckpt is None:
            print("checkpoint requested but ORCH_CKPT_URL is not set", flush=True)
            self.exit(contract.EXIT_CHECKPOINT_FAILED)
        try:
            self._finish_pending(verdict.deadline_ts)
            res = self.ckpt.save(step, *self._saved(), reason=reason, started=t0)
        except (Exception, CheckpointException) as e:  # a failed save or commit: the exit code says which kind
            print_failure(e)
            self._save_failed(e)
        self._report_commit(res, emergency=True, reason=reason, deadline=verdict.deadline_ts)
        self.exit(contract.EXIT_PREEMPTED)

    def finish(self) -> None:
        """After the last step: final checkpoint (if a URL is set), ExitReport, exit EXIT_COMPLETED."""
        self.save_final()
        self.exit(contract.EXIT_COMPLETED)

    def save_final(self) -> None:
        """After the last step: the periodic save in flight settled, then the final checkpoint committed (unless
        the last step already is); returns, so a script can go on (a Trainer's ``train()`` returns, an Accelerate
        loop saves its model). A failed save or commit exits with the code that says which kind."""
        if self.ckpt is None:
            return
        try:
            self._finish_pending(None)
            if self.ckpt.last_committed_step != self.last_step:
                res = self.ckpt.save(self.last_step, *self._saved(), reason="final")
                self._report_commit(res, emergency=False, reason="final", deadline=None)
        except (Exception, CheckpointException) as e:  # a failed save or commit: the exit code says which kind
            print_failure(e)
            self._save_failed(e)


def print_failure(e: BaseException) -> None:
    """On stderr (shipped to ``orchctl logs``): a lost peer is an expected failure - one line with the
    reason, ``peer_lost: <error>``; anything else gets its full traceback."""
    if not isinstance(e, StorageError) and save_failure(e) is None:
        sys.stderr.write(tdist.peer_lost_line(e) + "\n")
        sys.stderr.flush()
    else:
        traceback.print_exception(e)
