"""Training throughput of the built-in trainer: tokens/s and MFU on one device; with ``--model``, against the
same Hugging Face model in a plain Hugging Face ``Trainer`` loop.

    python benchmarks/train_throughput.py --json                      # GPU: 1.3b, bf16, compile; CPU: "mini"
    python benchmarks/train_throughput.py --json --size 1.3b --seq-len 2048 --global-batch 16 --micro-batch 8
    python benchmarks/train_throughput.py --json --model builtin://llama-tiny     # or a save_pretrained dir

World size 1 through the same code as ``python -m trainer`` (FSDP2 wrapping, micro-batching, AdamW,
clipping). MFU = flops_per_token x tokens/s / peak bf16 dense FLOP/s of the device (trainer.lib's table,
matched on the CUDA device name, no NVML); null on CPU, where there is no meaningful peak to divide by.
Output keys: tokens_per_s, mfu, device, plus the configuration measured.

With ``--model`` (the [hf] extra): the same model (same weights, loaded by trainer.hf), the same batch of
``global_batch x seq_len`` tokens per optimizer step, AdamW, is trained by our trainer and by
``transformers.Trainer.train()`` (its own loop; a callback timestamps its steps, so its set-up is not counted), on
the same machine in one run, in ``--rounds`` interleaved pairs (ours then theirs, then theirs then ours, ...) of
``--steps`` steps each. A pair's two rounds are seconds apart, so each pair's ratio (ours / theirs) sees about the
same load from other jobs on a shared host; the JSON gives every pair's ratio and their median, of wall time and
of CPU time (``time.process_time``: this process's CPU, every thread; it does not count the time another job held
the core), and the load average before and after. ``verdict`` says what the CPU ratios support against the goal
(0.95x): met or missed in every pair, else inconclusive. On CPU both sides run ``--threads`` (default 1) intra-op
threads: on an oversubscribed host, more threads spin at barriers waiting for a core, which swung the rounds 4-10x
and made the CPU time count the spinning.

Parallelism, as the JSON's ``ours_wrap`` / ``hf_wrap`` say: world size 1 (one process) on both sides. Ours is
FSDP2 (``fully_shard`` per decoder layer, then the root; gloo on CPU: its collectives have one member, so they
move no data, but parameters are DTensors); the Trainer is asked for ``fsdp="full_shard"`` and runs what
Accelerate gives it: on CPU a DDP wrapper (Accelerate's multi-CPU mode, a one-member gloo group), on GPU FSDP.
``--mode ddp`` runs ours under DDP too: the same wrapper as the Trainer's on CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from trainer.gpt import Built, TrainerArgs, _grad_norm, build, make_session


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--size", default=None)
    ap.add_argument("--model", default="", help="a Hugging Face model (trainer.args.model): against its Trainer")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--global-batch", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed steps (per round with --model)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps (compile, allocator)")
    ap.add_argument("--rounds", type=int, default=8, help="--model: interleaved pairs of rounds (one per side)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: 1 with --model on CPU, else torch's own)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--mode", default="fsdp")
    return ap.parse_args()


def trainer_args(a: argparse.Namespace, gpu: bool) -> TrainerArgs:
    return TrainerArgs(
        size=a.size or ("" if a.model else "1.3b" if gpu else "mini"),
        model=a.model,
        tokenizer="bytes" if a.model.startswith("builtin://") else "",
        seq_len=a.seq_len or (2048 if gpu else 128),
        global_batch=a.global_batch or (16 if gpu else 8),
        micro_batch=a.micro_batch or (8 if gpu else 8),
        compile=gpu and not a.no_compile,
        activation_checkpointing=a.activation_checkpointing,
        mode=a.mode,
        total_steps=10**9,
        warmup_steps=1,
    )


def clock() -> tuple[float, float]:
    """(wall, this process's CPU) seconds."""
    return time.perf_counter(), time.process_time()


def our_steps(args: TrainerArgs, b: Built, n: int, gpu: bool) -> tuple[float, float]:
    """(wall, CPU) seconds for ``n`` optimizer steps of our trainer."""
    if gpu:
        torch.cuda.synchronize()
    w0, c0 = clock()
    for _ in range(n):
        b.runner.run()
        _grad_norm(b.model, args.grad_clip)
        b.opt.step()
        b.sched.step()
        b.opt.zero_grad(set_to_none=True)
    if gpu:
        torch.cuda.synchronize()
    w1, c1 = clock()
    return w1 - w0, c1 - c0


def load_avg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def main() -> None:
    a = parse()
    gpu = torch.cuda.is_available()
    threads = a.threads or (1 if a.model and not gpu else 0)
    if threads:  # OMP_NUM_THREADS too: else Accelerate (the Trainer's) sets its own count on CPU
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    load0 = load_avg()
    args = trainer_args(a, gpu)
    os.environ.pop("ORCH_CKPT_URL", None)
    sess = make_session(args)
    b = build(args, sess)
    warmup = a.warmup if a.warmup is not None else (5 if gpu else 2 if a.model else 1)
    steps = a.steps if a.steps is not None else (10 if gpu or a.model else 3)
    our_steps(args, b, warmup, gpu)
    tokens = args.global_batch * args.seq_len
    peak = sess.peak_flops
    fpt = b.cfg.flops_per_token()
    if a.model:
        out = compare(a, args, b, sess, warmup, steps, gpu)
    else:
        dt, _ = our_steps(args, b, steps, gpu)
        tps = steps * tokens / dt
        out = {"tokens_per_s": round(tps, 1), "mfu": round(fpt * tps / peak, 4) if peak else None,
               "step_s": round(dt / steps, 4)}
    out.update({
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "size": args.model or args.size,
        "params": b.cfg.n_params(),
        "seq_len": args.seq_len,
        "global_batch": args.global_batch,
        "micro_batch": b.runner.micro_batch,
        "bf16": b.bf16,
        "compile": args.compile,
        "peak_flops": peak,
        "max_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if gpu else None,
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "load_avg": [load0, load_avg()],
        "args": dataclasses.asdict(args) if not a.json else None,
    })
    print(json.dumps({k: v for k, v in out.items() if v is not None or k.startswith("mfu")}) if a.json else out)
    sys.stdout.flush()
    os._exit(0)


# --- the same model in a plain Hugging Face Trainer loop -------------------------------------------------


def hf_trainer(args: TrainerArgs, sess: Any, gpu: bool, fsdp: bool) -> tuple[Any, list[tuple[float, float]]]:
    """A ``transformers.Trainer`` on a fresh copy of the model (trainer.hf's loader: the same weights), on
    random token windows of the same shape; and the list its callback appends step end (wall, CPU) times to."""
    import datasets
    from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

    from trainer.hf.model import load_model

    model, _ = load_model(args.model, seed=args.seed)
    config: Any = model.config
    vocab = int(config.vocab_size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (4096, args.seq_len), generator=g).tolist()
    ds = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})
    ends: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            if gpu:
                torch.cuda.synchronize()
            ends.append(clock())

    layers = sorted(getattr(model, "_no_split_modules", None) or [])  # what our FSDP2 shards one by one
    kw: dict[str, Any] = {"fsdp": "full_shard", "fsdp_config": {"transformer_layer_cls_to_wrap": layers}}
    kw = kw if fsdp else {}
    targs = TrainingArguments(output_dir=os.path.join("/tmp", f"hf-bench-{os.getpid()}"), report_to=[],
                              per_device_train_batch_size=args.global_batch // sess.world_size,
                              learning_rate=args.lr, weight_decay=args.weight_decay, adam_beta2=0.95,
                              max_grad_norm=args.grad_clip, max_steps=1, save_strategy="no", logging_strategy="no",
                              use_cpu=not gpu, bf16=gpu, torch_compile=args.compile, disable_tqdm=True, seed=0,
                              dataloader_num_workers=0, **kw)
    trainer = Trainer(model=model, args=targs, train_dataset=ds, data_collator=default_data_collator,
                      callbacks=[Clock()])
    return trainer, ends


def hf_round(trainer: Any, ends: list[tuple[float, float]], warmup: int, steps: int) -> tuple[float, float]:
    """(wall, CPU) seconds of ``steps`` Trainer steps after ``warmup`` untimed ones (at least 1), in one
    ``train()``."""
    ends.clear()
    trainer.args.max_steps = warmup + steps
    with contextlib.redirect_stdout(sys.stderr):  # the Trainer prints its metrics: stdout is the JSON's
        trainer.train()
    (w0, c0), (w1, c1) = ends[warmup - 1], ends[-1]
    return w1 - w0, c1 - c0


def wrapper(model: Any) -> str:
    """What the Trainer actually wrapped its model in: fsdp, ddp or none."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    from torch.nn.parallel import DistributedDataParallel as DDP

    if isinstance(model, (FSDP1, FSDPModule)):
        return "fsdp"
    return "ddp" if isinstance(model, DDP) else "none"


GOAL = 0.95  # ours / theirs, tokens per second (issue 30)


def verdict(ratios: list[float]) -> str:
    """What the pairs support: the goal met (or missed) in every pair, else nothing."""
    if min(ratios) >= GOAL:
        return f"ours >= {GOAL}x the Trainer in every pair"
    if max(ratios) < GOAL:
        return f"ours < {GOAL}x the Trainer in every pair"
    return f"inconclusive: pairs on both sides of {GOAL}x"


def compare(a: argparse.Namespace, args: TrainerArgs, b: Built, sess: Any, warmup: int, steps: int,
            gpu: bool) -> dict[str, Any]:
    """Interleaved pairs of rounds of our trainer and the Hugging Face Trainer: per-pair ratios of wall and CPU
    time, their medians and ranges, medians of each side, MFU (GPU only)."""
    hf_wrap = "asked fsdp"
    try:
        trainer, ends = hf_trainer(args, sess, gpu, fsdp=True)
        hf_round(trainer, ends, max(1, warmup), 1)
    except Exception as e:  # FSDP through accelerate needs what this host may not have (e.g. CPU)
        hf_wrap = f"fsdp refused: {type(e).__name__}: {str(e)[:120]}"
        trainer, ends = hf_trainer(args, sess, gpu, fsdp=False)
    warm = max(1, warmup)
    hf_round(trainer, ends, warm, 1)
    hf_wrap = f"{wrapper(trainer.model_wrapped)} ({hf_wrap})"
    tokens = steps * args.global_batch * args.seq_len
    pairs: list[dict[str, tuple[float, float]]] = []
    for i in range(a.rounds):  # ours first in even pairs, theirs first in odd ones: a drift in load cancels
        pair: dict[str, tuple[float, float]] = {}
        for side in ("ours", "hf") if i % 2 == 0 else ("hf", "ours"):
            pair[side] = our_steps(args, b, steps, gpu) if side == "ours" else hf_round(trainer, ends, warm, steps)
        pairs.append(pair)
    wall = [p["hf"][0] / p["ours"][0] for p in pairs]  # = ours' tokens/s over theirs
    cpu = [p["hf"][1] / p["ours"][1] for p in pairs]
    med = statistics.median
    o, t = med(tokens / p["ours"][0] for p in pairs), med(tokens / p["hf"][0] for p in pairs)
    peak, fpt = sess.peak_flops, b.cfg.flops_per_token()
    return {
        "ours_vs_hf": round(med(wall), 3), "ours_vs_hf_range": [round(min(wall), 3), round(max(wall), 3)],
        "ours_vs_hf_cpu": round(med(cpu), 3), "ours_vs_hf_cpu_range": [round(min(cpu), 3), round(max(cpu), 3)],
        "verdict": verdict(cpu), "goal": GOAL,
        "pairs": [{"ours_vs_hf": round(w, 3), "ours_vs_hf_cpu": round(c, 3)} for w, c in zip(wall, cpu, strict=True)],
        "tokens_per_s": round(o, 1), "hf_tokens_per_s": round(t, 1),
        "tokens_per_cpu_s": round(med(tokens / p["ours"][1] for p in pairs), 1),
        "hf_tokens_per_cpu_s": round(med(tokens / p["hf"][1] for p in pairs), 1),
        "ours_rounds": [round(tokens / p["ours"][0], 1) for p in pairs],
        "hf_rounds": [round(tokens / p["hf"][0], 1) for p in pairs],
        "mfu": round(fpt * o / peak, 4) if peak else None, "mfu_hf": round(fpt * t / peak, 4) if peak else None,
        "ours_wrap": f"{args.mode} (world size {sess.world_size})",
        "hf_wrap": f"{hf_wrap}, world size {sess.world_size}",
        "rounds": a.rounds, "steps_per_round": steps,
        "transformers": __import__("transformers").__version__,
    }


if __name__ == "__main__":
    main()
