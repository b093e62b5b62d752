"""Checkpoint manager: DCP sharded save (sync or async), commit, verified load with fallback, rotation.

Role: what gets saved and when it counts. Model and optimizer go through DCP
(``get_state_dict``/``set_state_dict``: FSDP2 DTensors and DDP alike, resharded on load at any world
size); step, data position, LR scheduler, RNG states (python, numpy, torch, cuda) and config go into a
small per-rank side file. A checkpoint counts only after rank 0 wrote the commit marker (see
trainer.store); loading verifies sizes and CRC32C of every file and falls back to the previous committed
checkpoint when one is corrupt or partial. Rotation keeps the newest ``keep`` committed.

Concurrency: one pending async save at a time. Its completion is agreed at a step boundary (the
per-step all-reduce carries "my save is done / failed"), then rank 0 commits; a save that failed on any
rank is abandoned (no marker, removed by a later rotation) and the session exits
EXIT_CHECKPOINT_FAILED. All checkpoint collectives run on the dedicated gloo groups:
``DistInfo.ckpt_group`` for background saves and loading, ``save_group`` for blocking saves, so an
abandoned background save can never collide with the emergency save.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from trainer import contract, extra_state, rootowner, store
from trainer import dist as tdist
from trainer.dist import DistInfo
from trainer.extra_state import rng_state, set_rng_state

__all__ = ["CheckpointManager", "CommitResult", "NoUsableCheckpoint", "StorageError", "rng_state", "set_rng_state"]

log = logging.getLogger("trainer.checkpoint")


class StorageError(Exception):
    """A save or commit failed on storage (ENOSPC, a DCP ``CheckpointException``, a failed commit)."""


class NoUsableCheckpoint(Exception):
    """Asked to resume, but no checkpoint under the job's root verified (the reasons are the message)."""


def save_failure(e: BaseException) -> StorageError | None:
    """The StorageError a failed save stands for; None when a peer was lost (that is EXIT_PEER_LOST). Its
    text starts with ``storage_error`` for DCP's ``CheckpointException`` (described by the first rank's
    underlying error, e.g. ENOSPC) and any OSError, ``checkpoint_failed`` for anything else."""
    if isinstance(e, StorageError):
        return e
    if tdist.is_peer_lost(e):
        return None
    inner: BaseException = e
    if isinstance(e, CheckpointException) and e.failures:
        first = next(iter(e.failures.values()))
        inner = first[0] if isinstance(first, tuple) else first
        if tdist.is_peer_lost(inner):
            return None
    text = " ".join(str(inner).split())[:240]
    storage = isinstance(e, (CheckpointException, OSError)) or isinstance(inner, OSError)
    kind = contract.STORAGE_ERROR_REASON if storage else contract.EXIT_REASONS[contract.EXIT_CHECKPOINT_FAILED]
    return StorageError(f"{kind}: {type(inner).__name__}: {text}")


class ReusingStager(AsyncStager):
    """Stages the state into host buffers allocated once and reused by every async save (pinned on
    GPU hosts, plain on CPU where pinning is unavailable): the loop is blocked for one memcpy of the
    state, not an allocation plus a copy. Safe because at most one async save is pending at a time."""

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._cache: dict[str, Any] | None = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        if self._cache is None:
            self._cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
        return _copy_state_dict(state_dict, self._cache)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self._cache = None


def _upload_future(fut: cf.Future | AsyncSaveResponse) -> cf.Future:
    """The future of the written data: ``dcp.async_save`` answers an ``AsyncSaveResponse`` only when the
    stager stages in the background (ours copies before it returns), a plain future otherwise."""
    return fut.upload_completion if isinstance(fut, AsyncSaveResponse) else fut


@dataclass
class PendingSave:
    step: int
    dir_url: str
    future: cf.Future
    started: float  # monotonic
    reason: str = "periodic"


@dataclass
class CommitResult:
    step: int
    dir_url: str
    save_s: float
    marker: dict[str, Any] = field(repr=False, default_factory=dict)


class CheckpointManager:
    def __init__(
        self,
        root_url: str,
        info: DistInfo,
        *,
        keep: int = 3,
        async_mode: str = "thread",  # thread | process | off
        storage_options: dict[str, Any] | None = None,
        thread_count: int = 1,
        sync_files: bool = True,
        job_id: str = "",
        save_threads: int = 4,
    ) -> None:
        if async_mode not in ("thread", "process", "off"):
            raise ValueError(f"async_mode must be thread|process|off, not {async_mode!r}")
        self.root = root_url.rstrip("/")
        self.info = info
        self.keep = keep
        self.async_mode = async_mode
        self.storage_options = storage_options or {}
        self.thread_count = thread_count  # writer threads (= files per rank) of periodic saves
        self.save_threads = save_threads  # at least as many for blocking (emergency, final) saves
        self.sync_files = sync_files
        self.pending: PendingSave | None = None
        self.stager = ReusingStager()
        self.last_committed_step: int | None = None
        self.job_id = job_id  # written into every commit marker; another job's checkpoint is refused

    # --- the root ----------------------------------------------------------------------------------

    def claim_root(self, cluster_id: str, *, adopt: bool) -> None:
        """Collective, before the first write: rank 0 claims the root for this job of ``cluster_id``
        (trainer.rootowner); every rank raises RootOwned when it is another's, StorageError when the store
        could not be read. Without a job id nothing is claimed, but a root owned by a job is refused."""
        outcome: list[Any] = [None]
        if self.info.rank == 0:
            try:
                if self.job_id:
                    rootowner.claim(self.root, self.job_id, cluster_id, self.storage_options, adopt=adopt)
                elif (owner := rootowner.read_owner(self.root, self.storage_options)) is not None:
                    raise rootowner.RootOwned(f"checkpoint root {self.root} owned by {owner.describe()} "
                                              f"(this trainer has no {contract.ENV_JOB_ID})")
            except rootowner.RootOwned as e:
                outcome[0] = ("owned", str(e))
            except Exception as e:
                outcome[0] = ("store", f"{contract.STORAGE_ERROR_REASON}: {type(e).__name__}: {e}")
        if self.info.world_size > 1:
            dist.broadcast_object_list(outcome, src=0, group=self.info.ckpt_group)
        if outcome[0] is not None:
            kind, text = outcome[0]
            raise rootowner.RootOwned(text) if kind == "owned" else StorageError(text)

    # --- saving ----------------------------------------------------------------------------------

    def _writer(self, dir_url: str, threads: int) -> store.CommitWriter:
        return store.CommitWriter(
            dir_url, self.storage_options, thread_count=threads, sync_files=self.sync_files,
            cache_staged_state_dict=False,
        )

    def _prepare(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 extra: dict[str, Any], threads: int) -> tuple[str, store.CommitWriter, dict[str, Any]]:
        dir_url = store.step_dir(self.root, step)
        writer = self._writer(dir_url, threads)
        payload = {**extra, "step": step, "world_size": self.info.world_size, "rank": self.info.rank,
                   "rng": rng_state()}
        writer.write_extra(f"__extra_{self.info.rank}.pt", extra_state.encode(payload))
        state: dict[str, Any]
        if optimizer is not None:
            msd, osd = get_state_dict(model, optimizer)
            state = {"model": msd, "optim": osd}
        else:
            state = {"model": get_state_dict(model, [])[0]}
        return dir_url, writer, state

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, extra: dict[str, Any],
             *, reason: str = "final", started: float | None = None) -> CommitResult:
        """Blocking save + commit (the emergency and final path), ``max(thread_count, save_threads)`` files
        per rank written in parallel. Every rank returns the same result
        or raises: a lost peer as itself, anything else (ENOSPC, DCP's ``CheckpointException``, which is a
        ``BaseException``, a failed commit) as :class:`StorageError`."""
        t0 = started if started is not None else time.monotonic()
        threads = max(self.thread_count, self.save_threads)  # several files in parallel per rank: the deadline
        dir_url, writer, state = self._prepare(step, model, optimizer, extra, threads)
        try:
            dcp.save(state, storage_writer=writer, process_group=self.info.save_group)
            # an emergency save (any reason but final/periodic) is timed to its marker: deleting old
            # checkpoints waits for the next commit (one more than ``keep`` meanwhile)
            return self._commit(step, dir_url, t0, rotate=reason in ("final", "periodic"))
        except (Exception, CheckpointException) as e:
            err = save_failure(e)
            if err is None:
                raise
            raise err from e

    def save_async(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                   extra: dict[str, Any]) -> None:
        """Start a periodic save; returns after staging (a copy of the state in host memory)."""
        if self.pending is not None:
            raise RuntimeError("an async save is already pending")
        if self.async_mode == "off":
            self.save(step, model, optimizer, extra, reason="periodic")
            return
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        t0 = time.monotonic()
        dir_url, writer, state = self._prepare(step, model, optimizer, extra, self.thread_count)
        kind = AsyncCheckpointerType.PROCESS if self.async_mode == "process" else AsyncCheckpointerType.THREAD
        fut = dcp.async_save(state, storage_writer=writer, process_group=self.info.ckpt_group,
                             async_checkpointer_type=kind, async_stager=self.stager)
        self.pending = PendingSave(step, dir_url, _upload_future(fut), t0)

    def pending_status(self) -> tuple[bool, bool]:
        """(still writing, failed) for this rank's pending save: what the per-step agreement carries."""
        if self.pending is None:
            return False, False
        if not self.pending.future.done():
            return True, False
        return False, self.pending.future.exception() is not None

    def settle(self, saves_done: bool, save_failed: bool) -> CommitResult | None:
        """Called by every rank after the per-step agreement: commit the pending save once every rank
        finished it, abandon it if any rank failed. Returns the commit (rank 0 only knows it)."""
        if self.pending is None or not saves_done:
            return None
        pending, self.pending = self.pending, None
        if save_failed:
            log.warning("async checkpoint of step %d failed on some rank: abandoned", pending.step)
            return None
        if self.info.rank != 0:
            return None
        try:
            return self._commit_rank0(pending.step, pending.dir_url, pending.started)
        except Exception:  # storage hiccup: this periodic checkpoint simply does not count
            log.exception("commit of step %d failed: checkpoint abandoned", pending.step)
            return None

    def wait_pending(self, timeout_s: float | None) -> tuple[bool, bool]:
        """Block until this rank's pending save finishes (or the timeout passes): (still writing, failed)."""
        if self.pending is not None:
            try:
                self.pending.future.result(timeout=timeout_s)
            except cf.TimeoutError:
                pass
            except (Exception, CheckpointException):  # DCP's is a BaseException; the status reports it
                pass
        return self.pending_status()

    def _commit_rank0(self, step: int, dir_url: str, t0: float, rotate: bool = True) -> CommitResult:
        meta: dict[str, Any] = {"step": step, **({"job_id": self.job_id} if self.job_id else {})}
        marker = store.commit(dir_url, self.info.world_size, meta, self.storage_options)
        self.last_committed_step = step
        if rotate:
            store.rotate(self.root, self.keep, self.storage_options, job_id=self.job_id or None)
        return CommitResult(step, dir_url, time.monotonic() - t0, marker)

    def _commit(self, step: int, dir_url: str, t0: float, rotate: bool = True) -> CommitResult:
        """Collective: rank 0 commits, everyone learns the outcome (so each rank can report it)."""
        outcome: list[Any] = [None]
        if self.info.rank == 0:
            try:
                res = self._commit_rank0(step, dir_url, t0, rotate)
                outcome[0] = ("ok", res.save_s)
            except Exception as e:
                outcome[0] = ("error", repr(e))
        if self.info.world_size > 1:
            dist.broadcast_object_list(outcome, src=0, group=self.info.save_group)
        status, value = outcome[0]
        if status != "ok":
            raise StorageError(f"{contract.STORAGE_ERROR_REASON}: commit of {dir_url} failed on rank 0: {value}")
        self.last_committed_step = step
        return CommitResult(step, dir_url, time.monotonic() - t0)

    def warm(self) -> None:
        """Spawn the process-based async saver now (first use costs seconds), never on the emergency
        path: a tiny async save into <root>/_warmup, then removed."""
        if self.async_mode != "process":
            return
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        d = store.join(self.root, "_warmup", f"rank_{self.info.rank}")
        writer = store.CommitWriter(d, self.storage_options, sync_files=False)
        fut = dcp.async_save({f"w{self.info.rank}": torch.zeros(1)}, storage_writer=writer,
                             process_group=self.info.ckpt_group, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        _upload_future(fut).result()
        dist.barrier(group=self.info.ckpt_group)
        if self.info.rank == 0:
            fs = store.filesystem(self.root, self.storage_options)
            fs.rm(store._path(store.join(self.root, "_warmup")), recursive=True)

    def close(self) -> None:
        """Stop the process-based saver (idle by now: callers settle pending saves first). Killed rather
        than asked: its own process-group teardown can wait on peers that already left."""
        if self.async_mode != "process":
            return
        from torch.distributed.checkpoint import _async_process_executor as ape

        proc = getattr(ape._CHECKPOINT_PROCESS, "_save_process", None)
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(timeout=5)

    # --- loading ---------------------------------------------------------------------------------

    def _in_root(self, dir_url: str) -> bool:
        """``dir_url`` is a step directory directly under this job's root (no other root, no ``..``)."""
        parent, _, name = dir_url.rstrip("/").rpartition("/")
        if store.step_of(name) is None or ".." in dir_url.split("/"):
            return False
        if store.is_local(dir_url) != store.is_local(self.root):
            return False
        if store.is_local(dir_url):
            return os.path.normpath(store.local_path(parent)) == os.path.normpath(store.local_path(self.root))
        return parent == self.root

    def _problem(self, dir_url: str, *, start_from: bool = False) -> str | None:
        """Why ``dir_url`` must not be loaded (None: it is this job's and every file verifies). With
        ``start_from`` (a URL outside the root while the root holds no commit yet: the job spec's
        ``start_from``, e.g. another job's checkpoint) only the root and job id checks are waived."""
        if not start_from and not self._in_root(dir_url):
            return f"not a checkpoint directory under the job's root {self.root}"
        marker, problem = store.marker_problem(dir_url, self.storage_options)
        if marker is None:
            return problem
        owner = marker.get("job_id")  # absent in markers of the previous release: the root decides
        if not start_from and owner is not None and self.job_id and owner != self.job_id:
            return f"checkpoint of job {owner!r}, not of {self.job_id!r}"
        return store.verify(dir_url, self.storage_options)

    def _choose(self, resume_from: str) -> tuple[str, str | None]:
        """Rank 0: ("ok", dir), ("fresh", None) or ("none", reasons)."""
        entries = [e for e in store.list_checkpoints(self.root, self.storage_options) if e[2]]
        if resume_from == "latest":
            if not entries:
                return "fresh", None  # nothing was ever committed under the root: a first start
            candidates = [d for (_, d, _) in reversed(entries)]
        else:
            limit = store.step_of(resume_from.rstrip("/").rsplit("/", 1)[-1])
            older = [d for (s, d, _) in reversed(entries) if limit is None or s < limit]
            candidates = [resume_from] + [d for d in older if d.rstrip("/") != resume_from.rstrip("/")]
        # before the job's own first commit, orchd names the spec's start_from, which may lie elsewhere
        start_from = not entries and resume_from != "latest" and not self._in_root(resume_from)
        reasons = []
        for d in candidates:
            problem = self._problem(d, start_from=start_from)
            if problem is None:
                return "ok", d
            reasons.append(f"{d}: {problem}")
            log.warning("checkpoint %s unusable (%s): falling back to the previous one", d, problem)
            print(f"checkpoint_fallback dir={d} reason={problem!r}", flush=True)
        return "none", "; ".join(reasons)[:2000]

    def resolve(self, resume_from: str) -> str | None:
        """Collective: the checkpoint every rank loads (None: fresh start, only for ``""`` or ``latest`` on a
        root where nothing was ever committed). Rank 0 checks candidates newest first (under the job's root,
        the job's own, every file verified) and falls back past unusable ones; all ranks get its choice.
        Raises :class:`NoUsableCheckpoint` on every rank when none is usable: never a silent step 1."""
        outcome: list[Any] = [("fresh", None)]
        if self.info.rank == 0 and resume_from:
            outcome[0] = self._choose(resume_from)
        if self.info.world_size > 1:
            dist.broadcast_object_list(outcome, src=0, group=self.info.ckpt_group)
        status, value = outcome[0]
        if status == "none":
            raise NoUsableCheckpoint(value or "no checkpoint")
        return value if status == "ok" else None

    def load(self, dir_url: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """Load a directory ``resolve`` chose (verified), model (+ optimizer) resharded to this world size;
        returns this rank's extra state (its own when the world size is unchanged, rank 0's otherwise) with
        RNG states restored. Only files the commit marker lists (and verify checked) are read."""
        marker = store.read_marker(dir_url, self.storage_options)
        if marker is None:
            raise NoUsableCheckpoint(f"{dir_url}: commit marker vanished or malformed")
        same_ws = marker["world_size"] == self.info.world_size
        rank = self.info.rank if same_ws else 0
        names = [f"__extra_{rank}.pt", f"__extra_{rank}.pkl"]
        name = next((n for n in names if n in marker["files"]), None)
        if name is None:
            raise NoUsableCheckpoint(f"{dir_url}: no extra state for rank {rank} in the commit marker")
        reader = store.make_reader(dir_url, self.storage_options)
        if optimizer is not None:
            msd, osd = get_state_dict(model, optimizer)
            state: dict[str, Any] = {"model": msd, "optim": osd}
            dcp.load(state, storage_reader=reader, process_group=self.info.ckpt_group)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        else:
            msd = get_state_dict(model, [])[0]
            dcp.load({"model": msd}, storage_reader=reader, process_group=self.info.ckpt_group)
            set_state_dict(model, [], model_state_dict=msd, optim_state_dict={})
        fs = store.filesystem(dir_url, self.storage_options)
        with fs.open(store.join(store._path(dir_url), name), "rb") as f:
            extra = extra_state.decode(name, f.read())
        set_rng_state(extra["rng"])
        if not same_ws:  # a different world: rank 0's streams, offset per rank so ranks do not share one
            torch.manual_seed(int(torch.randint(0, 2**62, (1,)).item()) + self.info.rank)
        self.last_committed_step = extra["step"]
        return extra
