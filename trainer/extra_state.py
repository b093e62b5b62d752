"""The per-rank extra state of a checkpoint (step, data position, scheduler, RNG, config), without pickle.

Role: encode and decode ``__extra_<rank>.pt``. New checkpoints hold ``torch.save`` of plain containers,
numbers, strings and tensors, and are read back with ``torch.load(weights_only=True)`` (torch's restricted
unpickler: no arbitrary globals). The encoder round-trips the payload through the same restricted loader,
so state that a resume could not read fails at save time, not at resume time.

Checkpoints of the previous release hold ``__extra_<rank>.pkl`` (plain ``pickle.dumps``). Those are read
by :class:`_LegacyUnpickler`, which resolves only the few globals that file format uses (OrderedDict,
numpy arrays and dtypes, torch tensors rebuilt from bytes loaded with ``weights_only=True``); any other
global is refused. Never a plain ``pickle.load`` of bytes from storage.
"""

from __future__ import annotations

import collections
import io
import pickle
import random
from typing import Any

import numpy as np
import torch


class UnsafeExtraState(pickle.UnpicklingError):
    """The legacy extra-state file references a global outside the allow-list."""


def _reconstruct(subtype: Any, shape: Any, dtype: Any) -> Any:
    if subtype is not np.ndarray:
        raise UnsafeExtraState(f"ndarray subtype {subtype!r} not allowed")
    return np.ndarray.__new__(np.ndarray, shape, dtype)


def _tensor_from_bytes(b: bytes) -> Any:
    return torch.load(io.BytesIO(b), weights_only=True)


def _dtype(*args: Any) -> np.dtype:
    return np.dtype(*args)


def _scalar(dtype: np.dtype, data: bytes) -> Any:
    return np.frombuffer(data, dtype=dtype, count=1)[0]


_ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): _dtype,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch.storage", "_load_from_bytes"): _tensor_from_bytes,  # torch's own calls weights_only=False
}
for _mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
    _ALLOWED[(_mod, "_reconstruct")] = _reconstruct
    _ALLOWED[(_mod, "scalar")] = _scalar


class _LegacyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise UnsafeExtraState(f"global {module}.{name} not allowed in extra state") from None


def encode(payload: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(payload, buf)
    body = buf.getvalue()
    try:
        torch.load(io.BytesIO(body), weights_only=True)
    except Exception as e:  # e.g. a user_state object that is not plain data
        raise TypeError(f"checkpoint extra state must be plain containers, numbers, strings and tensors: {e}") from e
    return body


def decode(name: str, body: bytes) -> dict[str, Any]:
    """Extra state from ``__extra_<rank>.pt`` (new) or ``.pkl`` (previous release)."""
    if name.endswith(".pkl"):
        out = _LegacyUnpickler(io.BytesIO(body)).load()
    else:
        out = torch.load(io.BytesIO(body), weights_only=True)
    if not isinstance(out, dict):
        raise ValueError(f"extra state {name} is a {type(out).__name__}, not a dict")
    return out


def rng_state() -> dict[str, Any]:
    """RNG states as plain data (the numpy key as a list of ints), loadable with ``weights_only``."""
    name, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {"python": random.getstate(),
                             "numpy": (name, np.asarray(key).tolist(), pos, has_gauss, gauss),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states written by :func:`rng_state` or by the previous release (numpy key as an ndarray)."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    name, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
