"""Checkpoint manager: DCP sharded save (sync or async), commit, verified load with fallback, rotation.

Role: what gets saved and when it counts. Model and optimizer go through DCP
(``get_state_dict``/``set_state_dict``: FSDP2 DTensors and DDP alike, resharded on load at any world
size); step, data position, LR scheduler, RNG states (python, numpy, torch, cuda) and config go into a
small per-rank side file. A checkpoint counts only after rank 0 wrote the commit marker (see
trainer.store); loading verifies sizes and CRC32C of every file and falls back to the previous committed
checkpoint when one is corrupt or partial. Rotation keeps the newest ``keep`` committed.

Concurrency: one pending async save at a time. Its completion is agreed at a step boundary (the
per-step all-reduce carries "my save is done / failed"), then rank 0 commits; a save that failed on any
rank is abandoned (no marker, removed by a later rotation). All checkpoint collectives run on the
dedicated gloo groups: ``DistInfo.ckpt_group`` for background saves and loading, ``save_group`` for
blocking saves, so an abandoned background save can never collide with the emergency save.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import logging
import pickle
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from trainer import store
from trainer.dist import DistInfo

log = logging.getLogger("trainer.checkpoint")


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


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
    ) -> None:
        if async_mode not in ("thread", "process", "off"):
            raise ValueError(f"async_mode must be thread|process|off, not {async_mode!r}")
        self.root = root_url.rstrip("/")
        self.info = info
        self.keep = keep
        self.async_mode = async_mode
        self.storage_options = storage_options or {}
        self.thread_count = thread_count
        self.sync_files = sync_files
        self.pending: PendingSave | None = None
        self.stager = ReusingStager()
        self.last_committed_step: int | None = None

    # --- saving ----------------------------------------------------------------------------------

    def _writer(self, dir_url: str) -> store.CommitWriter:
        return store.CommitWriter(
            dir_url, self.storage_options, thread_count=self.thread_count, sync_files=self.sync_files,
            cache_staged_state_dict=False,
        )

    def _prepare(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 extra: dict[str, Any]) -> tuple[str, store.CommitWriter, dict[str, Any]]:
        dir_url = store.step_dir(self.root, step)
        writer = self._writer(dir_url)
        payload = {**extra, "step": step, "world_size": self.info.world_size, "rank": self.info.rank,
                   "rng": rng_state()}
        writer.write_extra(f"__extra_{self.info.rank}.pkl", pickle.dumps(payload))
        state: dict[str, Any]
        if optimizer is not None:
            msd, osd = get_state_dict(model, optimizer)
            state = {"model": msd, "optim": osd}
        else:
            state = {"model": get_state_dict(model, [])[0]}
        return dir_url, writer, state

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, extra: dict[str, Any],
             *, reason: str = "final", started: float | None = None) -> CommitResult:
        """Blocking save + commit (the emergency and final path). Every rank returns the same result
        or raises."""
        t0 = started if started is not None else time.monotonic()
        dir_url, writer, state = self._prepare(step, model, optimizer, extra)
        dcp.save(state, storage_writer=writer, process_group=self.info.save_group)
        return self._commit(step, dir_url, t0)

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
        dir_url, writer, state = self._prepare(step, model, optimizer, extra)
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
            except Exception:
                pass
        return self.pending_status()

    def _commit_rank0(self, step: int, dir_url: str, t0: float) -> CommitResult:
        marker = store.commit(dir_url, self.info.world_size, {"step": step}, self.storage_options)
        self.last_committed_step = step
        store.rotate(self.root, self.keep, self.storage_options)
        return CommitResult(step, dir_url, time.monotonic() - t0, marker)

    def _commit(self, step: int, dir_url: str, t0: float) -> CommitResult:
        """Collective: rank 0 commits, everyone learns the outcome (so each rank can report it)."""
        outcome: list[Any] = [None]
        if self.info.rank == 0:
            try:
                res = self._commit_rank0(step, dir_url, t0)
                outcome[0] = ("ok", res.save_s)
            except Exception as e:
                outcome[0] = ("error", repr(e))
        if self.info.world_size > 1:
            dist.broadcast_object_list(outcome, src=0, group=self.info.save_group)
        status, value = outcome[0]
        if status != "ok":
            raise RuntimeError(f"commit of {dir_url} failed on rank 0: {value}")
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

    def resolve(self, resume_from: str) -> str | None:
        """Collective: the checkpoint every rank loads ("" = fresh start). Rank 0 verifies candidates
        newest first and falls back past corrupt or partial ones; all ranks get its choice."""
        chosen: list[Any] = [None]
        if self.info.rank == 0 and resume_from:
            entries = [e for e in store.list_checkpoints(self.root, self.storage_options) if e[2]]
            if resume_from == "latest":
                candidates = [d for (_, d, _) in reversed(entries)]
            else:
                marker = store.read_marker(resume_from, self.storage_options)
                limit = marker["step"] if marker else None
                older = [d for (s, d, _) in reversed(entries) if limit is None or s < limit]
                candidates = [resume_from] + [d for d in older if d.rstrip("/") != resume_from.rstrip("/")]
            for d in candidates:
                problem = store.verify(d, self.storage_options)
                if problem is None:
                    chosen[0] = d
                    break
                log.warning("checkpoint %s unusable (%s): falling back to the previous one", d, problem)
                print(f"checkpoint_fallback dir={d} reason={problem!r}", flush=True)
        if self.info.world_size > 1:
            dist.broadcast_object_list(chosen, src=0, group=self.info.ckpt_group)
        return chosen[0]

    def load(self, dir_url: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """Load model (+ optimizer) resharded to this world size; returns this rank's extra state
        (its own when the world size is unchanged, rank 0's otherwise) with RNG states restored."""
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
        marker = store.read_marker(dir_url, self.storage_options) or {}
        same_ws = marker.get("world_size") == self.info.world_size
        name = f"__extra_{self.info.rank if same_ws else 0}.pkl"
        fs = store.filesystem(dir_url, self.storage_options)
        with fs.open(store.join(store._path(dir_url), name), "rb") as f:
            extra = pickle.load(io.BytesIO(f.read()))
        if same_ws:
            set_rng_state(extra["rng"])
        else:  # a different world: rank 0's streams, offset per rank so ranks do not share one
            set_rng_state(extra["rng"])
            torch.manual_seed(int(torch.randint(0, 2**62, (1,)).item()) + self.info.rank)
        self.last_committed_step = extra["step"]
        return extra
