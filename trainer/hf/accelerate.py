"""A plain Accelerate training loop as a spot job: ``SpotAccelerate`` around the prepared model, optimizer and loader.

    from trainer.signals import install_early; install_early()    # first line: keep early checkpoint signals
    from accelerate import Accelerator
    from trainer.hf.accelerate import SpotAccelerate

    spot = SpotAccelerate()                      # before Accelerator(): the contract's process group, signals, root
    accelerator = Accelerator()
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for step, batch in spot.steps(model, optimizer, loader, scheduler=scheduler):   # resumes at the exact next batch
        loss = model(**batch).loss
        accelerator.backward(loss); optimizer.step(); scheduler.step(); optimizer.zero_grad()
        spot.step(step, loss=loss.item())        # the per-step agreement: on a notice, commit and exit 75
    # after the last step the final checkpoint is committed; the script goes on (e.g. accelerator.save_model)

Role: the same ``trainer.lib.Session`` as the built-in trainer and ``spot_train`` (nothing of the contract is done
here again): ``SpotAccelerate()`` opens it (the process group with ``ORCH_COLLECTIVE_TIMEOUT_S``, which Accelerate
then uses as it is; the checkpoint signals; the root's claim); ``steps`` resumes from ``ORCH_RESUME_FROM`` under
``ORCH_CKPT_URL`` (verified, with fallback; model and optimizer through DCP, resharded at another world size;
scheduler, RNG and the loader's position from the extra state), yields ``(step, batch)`` up to
``ORCH_TOTAL_STEPS`` and commits the final checkpoint; ``step`` is ``Session.step_done``: StepReport and
StepRecord, periodic saves (``ORCH_CKPT_INTERVAL_S``), and on a checkpoint request (one rank's SIGUSR1 / SIGTERM
is enough) every rank saves the same step with CRC32C and the commit marker, reports and exits 75. An uncaught
exception leaves with the contract's exit code (a lost peer 77, a storage error 76, else 1).

The loader's position is (epoch, batches consumed in it, the shuffling generator's state at the epoch's start):
a resumed job replays the epoch's order and skips what was consumed (``accelerate.skip_first_batches``), so it
sees the same batches in the same order as an uninterrupted one. A shuffling sampler without a generator (one
process, no ``use_seedable_sampler``) gets one, seeded from ``torch.initial_seed()``. At another world size the
position is the same count of global batches (Accelerate gives process p the batches p, p + W, ...), rounded down
when it does not divide, which the log says (``data_position_rounded``). Accelerate's prepared scheduler steps
``num_processes`` times per step (its rule): at another world size it continues from the saved count.

Parallelism: on CPU (gloo) Accelerate runs multi-process DDP (its ``MULTI_CPU``); FSDP needs GPUs there
(``FullyShardedDataParallelPlugin``), and the sharded state then goes through the same DCP ``get_state_dict``
(not run here: no GPU). Call ``step`` once per optimizer update (with gradient accumulation: when
``accelerator.sync_gradients``). Single-threaded: call it from the training loop only.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from trainer import contract
from trainer.lib import Session


def _sampler(loader: Any) -> Any:
    """The index sampler under a (prepared) loader's batch sampler, or None (an iterable dataset)."""
    obj = loader.sampler if isinstance(loader.sampler, torch.utils.data.BatchSampler) else loader.batch_sampler
    for _ in range(4):  # Accelerate's BatchSamplerShard -> BatchSampler -> sampler
        if obj is None or hasattr(obj, "sampler"):
            return None if obj is None else obj.sampler
        obj = getattr(obj, "batch_sampler", None)
    return None


class LoaderPosition:
    """Where the loop is in a prepared loader; what the session saves as "data" (``state_dict``)."""

    def __init__(self, loader: Any, world_size: int) -> None:
        self.loader = loader
        self.world_size = world_size
        self.epoch = 0
        self.batches = 0  # of this epoch, consumed by the steps done
        sampler = _sampler(loader)
        if isinstance(sampler, torch.utils.data.RandomSampler) and sampler.generator is None \
                and not hasattr(sampler, "initial_seed"):  # Accelerate's SeedableRandomSampler seeds per epoch
            sampler.generator = torch.Generator().manual_seed(torch.initial_seed())
        self.generator: torch.Generator | None = getattr(sampler, "generator", None)
        self._epoch_rng: torch.Tensor | None = None  # the generator's state at this epoch's start

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batches": self.batches, "world_size": self.world_size, "rng": self._epoch_rng}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self._epoch_rng = int(state["epoch"]), state.get("rng")
        consumed = int(state["batches"]) * int(state["world_size"])  # global batches of the epoch
        self.batches = consumed // self.world_size
        if consumed % self.world_size:
            print(f"data_position_rounded epoch={self.epoch} global_batches={consumed} world_size={self.world_size} "
                  f"resumed_at={self.batches * self.world_size}", flush=True)

    def __iter__(self) -> Iterator[Any]:
        """Batches from the position on, epoch after epoch, without end."""
        from accelerate import skip_first_batches

        while True:
            if hasattr(self.loader, "set_epoch"):
                self.loader.set_epoch(self.epoch)
            if self.generator is not None:
                if self._epoch_rng is not None:  # resumed: this epoch's order as it was
                    self.generator.set_state(self._epoch_rng)
                else:
                    self._epoch_rng = self.generator.get_state()
            skip = self.batches
            for batch in skip_first_batches(self.loader, skip) if skip else self.loader:
                self.batches += 1
                yield batch
            if self.batches == skip == 0:
                raise RuntimeError(f"the loader yields no batch in epoch {self.epoch}")
            self.epoch, self.batches, self._epoch_rng = self.epoch + 1, 0, None


class SpotAccelerate:
    """The agent contract for a plain Accelerate loop (see the module's docstring). ``total_steps``: the last step
    when ``ORCH_TOTAL_STEPS`` is unset (outside a job; default 100); ``ckpt_every``: a periodic checkpoint every N
    steps where orchd sets no interval; ``keep``, ``storage_options``: as the built-in trainer's."""

    def __init__(self, *, ckpt_every: int = 0, keep: int = 3, storage_options: dict[str, Any] | None = None,
                 total_steps: int | None = None) -> None:
        if dist.is_initialized():
            raise RuntimeError("SpotAccelerate() must come before Accelerator(): it opens the process group with the "
                               "contract's collective timeout (a lost peer exits 77 in seconds), which Accelerate "
                               "then uses")
        if os.environ.get(contract.ENV_TOTAL_STEPS):  # the job's last step wins over the script's
            total_steps = None
        self.session = Session.from_env(ckpt_every=ckpt_every, keep=keep, storage_options=storage_options,
                                        total_steps=total_steps, config={"integration": "hf", "loop": "accelerate"})
        self.position: LoaderPosition | None = None
        sys.excepthook = self._uncaught

    def _uncaught(self, kind: type[BaseException], e: BaseException, tb: Any) -> None:
        """An exception the loop did not catch: the exit code ``Session.guard`` gives it (a lost peer 77 ...)."""
        self.session.fail(e.with_traceback(tb))

    @property
    def total_steps(self) -> int:
        return self.session.total_steps

    @property
    def epoch(self) -> int:
        """The epoch of the batch last yielded (0 before any)."""
        return self.position.epoch if self.position is not None else 0

    def resume(self, model: Any, optimizer: Any, loader: Any, *, scheduler: Any = None) -> int:
        """Register the prepared model, optimizer, loader and scheduler; load the checkpoint ORCH_RESUME_FROM
        names (exit 78 when none verifies). Returns the next step."""
        self.position = LoaderPosition(loader, self.session.world_size)
        inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps the torch one
        return self.session.resume(model, inner, scheduler=scheduler, sampler=self.position)

    def steps(self, model: Any, optimizer: Any, loader: Any, *, scheduler: Any = None) -> Iterator[tuple[int, Any]]:
        """``resume``, then ``(step, batch)`` up to ``total_steps``, then the final checkpoint (``finish``)."""
        start = self.resume(model, optimizer, loader, scheduler=scheduler)
        assert self.position is not None
        yield from zip(range(start, self.total_steps + 1), self.position, strict=False)
        self.finish()

    def step(self, step: int, *, loss: float, sample_ids: list[int] | tuple[int, ...] = (),
             tokens: int | None = None) -> None:
        """After the optimizer step: report, agree, maybe save; on an agreed stop commit and exit 75. ``loss`` is
        this rank's, ``sample_ids`` what it fed (for the step log), ``tokens`` the global batch's."""
        self.session.step_done(step, loss=loss, sample_ids=sample_ids, tokens=tokens)

    def finish(self) -> None:
        """The final checkpoint (unless the last step is committed already); returns."""
        self.session.save_final()
