"""The checkpoint benchmark on an object store (``benchmarks/checkpoint.py --url s3://|gs://|az://...``).

One process (world size 1, gloo), the same GPT as the local benchmark. In one run, against the same store:
--pairs rounds, each one emergency save (request -> agree -> save with --threads files in parallel,
checksummed while written -> commit marker created and read back) and one plain fsspec write of the same
number of bytes as --threads objects written in parallel (``pipe_file``, the store's own multipart/block
upload), in alternating order:

  emergency_gib_s    median emergency save rate (state bytes / seconds to the marker)
  fsspec_gib_s       median plain write rate of the same bytes
  save_vs_fsspec     median over rounds of fsspec_time / emergency_time (>= 1.0: the save is as fast as
                     writing the bytes), with its spread and every round's figure
  load_vs_stock      median over --pairs rounds of the stock reader's time / ours to load the last
                     checkpoint (DCP's FsspecReader: one ranged read per tensor slice; ours: each file in one
                     request, trainer/reader.py), with load_s and stock_load_s (medians)

``--emulator`` starts the URL's emulator on loopback first (moto's server, gcp-storage-emulator, Azurite:
tests/storage_emulators.py) with the URL's bucket; otherwise --storage-options (JSON) reaches the store and
credentials come from the environment's default chain.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import statistics
import time
import uuid
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.state_dict import get_state_dict

from trainer import dist as tdist
from trainer import storage, store
from trainer.checkpoint import CheckpointManager
from trainer.emergency import EmergencyState, agree
from trainer.model import GPT, per_sample_loss

GIB = 1 << 30


def _start_emulator(url: str) -> tuple[Any, dict[str, Any]]:
    from tests import storage_emulators as se

    kind, bucket = storage.scheme(url), url.split("://", 1)[1].split("/", 1)[0]
    started = {"s3": se.start_s3, "gs": se.start_gcs, "az": se.start_azurite}[kind](bucket)
    return started, started.options


def fsspec_write_s(url: str, opts: dict[str, Any], nbytes: int, threads: int) -> float:
    """Seconds to write ``nbytes`` as ``threads`` objects in parallel with plain ``pipe_file``, then removed."""
    fs = storage.filesystem(url, opts)
    base = storage.join(url, f"plain-{uuid.uuid4().hex[:8]}")
    blob = os.urandom(nbytes // threads)
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda i: fs.pipe_file(storage.path_of(storage.join(base, f"part{i}")), blob), range(threads)))
    dt = time.perf_counter() - t0
    fs.rm(storage.path_of(base), recursive=True)
    return dt


def emergency_s(mgr: CheckpointManager, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    em = EmergencyState(None, 30.0)
    em.request_local("bench", deadline_ts=time.time() + 600)
    t0 = time.perf_counter()
    assert agree(em).stop
    mgr.save(step, model, opt, {"bench": True}, reason="preemption_notice", started=time.monotonic())
    dt = time.perf_counter() - t0
    store.rotate(mgr.root, mgr.keep, mgr.storage_options, job_id=mgr.job_id)  # untimed, as in the local benchmark
    return dt


def load_figures(dir_url: str, opts: dict[str, Any], model: torch.nn.Module, opt: torch.optim.Optimizer,
                 pairs: int) -> dict[str, Any]:
    """Loading ``dir_url`` into the model and optimizer with our reader and with the stock one, alternating."""
    def once(reader: Any) -> float:
        msd, osd = get_state_dict(model, opt)
        t0 = time.perf_counter()
        dcp.load({"model": msd, "optim": osd}, storage_reader=reader)
        return time.perf_counter() - t0

    ours: list[float] = []
    stock: list[float] = []
    for i in range(pairs):
        order = [True, False] if i % 2 == 0 else [False, True]
        for mine in order:
            reader = (store.make_reader(dir_url, opts) if mine
                      else FsspecReader(dir_url, **storage.prepare(dir_url, opts)))
            (ours if mine else stock).append(once(reader))
    return {"load_s": round(statistics.median(ours), 3), "stock_load_s": round(statistics.median(stock), 3),
            "load_vs_stock": round(statistics.median([b / a for a, b in zip(ours, stock, strict=True)]), 3)}


def run(a: Any, cfg: Any) -> dict[str, Any]:
    """The object-store figures for ``a.url`` (argparse namespace of benchmarks/checkpoint.py)."""
    emulator, opts = _start_emulator(a.url) if a.emulator else (None, json.loads(a.storage_options or "{}"))
    try:
        info = tdist.init()
        torch.manual_seed(0)
        model = tdist.wrap_fsdp(GPT(cfg).to(info.device), info, bf16=info.is_gpu)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, 256, (a.batch, a.seq_len + 1), device=info.device)
        per_sample_loss(model(tokens[:, :-1]), tokens[:, 1:]).mean().backward()
        opt.step()  # creates the AdamW state
        state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
        root = storage.join(a.url.rstrip("/"), f"bench-{uuid.uuid4().hex[:8]}")
        mgr = CheckpointManager(root, info, keep=1, async_mode="off", storage_options=opts, thread_count=a.threads,
                                save_threads=a.threads, job_id="bench")
        mgr.claim_root("bench", adopt=False)
        ratios, em_rates, plain_rates = [], [], []
        for i in range(a.pairs):
            if i % 2 == 0:
                em = emergency_s(mgr, 100 + i, model, opt)
                plain = fsspec_write_s(a.url, opts, state_bytes, a.threads)
            else:
                plain = fsspec_write_s(a.url, opts, state_bytes, a.threads)
                em = emergency_s(mgr, 100 + i, model, opt)
            ratios.append(plain / em)
            em_rates.append(state_bytes / em / GIB)
            plain_rates.append(state_bytes / plain / GIB)
        loads = load_figures(store.step_dir(root, 100 + a.pairs - 1), opts, model, opt, a.pairs)
        storage.filesystem(root, opts).rm(storage.path_of(root), recursive=True)
        return {**loads, "url": a.url, "emulator": bool(a.emulator), "state_gib": round(state_bytes / GIB, 3),
                "emergency_gib_s": round(statistics.median(em_rates), 3),
                "fsspec_gib_s": round(statistics.median(plain_rates), 3),
                "save_vs_fsspec": round(statistics.median(ratios), 3), "save_vs_fsspec_min": round(min(ratios), 3),
                "save_vs_fsspec_max": round(max(ratios), 3), "save_vs_fsspec_runs": [round(r, 3) for r in ratios],
                "writer_threads": a.threads, "model_params": cfg.n_params()}
    finally:
        if emulator is not None:
            emulator.stop()
