"""Training throughput of the built-in GPT trainer: tokens/s and MFU on one device.

    python benchmarks/train_throughput.py --json                      # GPU: 1.3b, bf16, compile; CPU: "mini"
    python benchmarks/train_throughput.py --json --size 1.3b --seq-len 2048 --global-batch 16 --micro-batch 8

World size 1 through the same code as ``python -m trainer`` (FSDP2 wrapping, micro-batching, AdamW,
clipping). MFU = flops_per_token x tokens/s / peak bf16 dense FLOP/s of the device (trainer.lib's table,
matched on the CUDA device name, no NVML); null on CPU, where there is no meaningful peak to divide by.
Output keys: tokens_per_s, mfu, device, plus the configuration measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from trainer.gpt import TrainerArgs, _grad_norm, build, make_session


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--size", default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--global-batch", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed steps")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps (compile, allocator)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--mode", default="fsdp")
    a = ap.parse_args()

    gpu = torch.cuda.is_available()
    args = TrainerArgs(
        size=a.size or ("1.3b" if gpu else "mini"),
        seq_len=a.seq_len or (2048 if gpu else 128),
        global_batch=a.global_batch or (16 if gpu else 8),
        micro_batch=a.micro_batch or (8 if gpu else 8),
        compile=gpu and not a.no_compile,
        activation_checkpointing=a.activation_checkpointing,
        mode=a.mode,
        total_steps=10**9,
        warmup_steps=1,
    )
    os.environ.pop("ORCH_CKPT_URL", None)
    sess = make_session(args)
    b = build(args, sess)

    def step() -> None:
        b.runner.run()
        _grad_norm(b.model, args.grad_clip)
        b.opt.step()
        b.sched.step()
        b.opt.zero_grad(set_to_none=True)

    warmup = a.warmup if a.warmup is not None else (5 if gpu else 1)
    steps = a.steps if a.steps is not None else (10 if gpu else 3)
    for _ in range(warmup):
        step()
    if gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if gpu:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens_per_s = steps * args.global_batch * args.seq_len / dt
    peak = sess.peak_flops
    out = {
        "tokens_per_s": round(tokens_per_s, 1),
        "mfu": round(b.cfg.flops_per_token() * tokens_per_s / peak, 4) if peak else None,
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "size": args.size,
        "params": b.cfg.n_params(),
        "seq_len": args.seq_len,
        "global_batch": args.global_batch,
        "micro_batch": b.runner.micro_batch,
        "bf16": b.bf16,
        "compile": args.compile,
        "step_s": round(dt / steps, 4),
        "peak_flops": peak,
        "max_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if gpu else None,
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "args": dataclasses.asdict(args) if not a.json else None,
    }
    print(json.dumps({k: v for k, v in out.items() if v is not None or k == "mfu"}) if a.json else out)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
