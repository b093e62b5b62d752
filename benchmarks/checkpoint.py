"""Checkpoint benchmark: save/load throughput vs the disk's own write rate, async blocking, emergency time.

    python benchmarks/checkpoint.py --json [--dir /path/on/the/disk] [--state-gib 1.0] [--threads 4] [--pairs 5]
    python benchmarks/checkpoint.py --json --url gs://bucket/prefix [--emulator | --storage-options JSON]

With --url (s3://, gs://, az://) the figures are the object store's: see benchmarks/checkpoint_objstore.py.

One process (world size 1, gloo), a GPT whose parameters + AdamW state are >= --state-gib. Measured in
the same run, on the same directory, with the same fsync policy and parallelism (the save fsyncs every
file it writes with --threads writer threads; the disk probe writes the same number of bytes as
--threads files in parallel, 16 MiB chunks, writeback started per chunk, each file fsynced). The probe
runs three times, interleaved with the saves, and the best run is the reference (the shared disk's rate
drifts):

  disk_write_gib_s   sequential write + fsync of state_gib bytes (best of 3; all in disk_write_runs_gib_s)
  save_gib_s         blocking DCP save + CRC32C while writing + fsync + commit marker
  save_first_vs_disk save_gib_s / disk_write_gib_s; save_vs_adjacent_disk divides by the
                     mean of the two probes run just before and just after the save instead
  load_gib_s         verify (read + CRC32C) + DCP load, page cache dropped first (posix_fadvise DONTNEED)
  async_block_s      time the training loop is blocked by a thread-based async save (staging copy into
                     reused host buffers; async_block_first_s includes allocating them)
  step_s             one training step of this model (global batch x seq_len tokens, this CPU/GPU)
  async_block_steps  async_block_s / step_s (goal <= 1.0)
  emergency_s        request -> all ranks agree -> save -> commit marker written (the emergency path)

The emergency save against plain DCP (``FileSystemWriter``, fsync per file, no checksums, no commit) on
the same state and directory: DCP runs with 1, 2, 4 and 8 writer threads first and the fastest is
``dcp_best_threads``; then --pairs rounds, each a disk probe followed by one emergency save and one DCP
save with dcp_best_threads, back to back (their order alternates between rounds):

  save_vs_dcp_best   median over the rounds of dcp_time / emergency_time (goal >= 1.0), with its spread
                     (save_vs_dcp_best_min, _max) and every round's figure in save_vs_dcp_best_runs
  save_vs_disk       median over the rounds of emergency GiB/s / that round's disk probe (goal >= 0.9),
                     spread and runs likewise; emergency_gib_s is the median emergency save rate
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict

from trainer import dist as tdist
from trainer import store
from trainer.checkpoint import CheckpointManager
from trainer.emergency import EmergencyState, agree
from trainer.model import GPT, GPTConfig, per_sample_loss

GIB = 1 << 30


def disk_write_rate(directory: Path, nbytes: int, threads: int) -> float:
    """Sequential write of nbytes split over ``threads`` files written in parallel (as the checkpoint
    writer does with thread_count=threads), writeback started per 16 MiB chunk (posix_fadvise
    DONTNEED) and each file fsynced, like the save. GiB/s of wall time."""
    chunk = os.urandom(16 << 20)
    paths = [directory / f"probe{i}.bin" for i in range(threads)]

    def write(path: Path) -> None:
        with open(path, "wb") as f:
            left, done = nbytes // threads, 0
            while left > 0:
                n = f.write(chunk[: min(left, len(chunk))])
                left -= n
                f.flush()  # start writeback of each chunk at once, as the checkpoint writer does
                os.posix_fadvise(f.fileno(), done, n, os.POSIX_FADV_DONTNEED)
                done += n
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


def dcp_save_s(state: dict, directory: Path, threads: int, group: object) -> float:
    """Seconds of one plain DCP save of ``state`` (fsync per file) into a fresh directory, then removed."""
    d = Path(tempfile.mkdtemp(dir=directory))
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=FileSystemWriter(str(d), thread_count=threads, sync_files=True),
             process_group=group)
    dt = time.perf_counter() - t0
    shutil.rmtree(d)
    return dt


def emergency_save_s(mgr: CheckpointManager, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    """Seconds from a pending emergency request to the commit marker: agree, save, commit."""
    em = EmergencyState(None, 30.0)
    em.request_local("bench", deadline_ts=time.time() + 120)
    t0 = time.perf_counter()
    assert agree(em).stop
    mgr.save(step, model, opt, {"bench": True}, reason="preemption_notice", started=time.monotonic())
    dt = time.perf_counter() - t0
    store.rotate(mgr.root, mgr.keep)  # an emergency save leaves rotation to the next commit: done here, untimed
    return dt


def _spread(name: str, runs: list[float]) -> dict[str, object]:
    return {name: round(statistics.median(runs), 3), f"{name}_min": round(min(runs), 3),
            f"{name}_max": round(max(runs), 3), f"{name}_runs": [round(x, 3) for x in runs]}


def versus_dcp(mgr: CheckpointManager, model: torch.nn.Module, opt: torch.optim.Optimizer, work: Path,
               state_bytes: int, pairs: int, threads: int, group: object) -> dict[str, object]:
    """DCP's best thread count, then ``pairs`` rounds of probe + emergency save + best DCP save."""
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}  # what the manager saves
    dcp_dir = work / "dcp"
    dcp_dir.mkdir()
    by_threads = {t: dcp_save_s(state, dcp_dir, t, group) for t in (1, 2, 4, 8)}
    best = min(by_threads, key=lambda t: by_threads[t])
    vs_dcp, vs_disk, em_rates = [], [], []
    for i in range(pairs):
        probe = disk_write_rate(work, state_bytes, threads)
        if i % 2 == 0:
            em_s = emergency_save_s(mgr, 100 + i, model, opt)
            dcp_s = dcp_save_s(state, dcp_dir, best, group)
        else:
            dcp_s = dcp_save_s(state, dcp_dir, best, group)
            em_s = emergency_save_s(mgr, 100 + i, model, opt)
        vs_dcp.append(dcp_s / em_s)
        em_rates.append(state_bytes / em_s / GIB)
        vs_disk.append(em_rates[-1] / probe)
    return {"dcp_gib_s_by_threads": {t: round(state_bytes / s / GIB, 3) for t, s in by_threads.items()},
            "dcp_best_threads": best, "emergency_gib_s": round(statistics.median(em_rates), 3),
            **_spread("save_vs_dcp_best", vs_dcp), **_spread("save_vs_disk", vs_disk)}


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--state-gib", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=4,
                    help="DCP writer threads (files) per rank; the disk probe uses as many")
    ap.add_argument("--pairs", type=int, default=5, help="paired rounds emergency save vs best DCP")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--url", default=None, help="an object store (s3://, gs://, az://): its figures instead")
    ap.add_argument("--storage-options", default=None, help="JSON fsspec options for --url (endpoints)")
    ap.add_argument("--emulator", action="store_true", help="start --url's emulator on loopback first")
    return ap.parse_args()


def main() -> None:
    a = _args()
    if a.url:
        from checkpoint_objstore import run  # benchmarks/checkpoint_objstore.py, beside this script

        out = run(a, model_for(a.state_gib, a.seq_len))
        print(json.dumps(out) if a.json else "\n".join(f"{k:>18}: {v}" for k, v in out.items()), flush=True)
        os._exit(0)  # skip process-group teardown

    base = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=base))
    try:
        out = {**_local_figures(a, work), "dir": str(base)}
        print(json.dumps(out) if a.json else "\n".join(f"{k:>18}: {v}" for k, v in out.items()))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not a.dir:
            shutil.rmtree(base, ignore_errors=True)
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown


def _local_figures(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Saves (first, emergency, async), a load and the paired DCP rounds on the disk under ``work``."""
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
    mgr = CheckpointManager(f"file://{work / 'ckpt'}", info, keep=2, async_mode="thread", thread_count=a.threads)
    t0 = time.perf_counter()
    mgr.save(1, model, opt, {"bench": True})
    save_s = time.perf_counter() - t0
    probes.append(disk_write_rate(work, state_bytes, a.threads))  # interleaved: the shared disk's rate drifts
    emergency_s, commit_dir = _emergency_save(mgr, model, opt)
    async_block_first_s, async_block_s = _async_blocks(mgr, model, opt, step)
    probes.append(disk_write_rate(work, state_bytes, a.threads))
    disk = max(probes)  # the disk at its best in this run: a conservative save_vs_disk
    drop_cache(work / "ckpt")
    t0 = time.perf_counter()
    chosen = mgr.resolve("latest")
    assert chosen is not None  # the saves above
    mgr.load(chosen, model, opt)
    load_s = time.perf_counter() - t0
    paired = versus_dcp(mgr, model, opt, work, state_bytes, a.pairs, a.threads, info.save_group)
    return {
        "state_gib": round(state_gib, 3),
        "disk_write_gib_s": round(disk, 3),
        "disk_write_runs_gib_s": [round(x, 3) for x in probes],
        "save_gib_s": round(state_gib / save_s, 3),
        "save_first_vs_disk": round(state_gib / save_s / disk, 3),
        "save_vs_adjacent_disk": round(state_gib / save_s / ((probes[0] + probes[1]) / 2), 3),
        "load_gib_s": round(state_gib / load_s, 3),
        "async_block_s": round(async_block_s, 3),
        "async_block_first_s": round(async_block_first_s, 3),
        "step_s": round(step_s, 3),
        "async_block_steps": round(async_block_s / step_s, 3),
        "emergency_s": round(emergency_s, 3),
        "emergency_commit_dir": commit_dir,
        **paired,
        "model_params": cfg.n_params(),
        "step_tokens": a.batch * a.seq_len,
        "writer_threads": a.threads,
        "device": torch.cuda.get_device_name() if info.is_gpu else "cpu",
    }


def _emergency_save(mgr: CheckpointManager, model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[float, str]:
    """The emergency path: the request is already there, agree (one all-reduce), save, commit."""
    em = EmergencyState(None, 30.0)
    em.request_local("bench", deadline_ts=time.time() + 120)
    t0 = time.perf_counter()
    verdict = agree(em)
    assert verdict.stop
    res = mgr.save(2, model, opt, {"bench": True}, reason="preemption_notice", started=time.monotonic())
    return time.perf_counter() - t0, res.dir_url


def _async_blocks(mgr: CheckpointManager, model: torch.nn.Module, opt: torch.optim.Optimizer,
                  step: Callable[[], float]) -> tuple[float, float]:
    """Async saves: the blocking part (staging) of the first, which allocates the reused host buffers, and
    of the second, the steady state every later periodic save sees; training goes on while each writes."""
    blocks = []
    for s in (3, 4):
        t0 = time.perf_counter()
        mgr.save_async(s, model, opt, {"bench": True})
        blocks.append(time.perf_counter() - t0)
        step()
        pending = mgr.pending
        assert pending is not None  # a thread-based save
        pending.future.result()
        mgr.settle(True, False)
    return blocks[0], blocks[1]


if __name__ == "__main__":
    main()
