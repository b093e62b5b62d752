"""An existing Hugging Face ``Trainer`` script as a spot job: replace ``trainer.train()`` by ``spot_train(trainer)``.

    from trainer.hf.callback import spot_train
    ...
    trainer = Trainer(model=model, args=training_args, train_dataset=ds, ...)
    spot_train(trainer)            # instead of trainer.train()

Why a wrapper and not only a callback: the ``Trainer`` decides how many batches to skip from the
``resume_from_checkpoint`` it is given, before any callback runs. ``spot_train``:

1. opens a ``trainer.lib.Session`` (process group with the contract's timeouts, early checkpoint signals,
   the checkpoint root's claim, ``ORCH_*``), before the Trainer creates its own distributed state;
2. when ``ORCH_RESUME_FROM`` names a committed checkpoint under ``ORCH_CKPT_URL`` (verified, with fallback,
   as for every job), hands the Trainer a local directory with only that checkpoint's ``trainer_state.json``
   (global step, epoch: the Trainer skips exactly the consumed batches); weights, optimizer, scheduler and
   RNG come from the DCP checkpoint in ``on_train_begin``, after the Trainer prepared model and optimizer
   (DDP, or FSDP: sharded state dicts, resharded on load);
3. after every optimizer step (``on_step_end``) runs the per-step agreement: on a checkpoint request (one
   rank's SIGUSR1 / SIGTERM is enough) all ranks save the same step to ``ORCH_CKPT_URL`` (DCP, CRC32C, commit
   marker), report and exit 75; periodic saves follow ``ORCH_CKPT_INTERVAL_S``; StepReports and StepRecords
   (with the dataset indices each rank fetched) go out as for the built-in trainer;
4. after ``train()`` returns, commits the final checkpoint and returns the Trainer's output (the script goes on).

The checkpoint's extra state holds the Trainer's state as JSON; ``output_dir`` is not used for resuming
(the next generation may run on a node that never saw it). Data loading must be deterministic for an exact
resume (the Trainer's seeded sampler; ``dataloader_num_workers=0`` for the sample ids in the step log).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import deque
from typing import Any

import torch

from trainer import contract
from trainer.lib import Session


class _Recording(torch.utils.data.Dataset):
    """The training dataset, recording the indices it is asked for (in fetch order, which is feed order)."""

    def __init__(self, base: Any) -> None:
        self.base = base
        self.fetched: deque[int] = deque()
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> Any:
        self.fetched.append(self.epoch * len(self.base) + int(i))
        return self.base[i]


class _TrainerState:
    """What the session saves as "data": the Hugging Face TrainerState, as JSON."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, str]:
        with tempfile.TemporaryDirectory() as d:  # the Trainer's own serialization of its state
            path = os.path.join(d, "trainer_state.json")
            self.trainer.state.save_to_json(path)
            with open(path) as f:
                return {"trainer_state": f.read()}

    def load_state_dict(self, state: dict[str, str]) -> None:  # the Trainer read it from the resume directory
        return None


def _callback_class() -> type:
    from transformers import TrainerCallback

    class SpotCallback(TrainerCallback):
        """The per-step contract inside the Trainer's loop (see the module's docstring)."""

        def __init__(self, sess: Session, trainer: Any, recorder: _Recording | None) -> None:
            self.sess, self.trainer, self.recorder = sess, trainer, recorder
            self.loss_sum, self.micro = 0.0, 0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            t = self.trainer
            self.sess.resume(t.model_wrapped, t.optimizer, scheduler=t.lr_scheduler, sampler=_TrainerState(t))

        def on_epoch_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.recorder is not None:
                self.recorder.epoch = int(state.epoch or 0)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            t, sess = self.trainer, self.sess
            loss = self.loss_sum / max(1, self.micro)
            self.loss_sum, self.micro = 0.0, 0
            ids: list[int] = []
            if self.recorder is not None:
                n = args.per_device_train_batch_size * args.gradient_accumulation_steps
                ids = [self.recorder.fetched.popleft() for _ in range(min(n, len(self.recorder.fetched)))]
            verdict = sess.agree(loss=loss)
            tokens = getattr(t, "_orch_tokens", 0) or None
            t._orch_tokens = 0
            sess.end_step(int(state.global_step), verdict, loss_mean=verdict.loss_sum / verdict.world_size,
                          sample_ids=ids, tokens=tokens)  # may save, commit and exit 75

    return SpotCallback


def _resume_dir(sess: Session) -> str | None:
    """A local directory with the chosen checkpoint's ``trainer_state.json``, or None for a fresh start."""
    if sess.ckpt is None or not sess.resume_from:
        return None
    from trainer import extra_state, store
    from trainer.checkpoint import NoUsableCheckpoint

    try:
        chosen = sess.ckpt.resolve(sess.resume_from)
    except NoUsableCheckpoint as e:
        print(f"no_usable_checkpoint resume_from={sess.resume_from} reasons={e}", flush=True)
        why = contract.EXIT_REASONS[contract.EXIT_NO_CHECKPOINT]
        sess.exit(contract.EXIT_NO_CHECKPOINT, f"{why}: {e}"[:300])
    if chosen is None:
        return None
    fs = store.filesystem(chosen, sess.ckpt.storage_options)
    with fs.open(store.join(store._path(chosen), "__extra_0.pt"), "rb") as f:
        extra = extra_state.decode("__extra_0.pt", f.read())
    d = tempfile.mkdtemp(prefix="orch-hf-resume-")
    with open(os.path.join(d, "trainer_state.json"), "w") as f:
        f.write(extra["data"]["trainer_state"])
    sess.resume_from = chosen  # on_train_begin loads exactly this one
    return d


def _watch_steps(trainer: Any, cb: Any) -> None:
    """Count each micro-batch's loss and tokens (the Trainer's ``training_step``, wrapped on this instance)."""
    inner = trainer.training_step

    def training_step(model: Any, inputs: Any, *a: Any, **kw: Any) -> Any:
        loss = inner(model, inputs, *a, **kw)
        cb.loss_sum += float(loss.detach().float().item()) if torch.is_tensor(loss) else float(loss)
        cb.micro += 1
        ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
        if ids is not None:
            trainer._orch_tokens = getattr(trainer, "_orch_tokens", 0) + int(ids.numel()) * cb.sess.world_size
        return loss

    trainer.training_step = training_step


def spot_train(trainer: Any, **train_kwargs: Any) -> Any:
    """``trainer.train()`` under the agent contract; returns the Trainer's output after the final checkpoint."""
    cfg = {"integration": "hf", "output_dir": str(trainer.args.output_dir)}
    if os.environ.get(contract.ENV_TOTAL_STEPS):  # the job's total_steps is the Trainer's max_steps
        trainer.args.max_steps = int(os.environ[contract.ENV_TOTAL_STEPS])
    if trainer.args.max_steps <= 0:
        raise SystemExit("spot_train: set max_steps (TrainingArguments) or ORCH_TOTAL_STEPS: the job's last step")
    sess = Session.from_env(ckpt_every=int(os.environ.get("ORCH_CKPT_EVERY", "0")),
                            total_steps=int(trainer.args.max_steps), config=cfg)
    with sess.guard():
        recorder = None
        if trainer.train_dataset is not None and hasattr(trainer.train_dataset, "__getitem__") \
                and trainer.args.dataloader_num_workers == 0:
            ds = trainer.train_dataset
            if trainer.args.remove_unused_columns and type(ds).__name__ == "Dataset" and hasattr(ds, "column_names"):
                ds = trainer._remove_unused_columns(ds, description="training")
            recorder = trainer.train_dataset = _Recording(ds)
        cb = _callback_class()(sess, trainer, recorder)
        trainer.add_callback(cb)
        _watch_steps(trainer, cb)
        resume = _resume_dir(sess)
        if resume is not None:
            trainer._load_from_checkpoint = lambda *a, **k: None  # weights come from the DCP checkpoint
        out = trainer.train(resume_from_checkpoint=resume, **train_kwargs)
        sess.save_final()
    print(json.dumps({"spot_train": "done", "step": sess.last_step}), flush=True)
    return out

