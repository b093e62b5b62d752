"""A rank's shard as bytes and back: model and optimizer (the local shards of FSDP2's DTensors, DDP's
tensors), plus the extra state a checkpoint holds (step, data position, scheduler, RNG, config).

Role: what one replica is, and the one copy the training thread pays for it. ``Stager`` lays the state's
tensors out once in one host buffer, in the replica's wire layout, and reuses it; ``Stager.capture`` (on
the training thread) is one ``copy_`` per tensor into that buffer (one ``_foreach_copy_`` call) plus a
pickle of the small rest - the step, data position, scheduler, RNG and param groups, well under a
millisecond -, so that the snapshot is immutable once captured. The background thread then checksums the
buffer and sends it as it is (``Snapshot.parts``); CRC32C and the sockets run in C without the GIL.
``decode`` reads the bytes back; ``restore`` loads them in place at the same world size and rank layout.
``layout`` records where each sharded tensor's local block lies in the global tensor, so that a world of
another size can take its slices (trainer.replicas.reshard).

Wire layout (``ORR2``): a 32-byte head (magic, region length R, lengths of the two pickles), the tensors'
raw bytes at 64-byte aligned offsets up to R, the static pickle (each tensor's key, dtype, shape and offset,
and the layout: the same for every replica of one plan, pickled once) and the step's pickle. Both pickles
hold plain data only (small tensors as their bytes) and are read by an unpickler that resolves no global
but ``OrderedDict`` and ``small_tensor``: a replica can carry no code.

Concurrency: the buffer is written by ``capture`` and read by the sender; the replicator starts a capture
only when the previous replica's send is over on every rank.
"""

from __future__ import annotations

import collections
import io
import math
import operator
import pickle
import struct
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from trainer.extra_state import rng_state, set_rng_state
from trainer.replicas.reshard import Chunk, chunk_of

MAGIC = b"ORR2"
_HEAD = struct.Struct(">4sIQQQ")  # magic, spare, region length (head + tensors), static and step pickles
ALIGN = 64  # each raw tensor starts at a multiple of 64 bytes (a view of any dtype needs its element size)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard. ``_local_tensor`` is what ``DTensor.to_local()`` returns under no_grad (for a
    Parameter it returns a fresh view of it, which would defeat the identity check of ``Stager``)."""
    if isinstance(t, DTensor):
        local = getattr(t, "_local_tensor", None)
        return local if isinstance(local, torch.Tensor) else t.to_local()
    return t


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _align(pos: int) -> int:
    return (pos + ALIGN - 1) & ~(ALIGN - 1)


def small_tensor(dtype: str, shape: list[int], raw: bytes) -> torch.Tensor:
    """A small tensor of the step's pickle back from its bytes (the one function a replica's pickle may
    name)."""
    dt, shape = _dtype(dtype), _shape(shape)
    if not isinstance(raw, bytes) or len(raw) != math.prod(shape) * dt.itemsize:
        raise ValueError("not a replica: bad small tensor")
    return torch.frombuffer(bytearray(raw), dtype=dt).reshape(shape) if raw else torch.empty(shape, dtype=dt)


class _Pickler(pickle.Pickler):
    """Pickles a tensor as its bytes (``small_tensor``). ``reducer_override`` is not called for plain
    containers and numbers, so the RNG states' long tuples cost nothing extra."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            return small_tensor, (str(t.dtype).removeprefix("torch."), list(t.shape), raw)
        return NotImplemented


def _pickle(x: Any) -> bytes:
    out = io.BytesIO()
    _Pickler(out, protocol=5).dump(x)
    return out.getvalue()


def _dtype(name: Any) -> torch.dtype:
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"not a replica: dtype {str(name)[:20]!r}")
    return dt


def _shape(shape: Any) -> list[int]:
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"not a replica: shape {str(shape)[:40]}")
    return shape


_GLOBALS: dict[tuple[str, str], Any] = {("collections", "OrderedDict"): collections.OrderedDict,
                                        (__name__, "small_tensor"): small_tensor}


class _PlainUnpickler(pickle.Unpickler):
    """Plain data only: containers, numbers, strings, bytes, and small tensors as bytes; no other global."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _GLOBALS[(module, name)]
        except KeyError:
            raise ValueError(f"not a replica: global {module}.{name} refused") from None


def _unpickle(b: bytes | memoryview) -> Any:
    try:
        return _PlainUnpickler(io.BytesIO(b)).load()
    except (pickle.UnpicklingError, EOFError, TypeError, AttributeError, IndexError, KeyError) as e:
        raise ValueError(f"not a replica: {type(e).__name__}: {e}") from None


@dataclass(frozen=True, slots=True)
class _Slot:
    key: str  # "m.<state key>" or "o.<param index>.<state key>"
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int


@dataclass(slots=True)
class Snapshot:
    """One captured replica: the staging buffer (``region``: head + tensors, shared with the stager), the
    plan's static pickle and this step's."""

    step: int
    region: torch.Tensor  # uint8, the stager's buffer
    static: bytes
    dynamic: bytes
    copied: Any = None  # a CUDA event after the device-to-host copies (GPU): ``parts`` waits for it

    def parts(self) -> tuple[memoryview, bytes, bytes]:
        """The body as three buffers sent one after the other (the head is written into the region)."""
        if self.copied is not None:
            self.copied.synchronize()  # the background thread waits for the copies, not the training thread
        region = memoryview(self.region.numpy().data).cast("B")
        _HEAD.pack_into(region, 0, MAGIC, 0, len(region), len(self.static), len(self.dynamic))
        return region, self.static, self.dynamic


class Stager:
    """Host copies of the state in the wire layout, in one buffer reused from one replica to the next (one
    replica in flight at a time). The plan (slots, views, the static pickle) is rebuilt only when the
    tensors change: a first capture, a model or optimizer whose tensors were replaced or reshaped."""

    def __init__(self) -> None:
        self._slots: list[_Slot] = []
        self._sig: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...] = ()
        self._srcs: list[torch.Tensor] = []
        self._buf: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._static = b""
        self.layout: dict[str, Chunk] = {}  # sharded tensors: their block in the global tensor
        self.nbytes = 0  # the region: head + tensors
        self.rebuilt = 0  # plans made (the tests check that a steady run makes one)
        self._checked = 0  # the plan whose step pickle was read back once

    def _plan(self, keys: list[str], objs: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        sig = tuple((k, s.dtype, tuple(s.shape)) for k, s in zip(keys, srcs, strict=True))
        if sig == self._sig:  # the same layout, other tensors (e.g. an optimizer state loaded)
            self._srcs = srcs
            return
        pos, slots, layout = _align(_HEAD.size), [], {}
        for key, obj, src in zip(keys, objs, srcs, strict=True):
            slots.append(_Slot(key, src.dtype, tuple(src.shape), pos))
            pos = _align(pos + src.numel() * src.element_size())
            if isinstance(obj, DTensor):
                layout[key] = chunk_of(obj)
        buf = torch.zeros(pos, dtype=torch.uint8, pin_memory=any(s.is_cuda for s in srcs))
        self._views = [buf[s.offset:s.offset + math.prod(s.shape) * s.dtype.itemsize].view(s.dtype).view(s.shape)
                       for s in slots]
        meta = [(s.key, str(s.dtype).removeprefix("torch."), list(s.shape), s.offset) for s in slots]
        self._static = pickle.dumps({"meta": meta, "layout": layout}, protocol=5)
        self._slots, self._sig, self._srcs, self._buf, self.layout, self.nbytes = slots, sig, srcs, buf, layout, pos
        self.rebuilt += 1

    def capture(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                extra: dict[str, Any]) -> Snapshot:
        with torch.no_grad():
            keys: list[str] = []
            objs: list[torch.Tensor] = []
            model_rest: dict[str, Any] = {}
            for k, v in model.state_dict(keep_vars=True).items():  # the live tensors (no detach: cheap)
                if isinstance(v, torch.Tensor):
                    keys.append(f"m.{k}")
                    objs.append(v)
                else:
                    model_rest[k] = v
            optim: dict[str, Any] | None = None
            if optimizer is not None:
                osd = optimizer.state_dict()  # references to the live state; param groups packed anew
                state: dict[int, dict[str, Any]] = {}
                dtensors: list[list[Any]] = []
                for idx, entry in osd["state"].items():
                    state[idx] = {}
                    for k, v in entry.items():
                        if isinstance(v, torch.Tensor):
                            if isinstance(v, DTensor):
                                dtensors.append([idx, k])
                            keys.append(f"o.{idx}.{k}")
                            objs.append(v)
                        else:
                            state[idx][k] = v
                optim = {"state": state, "param_groups": osd["param_groups"], "dtensors": dtensors}
            srcs = [_local(t) for t in objs]
            if len(srcs) != len(self._srcs) or not all(map(operator.is_, srcs, self._srcs)):
                self._plan(keys, objs, srcs)
            copied = None
            if srcs:
                # on a GPU: device-to-host copies into pinned memory, queued on the current stream ahead of the
                # next step's kernels (which therefore see the state unchanged until they are done)
                torch._foreach_copy_(self._views, srcs, non_blocking=srcs[0].is_cuda)
                if srcs[0].is_cuda:
                    copied = torch.cuda.Event()
                    copied.record()
        try:
            dynamic = _pickle({"model_rest": model_rest, "optim": optim, "extra": {**extra, "rng": rng_state()}})
            if self._checked != self.rebuilt:  # once per plan: what a restore could not read fails here, loudly
                _unpickle(dynamic)
                self._checked = self.rebuilt
        except (ValueError, pickle.PicklingError, AttributeError, TypeError) as e:
            raise TypeError(f"replica state must be plain containers, numbers, strings and tensors: {e}") from e
        assert self._buf is not None
        return Snapshot(step, self._buf, self._static, dynamic, copied)


def encode(snap: Snapshot) -> bytes:
    """The whole body in one buffer (tests, tools; the replicator sends the parts as they are)."""
    return b"".join(bytes(x) for x in snap.parts())


def decode(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    """A replica back from its bytes; each tensor a copy torch owns. Anything malformed raises ValueError.
    Returns {"model": {key: tensor}, "optim": {"state", "param_groups", "dtensors"} | None, "extra",
    "layout"}."""
    view = memoryview(body).cast("B")
    if len(view) < _HEAD.size:
        raise ValueError("not a replica: too short")
    magic, _, r, s1, s2 = _HEAD.unpack_from(view, 0)
    if magic != MAGIC or r < _HEAD.size or r + s1 + s2 != len(view):
        raise ValueError("not a replica: bad header")
    static, dyn = _unpickle(view[r:r + s1]), _unpickle(view[r + s1:])
    if not isinstance(static, dict) or not isinstance(static.get("meta"), list) or not isinstance(dyn, dict):
        raise ValueError("not a replica: bad skeleton")
    raw = torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8)  # read-only: a copy
    tensors: dict[str, torch.Tensor] = {}
    end = _HEAD.size
    for item in static["meta"]:
        if not (isinstance(item, tuple) and len(item) == 4 and isinstance(item[0], str) and isinstance(item[3], int)):
            raise ValueError("not a replica: bad tensor entry")
        key, dt, shape, offset = item[0], _dtype(item[1]), _shape(item[2]), item[3]
        nbytes = math.prod(shape) * dt.itemsize
        if offset < end or offset % ALIGN or offset + nbytes > r:
            raise ValueError("not a replica: tensor outside its region")
        tensors[key] = raw[offset:offset + nbytes].view(dt).reshape(shape).clone()
        end = offset + nbytes
    model = {k[2:]: t for k, t in tensors.items() if k.startswith("m.")}
    model.update(dyn.get("model_rest") or {})
    optim = dyn.get("optim")
    if optim is not None:
        for key, t in tensors.items():
            if key.startswith("o."):
                idx, _, name = key[2:].partition(".")
                optim["state"].setdefault(int(idx), {})[name] = t
    extra = dyn.get("extra")
    if not isinstance(extra, dict) or (optim is not None and not isinstance(optim.get("state"), dict)):
        raise ValueError("not a replica")
    return {"model": model, "optim": optim, "extra": extra, "layout": static.get("layout") or {}}


def restore(body: bytes | bytearray | memoryview, model: torch.nn.Module,
            optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Load a replica of this rank's shard into ``model`` and ``optimizer`` in place (same world size);
    returns its extra state (RNG restored)."""
    saved = decode(body)
    with torch.no_grad():
        current = model.state_dict()
        if set(current) != set(saved["model"]):
            raise ValueError("replica of another model: state keys differ")
        for k, v in current.items():
            if not isinstance(v, torch.Tensor):
                continue
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
