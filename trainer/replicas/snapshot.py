"""A rank's shard as bytes and back: model and optimizer (the local shards of FSDP2's DTensors, DDP's
tensors), plus the extra state a checkpoint holds (step, data position, scheduler, RNG, config).

Role: what one replica is. ``Stager.capture`` copies the state into host buffers allocated once and reused
(on the training thread: one memcpy, like the async checkpoint's staging); ``encode`` serializes the copy
(in the background thread: a small ``torch.save``'d skeleton, then the tensors' raw bytes); ``restore``
loads bytes back in place at the same world size and rank layout (the skeleton read with
``weights_only=True``). ``layout`` records where each sharded tensor's local block lies in the global
tensor, so that a world of another size can take its slices (trainer.replicas.reshard).
"""

from __future__ import annotations

import io
import math
import struct
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


MAGIC = b"ORR1"
_HEAD = struct.Struct(">4sQ")  # magic, length of the skeleton
_REF = "__replica_tensor__"
BIG = 1  # tensors of at least this many bytes go raw after the skeleton; smaller ones stay in it


def _strip(x: Any, out: list[torch.Tensor]) -> Any:
    """``x`` with every tensor of >= BIG bytes replaced by a reference into ``out``."""
    if isinstance(x, torch.Tensor) and x.nbytes >= BIG:
        out.append(x)
        return {_REF: len(out) - 1}
    if isinstance(x, dict):
        return {k: _strip(v, out) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_strip(v, out) for v in x)
    return x


def encode(captured: dict[str, Any]) -> bytearray:
    """One buffer: a header, the skeleton (``torch.save`` of everything but the large tensors: small), then
    each large tensor's bytes as they are in memory. ``torch.save`` of the whole state pickled every tensor
    (tens of ms per replica on CPU); this is one memcpy per tensor."""
    tensors: list[torch.Tensor] = []
    skeleton = _strip(captured, tensors)
    meta = [(str(t.dtype).removeprefix("torch."), list(t.shape)) for t in tensors]
    head = io.BytesIO()
    torch.save({"skeleton": skeleton, "meta": meta}, head)
    starts, end = [], _HEAD.size + head.tell()
    for t in tensors:
        starts.append(_align(end))
        end = starts[-1] + t.nbytes
    buf = bytearray(end)
    _HEAD.pack_into(buf, 0, MAGIC, head.tell())
    buf[_HEAD.size:_HEAD.size + head.tell()] = head.getbuffer()
    view = torch.frombuffer(buf, dtype=torch.uint8)
    for t, pos in zip(tensors, starts, strict=True):
        view[pos:pos + t.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return buf


def _align(pos: int) -> int:
    """Each raw tensor starts at a multiple of 64 bytes (a view of any dtype needs its element size)."""
    return (pos + 63) & ~63


def _fill(x: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(x, dict):
        if set(x) == {_REF}:
            return tensors[int(x[_REF])]
        return {k: _fill(v, tensors) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_fill(v, tensors) for v in x)
    return x


def decode(body: bytes | bytearray) -> dict[str, Any]:
    """A replica back from ``encode``'s bytes (the skeleton read with ``weights_only=True``). Anything
    malformed raises ValueError."""
    if len(body) < _HEAD.size:
        raise ValueError("not a replica: too short")
    magic, n = _HEAD.unpack_from(body, 0)
    if magic != MAGIC or _HEAD.size + n > len(body):
        raise ValueError("not a replica: bad header")
    head = torch.load(io.BytesIO(memoryview(body)[_HEAD.size:_HEAD.size + n]), weights_only=True)
    whole = body if isinstance(body, bytearray) else bytearray(body)  # alive while ``raw`` is read
    raw = torch.frombuffer(whole, dtype=torch.uint8)
    pos, tensors = _HEAD.size + n, []
    for dtype, shape in head["meta"]:
        dt = getattr(torch, str(dtype), None)
        if not isinstance(dt, torch.dtype) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"not a replica: tensor {str(dtype)[:20]!r} {str(shape)[:40]}")
        nbytes, pos = math.prod(shape) * dt.itemsize, _align(pos)
        if pos + nbytes > len(raw):
            raise ValueError("not a replica: truncated")
        # a copy torch owns (a view would not keep ``body`` alive, and the RNG setters read a storage whole)
        tensors.append(raw[pos:pos + nbytes].view(dt).reshape(shape).clone())
        pos += nbytes
    if pos != len(raw):
        raise ValueError("not a replica: trailing bytes")
    out = _fill(head["skeleton"], tensors)
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
