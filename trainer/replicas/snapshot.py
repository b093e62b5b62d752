"""A rank's shard as bytes and back: model and optimizer (the local shards of FSDP2's DTensors, DDP's
tensors), plus the extra state a checkpoint holds (step, data position, scheduler, RNG, config).

Role: what one replica is. ``Stager.capture`` copies the state into host buffers allocated once and reused
(on the training thread: one memcpy, like the async checkpoint's staging); ``encode`` serializes the copy
(``torch.save``, in the background thread); ``restore`` loads bytes back in place, at the same world size
and rank layout, read with ``weights_only=True``. ``layout`` records where each sharded tensor's local block
lies in the global tensor, so that a world of another size can take its slices (trainer.replicas.reshard).
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from trainer.extra_state import rng_state, set_rng_state
from trainer.replicas.reshard import Chunk, chunk_of


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


class Stager:
    """Host copies of the state, reused from one replica to the next (one replica in flight at a time)."""

    def __init__(self) -> None:
        self._buf: dict[str, torch.Tensor] = {}
        self.layout: dict[str, Chunk] = {}  # sharded tensors: their block in the global tensor

    def _copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        src = _local(t).detach()
        dst = self._buf.get(key)
        if dst is None or dst.shape != src.shape or dst.dtype != src.dtype:
            dst = self._buf[key] = torch.empty(src.shape, dtype=src.dtype, device="cpu",
                                               pin_memory=src.is_cuda)
            if isinstance(t, DTensor):
                self.layout[key] = chunk_of(t)
        dst.copy_(src, non_blocking=src.is_cuda)
        return dst

    def capture(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                extra: dict[str, Any]) -> dict[str, Any]:
        model_sd = {k: self._copy(f"m.{k}", v) for k, v in model.state_dict().items()}
        optim: dict[str, Any] | None = None
        if optimizer is not None:
            osd = optimizer.state_dict()
            state: dict[int, dict[str, Any]] = {}
            dtensors: list[list[Any]] = []
            for idx, entry in osd["state"].items():
                state[idx] = {}
                for k, v in entry.items():
                    if isinstance(v, torch.Tensor):
                        if isinstance(v, DTensor):
                            dtensors.append([idx, k])
                        v = self._copy(f"o.{idx}.{k}", v)
                    state[idx][k] = v
            optim = {"state": state, "param_groups": osd["param_groups"], "dtensors": dtensors}
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {"model": model_sd, "optim": optim, "extra": {**extra, "rng": rng_state()}, "layout": self.layout}


def encode(captured: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(captured, buf)
    return buf.getvalue()


def decode(body: bytes) -> dict[str, Any]:
    out = torch.load(io.BytesIO(body), weights_only=True)
    if not isinstance(out, dict) or not {"model", "optim", "extra"} <= set(out):
        raise ValueError("not a replica")
    return out


def restore(body: bytes, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Load a replica of this rank's shard into ``model`` and ``optimizer`` in place (same world size);
    returns its extra state (RNG restored)."""
    saved = decode(body)
    with torch.no_grad():
        current = model.state_dict()
        if set(current) != set(saved["model"]):
            raise ValueError("replica of another model: state keys differ")
        for k, v in current.items():
            dst = _local(v)
            if dst.shape != saved["model"][k].shape:
                raise ValueError(f"replica of another shard layout: {k} {tuple(saved['model'][k].shape)}")
            dst.copy_(saved["model"][k])
    if optimizer is not None and saved["optim"] is not None:
        o = saved["optim"]
        params = _params(optimizer)
        for idx, k in o["dtensors"]:
            p = params[idx]
            local = o["state"][idx][k].to(_local(p).device)
            o["state"][idx][k] = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                                    shape=p.shape, stride=p.stride())
        optimizer.load_state_dict({"state": o["state"], "param_groups": o["param_groups"]})
    extra = saved["extra"]
    set_rng_state(extra["rng"])
    return extra
