"""A replica step restored by a world of another size: each new rank takes its slice of every tensor from
the old ranks' shards, the way DCP's planner reshards a durable checkpoint.

Role: used by ``Replicator.restore`` when the complete replica step orchd chose was made by a world of
another size (a node vanished and the next generation starts on the survivors). A replica records, per
sharded tensor (a DTensor: FSDP2's parameters and the optimizer's moments), where its local block lies in
the global tensor (``chunk_of``: DCP's own ``__create_chunk_list__``). A new rank knows its own blocks; for
each old rank's replica (decoded one at a time, so a rank holds at most one old shard besides its own
state) it copies the intersection of the two blocks. Tensors that are not sharded (buffers, DDP's
replicated state, the optimizer's step counter) come from old rank 0's replica, as do the param groups and
the extra state (step, data position, scheduler; the same rule as a resharded durable load, RNG streams
then offset per rank). Every element of every target must be covered exactly once, else the restore
raises and the ranks exit ``replica_unusable``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from trainer.extra_state import set_rng_state

Chunk = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) of a local block in the global tensor


def chunk_of(t: torch.Tensor) -> Chunk:
    """Where ``t``'s local block lies in its global tensor (the whole tensor when it is not a DTensor)."""
    if isinstance(t, DTensor):
        chunks = t.__create_chunk_list__()
        if len(chunks) != 1:
            raise ValueError(f"a DTensor with {len(chunks)} local chunks")
        return tuple(int(x) for x in chunks[0].offsets), tuple(int(x) for x in chunks[0].sizes)
    return (0,) * t.dim(), tuple(int(x) for x in t.shape)


def copy_overlap(dst: torch.Tensor, dst_chunk: Chunk, src: torch.Tensor, src_chunk: Chunk) -> int:
    """Copy the part of ``src`` (the block ``src_chunk`` of the global tensor) that lies in ``dst``'s block;
    the number of elements copied."""
    (d_off, d_size), (s_off, s_size) = dst_chunk, src_chunk
    if len(d_off) != len(s_off) or tuple(src.shape) != s_size or tuple(dst.shape) != d_size:
        raise ValueError(f"replica of another shard layout: {tuple(src.shape)} at {s_off} vs {d_size} at {d_off}")
    dst_idx, src_idx, n = [], [], 1
    for do, ds, so, ss in zip(d_off, d_size, s_off, s_size, strict=True):
        lo, hi = max(do, so), min(do + ds, so + ss)
        if hi <= lo:
            return 0
        dst_idx.append(slice(lo - do, hi - do))
        src_idx.append(slice(lo - so, hi - so))
        n *= hi - lo
    dst[tuple(dst_idx)].copy_(src[tuple(src_idx)])
    return n


class Target:
    """One tensor of the new rank: its local block, what covered it so far."""

    def __init__(self, local: torch.Tensor, chunk: Chunk) -> None:
        self.local, self.chunk = local, chunk
        self.covered = 0
        self.seen: set[Chunk] = set()

    def take(self, src: torch.Tensor, src_chunk: Chunk) -> None:
        if src_chunk in self.seen:  # a replicated block (DDP, a replicated mesh dim): once is enough
            return
        self.seen.add(src_chunk)
        self.covered += copy_overlap(self.local, self.chunk, src, src_chunk)

    def complete(self) -> bool:
        return self.covered == math.prod(self.chunk[1])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Resharder:
    """Feed it every old rank's decoded replica (``add``, old rank 0 first), then ``finish``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, rank: int) -> None:
        self.model, self.optimizer, self.rank = model, optimizer, rank
        self.targets = {f"m.{k}": Target(_local(v), chunk_of(v)) for k, v in model.state_dict().items()}
        self.model_keys = set(self.targets)
        self.params = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
        self.optim: dict[str, Any] | None = None  # old rank 0's optimizer state, sharded tensors replaced
        self.extra: dict[str, Any] | None = None
        self.added = 0

    def add(self, saved: dict[str, Any]) -> None:
        layout = saved.get("layout")
        if not isinstance(layout, dict):
            raise ValueError("replica without a shard layout")
        if self.model_keys != {f"m.{k}" for k in saved["model"]}:
            raise ValueError("replica of another model: state keys differ")
        with torch.no_grad():
            for k, src in saved["model"].items():
                key = f"m.{k}"
                self.targets[key].take(src, _chunk(layout, key, src))
            if self.optimizer is not None and saved["optim"] is not None:
                self._add_optim(saved["optim"], layout)
        if self.extra is None:
            self.extra = saved["extra"]
        self.added += 1

    def _add_optim(self, o: dict[str, Any], layout: dict[str, Chunk]) -> None:
        sharded = {(int(idx), str(k)) for idx, k in o["dtensors"]}
        if self.optim is None:
            self.optim = {"state": {int(i): dict(e) for i, e in o["state"].items()}, "param_groups": o["param_groups"],
                          "sharded": sharded}
        for idx, entry in o["state"].items():
            for k, src in entry.items():
                if (int(idx), k) not in sharded:
                    continue  # not sharded: old rank 0's value (kept above)
                if int(idx) >= len(self.params):
                    raise ValueError("replica of another optimizer: more parameters")
                key = f"o.{idx}.{k}"
                target = self.targets.get(key)
                if target is None:
                    p = self.params[int(idx)]
                    c = chunk_of(p)
                    target = self.targets[key] = Target(torch.empty(c[1], dtype=src.dtype), c)
                target.take(src, _chunk(layout, key, src))

    def finish(self) -> dict[str, Any]:
        """Install the optimizer state, restore the RNG streams; the extra state of old rank 0."""
        missing = [k for k, t in self.targets.items() if not t.complete()]
        if missing or self.extra is None:
            raise ValueError(f"the old shards do not cover {missing[:3]} ({len(missing)} tensors)")
        if self.optimizer is not None and self.optim is not None:
            state = self.optim["state"]
            for idx, k in self.optim["sharded"]:
                p = self.params[idx]
                local = self.targets[f"o.{idx}.{k}"].local.to(_local(p).device)
                state[idx][k] = (DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                                    shape=p.shape, stride=p.stride())
                                 if isinstance(p, DTensor) else local)
            self.optimizer.load_state_dict({"state": state, "param_groups": self.optim["param_groups"]})
        set_rng_state(self.extra["rng"])
        # a different world: old rank 0's streams, offset per rank so ranks do not share one (as trainer.checkpoint)
        torch.manual_seed(int(torch.randint(0, 2**62, (1,)).item()) + self.rank)
        return self.extra


def _chunk(layout: dict[str, Chunk], key: str, src: torch.Tensor) -> Chunk:
    c = layout.get(key)
    if c is None:
        return (0,) * src.dim(), tuple(int(x) for x in src.shape)
    return tuple(int(x) for x in c[0]), tuple(int(x) for x in c[1])
