"""The built-in GPT trainer: ``python -m trainer`` (or ``python -m trainer.gpt``) in every rank process.

Role: a complete training script on top of trainer.lib. Arguments come from ORCH_TRAINER_ARGS (JSON)
and CLI flags (flags win); the launcher sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT and ORCH_*.

Per step: the rank's slice of the fixed global batch is fed in micro-batches (gradient accumulation; the
same micro-batch count on every rank, zero-weight padding where a share is short), the loss is the mean
over the *global* batch whatever the world size, then one agreement all-reduce (stop / OOM / async save
status / loss), clip, optimizer and scheduler step, and trainer.lib's end_step. An OOM on any rank makes
all ranks drop the step's gradients, halve the micro-batch (accumulation grows, the global batch stays)
and redo the step from the same data position and RNG state.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer import contract
from trainer.checkpoint import rng_state, set_rng_state
from trainer.data import Corpus, ExactlyOnceSampler, load_tokens, micro_batch_plan, rank_slice
from trainer.hf.source import SourceError
from trainer.lib import Session
from trainer.model import GPT, SIZES, config_for, per_sample_loss


@dataclass(frozen=True, slots=True)
class TrainerArgs:
    size: str = "tiny"  # model size name, see trainer.model.SIZES
    seq_len: int = 64
    global_batch: int = 8  # samples per optimizer step, fixed whatever the world size
    micro_batch: int = 8  # samples per forward/backward on one rank (halved on OOM)
    lr: float = 3e-3
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    corpus: str = ""  # local text file; "" = built-in deterministic synthetic corpus
    model: str = ""  # Hugging Face causal LM: save_pretrained dir / URL / hub id / config.json (not with size)
    dataset: str = ""  # Hugging Face model only: jsonl/parquet/text/arrow files / URL / hub id (not with corpus)
    text_column: str = "text"  # the dataset's column of text
    tokenizer: str = ""  # "" = the model's; a tokenizer dir / URL; "bytes" = UTF-8 bytes
    total_steps: int | None = None  # default: ORCH_TOTAL_STEPS
    ckpt_every: int = 0  # periodic async checkpoint every N steps (0 = only emergency/final)
    keep: int = 3  # committed checkpoints kept by rotation
    async_ckpt: str = "thread"  # thread | process | off
    ckpt_threads: int = 4  # DCP writer threads (files) per rank: ~2x the single-stream rate here
    storage_options: dict[str, Any] = field(default_factory=dict)  # fsspec options (e.g. endpoint for s3)
    mode: str = "fsdp"  # fsdp | ddp
    device: str = "auto"  # auto | cpu | cuda
    bf16: bool | None = None  # default: on GPU
    compile: bool = False  # torch.compile each block (GPU)
    activation_checkpointing: bool = False
    cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy
    debug_oom_above_micro: int = 0  # test hook: raise OutOfMemoryError when micro_batch exceeds this (0 = off)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_args(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> TrainerArgs:
    base = json.loads((os.environ if env is None else env).get(contract.ENV_TRAINER_ARGS) or "{}")
    unknown = set(base) - {f.name for f in dataclasses.fields(TrainerArgs)}
    if unknown:
        raise SystemExit(f"unknown trainer args in {contract.ENV_TRAINER_ARGS}: {sorted(unknown)}")
    p = argparse.ArgumentParser(prog="python -m trainer",
                                description="Built-in GPT trainer (FSDP2/DDP, DCP checkpoints)")
    for f in dataclasses.fields(TrainerArgs):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "storage_options":
            p.add_argument(flag, type=json.loads, default=None, help="JSON object")
        elif f.type in ("bool", "bool | None"):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            kind = float if f.type == "float" else int if f.type in ("int", "int | None") else str
            p.add_argument(flag, type=kind, default=None)
    ns = {k: v for k, v in vars(p.parse_args(argv)).items() if v is not None}
    args = TrainerArgs(**{**base, **ns})
    given = {**base, **ns}
    if args.model in SIZES:
        raise SystemExit(f"model {args.model!r} is a size of the built-in GPT: give size={args.model!r}")
    if args.model and "size" in given:
        raise SystemExit("give either size (the built-in GPT) or model (a Hugging Face model), not both")
    if (args.dataset or args.tokenizer or args.text_column != "text") and not args.model:
        raise SystemExit("dataset, text_column and tokenizer need model (a Hugging Face model and its tokenizer)")
    if args.dataset and args.corpus:
        raise SystemExit("give either dataset or corpus, not both")
    if args.size not in SIZES:
        raise SystemExit(f"unknown size {args.size!r}; choose from {sorted(SIZES)}")
    if args.mode not in ("fsdp", "ddp"):
        raise SystemExit(f"mode must be fsdp or ddp, not {args.mode!r}")
    return args


def lr_lambda(args: TrainerArgs, total_steps: int):
    def f(step: int) -> float:  # step = number of optimizer steps taken so far
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = min(1.0, (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps))
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


class StepRunner:
    """Forward/backward of one step's local share, micro-batched; returns (loss share, fed sample ids)."""

    def __init__(self, sess: Session, model: torch.nn.Module, corpus: Corpus, sampler: ExactlyOnceSampler,
                 args: TrainerArgs) -> None:
        self.sess, self.model, self.corpus, self.sampler, self.args = sess, model, corpus, sampler, args
        self.micro_batch = args.micro_batch

    def _batch(self, rows: list[tuple[int, int]]) -> torch.Tensor:
        windows = [torch.from_numpy(self.corpus.window(c)) for (_, c) in rows]
        return torch.stack(windows).to(self.sess.device, non_blocking=True)

    def run(self) -> tuple[float, list[int]]:
        sess, args = self.sess, self.args
        if args.debug_oom_above_micro and self.micro_batch > args.debug_oom_above_micro:
            raise torch.OutOfMemoryError(f"debug: micro_batch {self.micro_batch} > {args.debug_oom_above_micro}")
        B, ws, rank = args.global_batch, sess.world_size, sess.rank
        rows = self.sampler.next_step(rank, ws)
        lo, _ = rank_slice(B, ws, rank)
        plan = micro_batch_plan(B, ws, rank, self.micro_batch)
        scale = ws / (B * args.seq_len)  # grads are averaged over ranks: this makes them the global mean
        total = torch.zeros((), dtype=torch.float32, device=sess.device)
        fed: list[int] = []
        model: Any = self.model  # FSDP2 / DDP methods are not in nn.Module's type
        fsdp = hasattr(model, "set_requires_gradient_sync")
        for k, rg in enumerate(plan):
            last = k == len(plan) - 1
            mb = [rows[j - lo] for j in rg]
            weight = 1.0
            if not mb:  # this rank's share is shorter: zero-weight padding keeps collectives aligned
                mb, weight = [(-1, self.sampler.order.corpus_index(0))], 0.0
            tokens = self._batch(mb)
            if fsdp:
                model.set_requires_gradient_sync(last)
            ctx = model.no_sync() if (not fsdp and not last and hasattr(model, "no_sync")) else _null()
            with ctx:
                logits = model(tokens[:, :-1])
                logits = getattr(logits, "logits", logits)  # a Hugging Face model's output
                loss_sum = per_sample_loss(logits, tokens[:, 1:]).sum() * weight
                (loss_sum * scale).backward()
            total += loss_sum.detach()
            if weight:
                fed.extend(sid for sid, _ in mb)
        return float(total.item()) / (B * args.seq_len), fed


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _grad_norm(model: torch.nn.Module, clip: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


@dataclass
class Built:
    cfg: Any
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    sampler: ExactlyOnceSampler
    runner: StepRunner
    bf16: bool


def build(args: TrainerArgs, sess: Session) -> Built:
    """Model (compiled blocks, FSDP2 or DDP), AdamW, warmup+cosine schedule, corpus and sampler."""
    if sess.info.is_gpu:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    bf16 = sess.info.is_gpu if args.bf16 is None else args.bf16
    if args.model:
        cfg, model, tokens = _build_hf(args, sess, bf16)
    else:
        cfg = config_for(args.size, args.seq_len, args.activation_checkpointing)
        with torch.device(sess.device):
            gpt = GPT(cfg)
        if args.compile:
            for block in gpt.blocks:
                block.compile()
        model = sess.wrap(gpt, args.mode, bf16=bf16, cpu_offload=args.cpu_offload, blocks="blocks")
        tokens = load_tokens(args.corpus)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)  # foreach (default): DTensor params
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args, sess.total_steps))
    corpus = Corpus(tokens, args.seq_len)
    sampler = ExactlyOnceSampler(corpus.num_samples, args.global_batch, args.seed)
    return Built(cfg, model, opt, sched, sampler, StepRunner(sess, model, corpus, sampler, args), bf16)


def _build_hf(args: TrainerArgs, sess: Session, bf16: bool) -> tuple[Any, torch.nn.Module, Any]:
    """A Hugging Face model (trainer.hf, the [hf] extra) and its token stream; its config goes into every
    checkpoint (``python -m trainer.export`` rebuilds the model from it)."""
    from trainer.hf import require_hf

    require_hf()
    from trainer.hf.build import build_model, load_stream

    info, model, where = build_model(args, sess, bf16)
    sess.config = {**sess.config, "hf_config": info.config}
    return info, model, load_stream(args, where, int(info.config["vocab_size"]))


def train_step(sess: Session, b: Built, args: TrainerArgs, step: int) -> None:
    """One optimizer step with the agreement, OOM retry, and end_step (which may checkpoint or exit)."""
    model: Any = b.model  # FSDP2's reset_iter_state is not in nn.Module's type
    opt, sampler, runner = b.opt, b.sampler, b.runner
    while True:
        position, rng = sampler.position.next_sample, rng_state()
        oom, loss_share = False, 0.0
        fed: list[int] = []
        try:
            loss_share, fed = runner.run()
        except torch.OutOfMemoryError as e:
            oom = True
            print(f"oom step={step} micro_batch={runner.micro_batch}: {e}", file=sys.stderr, flush=True)
        verdict = sess.agree(loss=loss_share, oom=oom)
        if not verdict.oom:
            break
        opt.zero_grad(set_to_none=True)
        if hasattr(model, "reset_iter_state"):
            # torch 2.13 raises AttributeError when the comm context is not built yet (OOM before any forward)
            with contextlib.suppress(AttributeError):
                model.reset_iter_state()  # FSDP2: drop half-done all-gather/reduce-scatter state
        if sess.info.is_gpu:
            torch.cuda.empty_cache()
        if runner.micro_batch == 1:
            raise RuntimeError("out of memory at micro_batch 1")
        runner.micro_batch = max(1, runner.micro_batch // 2)
        sampler.position.next_sample = position
        set_rng_state(rng)
        print(f"oom_retry step={step} micro_batch={runner.micro_batch}", flush=True)
    grad_norm = _grad_norm(model, args.grad_clip)
    opt.step()
    b.sched.step()
    opt.zero_grad(set_to_none=True)
    sess.end_step(step, verdict, loss_mean=verdict.loss_sum, sample_ids=fed, grad_norm=grad_norm,
                  tokens=args.global_batch * args.seq_len, flops_per_token=b.cfg.flops_per_token())


def make_session(args: TrainerArgs) -> Session:
    if args.device == "cpu" or not torch.cuda.is_available():
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    return Session.from_env(device=args.device, ckpt_every=args.ckpt_every, keep=args.keep, async_mode=args.async_ckpt,
                            total_steps=args.total_steps, storage_options=args.storage_options, config=args.to_json(),
                            ckpt_threads=args.ckpt_threads)


def train(args: TrainerArgs) -> None:
    sess = make_session(args)
    with sess.guard():
        try:
            b = build(args, sess)
        except SourceError as e:  # the spec names something unusable: the same spec fails again, no restart
            print(f"spec_error {e}", file=sys.stderr, flush=True)
            sess.exit(contract.EXIT_FAILED, f"{contract.SPEC_ERROR_REASON}: {e}"[:300])
        if sess.rank == 0:
            print(f"trainer_start size={args.model or args.size} params={b.cfg.n_params()} "
                  f"world_size={sess.world_size} "
                  f"mode={args.mode} device={sess.device} bf16={b.bf16} global_batch={args.global_batch} "
                  f"micro_batch={args.micro_batch}", flush=True)
        for step in sess.steps(b.model, b.opt, scheduler=b.sched, sampler=b.sampler):
            train_step(sess, b, args, step)


def main(argv: list[str] | None = None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()
