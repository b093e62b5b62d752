"""Checkpoint benchmark: save/load throughput vs the disk's own write rate, async blocking, emergency time.

    python benchmarks/checkpoint.py --json [--dir /path/on/the/disk] [--state-gib 1.0] [--threads 4]

One process (world size 1, gloo), a GPT whose parameters + AdamW state are >= --state-gib. Measured in
the same run, on the same directory, with the same fsync policy and parallelism (the save fsyncs every
file it writes with --threads writer threads; the disk probe writes the same number of bytes as
--threads files in parallel, 16 MiB chunks, each fsynced). The probe runs three times, interleaved
with the saves, and the best run is the reference (the shared disk's rate drifts):

  disk_write_gib_s   sequential write + fsync of state_gib bytes (best of 3; all in disk_write_runs_gib_s)
  save_gib_s         blocking DCP save + CRC32C while writing + fsync + commit marker
  save_vs_disk       save_gib_s / disk_write_gib_s (goal >= 0.8); save_vs_adjacent_disk divides by the
                     mean of the two probes run just before and just after the save instead
  load_gib_s         verify (read + CRC32C) + DCP load, page cache dropped first (posix_fadvise DONTNEED)
  async_block_s      time the training loop is blocked by a thread-based async save (staging copy into
                     reused host buffers; async_block_first_s includes allocating them)
  step_s             one training step of this model (global batch x seq_len tokens, this CPU/GPU)
  async_block_steps  async_block_s / step_s (goal <= 1.0)
  emergency_s        request -> all ranks agree -> save -> commit marker written (the emergency path)
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from trainer import dist as tdist
from trainer.checkpoint import CheckpointManager
from trainer.emergency import EmergencyState, agree
from trainer.model import GPT, GPTConfig, per_sample_loss

GIB = 1 << 30


def disk_write_rate(directory: Path, nbytes: int, threads: int) -> float:
    """Sequential write of nbytes split over ``threads`` files written in parallel (as the DCP writer
    does with thread_count=threads), each fsynced, like the save. GiB/s of wall time."""
    chunk = os.urandom(16 << 20)
    paths = [directory / f"probe{i}.bin" for i in range(threads)]

    def write(path: Path) -> None:
        with open(path, "wb") as f:
            left = nbytes // threads
            while left > 0:
                left -= f.write(chunk[: min(left, len(chunk))])
            f.flush()
            os.fsync(f.fileno())

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(threads) as pool:
        list(pool.map(write, paths))
    dt = time.perf_counter() - t0
    for p in paths:
        p.unlink()
    return nbytes / dt / GIB


def drop_cache(directory: Path) -> None:
    for p in directory.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def model_for(state_gib: float, seq_len: int) -> GPTConfig:
    """Smallest GPT-125m-width model whose params + AdamW moments (12 bytes/param) reach state_gib."""
    for n_layer in range(1, 200):
        cfg = GPTConfig(n_layer=n_layer, n_head=12, d_model=768, seq_len=seq_len)
        if cfg.n_params() * 12 >= state_gib * GIB:
            return cfg
    raise ValueError("state too large")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--state-gib", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=4,
                    help="DCP writer threads (files) per rank; the disk probe uses as many")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    a = ap.parse_args()

    base = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=base))
    try:
        info = tdist.init()
        cfg = model_for(a.state_gib, a.seq_len)
        torch.manual_seed(0)
        model = tdist.wrap_fsdp(GPT(cfg).to(info.device), info, bf16=info.is_gpu)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, 256, (a.batch, a.seq_len + 1), device=info.device)

        def step() -> float:
            t0 = time.perf_counter()
            loss = per_sample_loss(model(tokens[:, :-1]), tokens[:, 1:]).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if info.is_gpu:
                torch.cuda.synchronize()
            return time.perf_counter() - t0

        step()  # creates the AdamW state
        step_s = min(step() for _ in range(2))
        state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
        state_gib = state_bytes / GIB

        probes = [disk_write_rate(work, state_bytes, a.threads)]

        root = f"file://{work / 'ckpt'}"
        mgr = CheckpointManager(root, info, keep=2, async_mode="thread", thread_count=a.threads)
        t0 = time.perf_counter()
        mgr.save(1, model, opt, {"bench": True})
        save_s = time.perf_counter() - t0

        probes.append(disk_write_rate(work, state_bytes, a.threads))  # interleaved: the shared disk's rate drifts
        # emergency path: the request is already there, agree (one all-reduce), save, commit
        em = EmergencyState(None, 30.0)
        em.request_local("bench", deadline_ts=time.time() + 120)
        t0 = time.perf_counter()
        verdict = agree(em)
        assert verdict.stop
        res = mgr.save(2, model, opt, {"bench": True}, started=time.monotonic())
        emergency_s = time.perf_counter() - t0

        # async: blocking part (staging) vs one step. The first save allocates the reused host buffers;
        # the second is the steady state that every later periodic save sees.
        blocks = []
        for s in (3, 4):
            t0 = time.perf_counter()
            mgr.save_async(s, model, opt, {"bench": True})
            blocks.append(time.perf_counter() - t0)
            step()  # training goes on while the save writes
            pending = mgr.pending
            assert pending is not None  # a thread-based save
            pending.future.result()
            mgr.settle(True, False)
        async_block_first_s, async_block_s = blocks
        probes.append(disk_write_rate(work, state_bytes, a.threads))
        disk = max(probes)  # the disk at its best in this run: a conservative save_vs_disk

        drop_cache(work / "ckpt")
        t0 = time.perf_counter()
        chosen = mgr.resolve("latest")
        assert chosen is not None  # the saves above
        mgr.load(chosen, model, opt)
        load_s = time.perf_counter() - t0

        out = {
            "state_gib": round(state_gib, 3),
            "disk_write_gib_s": round(disk, 3),
            "disk_write_runs_gib_s": [round(x, 3) for x in probes],
            "save_gib_s": round(state_gib / save_s, 3),
            "save_vs_disk": round(state_gib / save_s / disk, 3),
            "save_vs_adjacent_disk": round(state_gib / save_s / ((probes[0] + probes[1]) / 2), 3),
            "load_gib_s": round(state_gib / load_s, 3),
            "async_block_s": round(async_block_s, 3),
            "async_block_first_s": round(async_block_first_s, 3),
            "step_s": round(step_s, 3),
            "async_block_steps": round(async_block_s / step_s, 3),
            "emergency_s": round(emergency_s, 3),
            "emergency_commit_dir": res.dir_url,
            "model_params": cfg.n_params(),
            "step_tokens": a.batch * a.seq_len,
            "writer_threads": a.threads,
            "device": torch.cuda.get_device_name() if info.is_gpu else "cpu",
            "dir": str(base),
        }
        print(json.dumps(out) if a.json else "\n".join(f"{k:>18}: {v}" for k, v in out.items()))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not a.dir:
            shutil.rmtree(base, ignore_errors=True)
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown


if __name__ == "__main__":
    main()
