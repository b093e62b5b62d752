"""Encoding and decoding of wire records: ``encode``, ``decode`` (raises ``WireError`` with a short
machine-readable ``reason`` so callers can count rejections by cause).

Typing: ``decode(data)`` accepts any of ``WIRE_TYPES`` and returns ``AnyWire``; ``decode(data, Heartbeat)``
(one record class, wire or admin) returns ``Heartbeat``. ``decode(data, NodeEvent)`` (a ``X | Y`` union
of records) checks the union at run time, but a type checker cannot carry a union's members through a
value (no ``TypeForm`` yet), so it returns ``Any``: annotate the target,
``cmd: AgentCommand = decode(data, AgentCommand)``.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import types
from typing import Any, Final, TypeAlias, TypeVar, get_args, overload

import msgspec

from wire.messages import MAX_MESSAGE_BYTES, SUPPORTED_VERSIONS, AgentCommand, ToOrchd

AnyWire: TypeAlias = ToOrchd | AgentCommand
"""Every record ``decode`` accepts by default (tagged by ``type``)."""

WIRE_TYPES: Final[tuple[type[msgspec.Struct], ...]] = get_args(AnyWire)
"""The members of ``AnyWire``, in that order."""


M = TypeVar("M", bound=msgspec.Struct)


class WireError(ValueError):
    """A message that cannot be accepted. ``reason`` is a short label used for rejection counters."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


_encoder = msgspec.json.Encoder()
# One decoder per kind (a record class or a union); msgspec's Decoder of a union is Decoder[Any].
_decoders: dict[type[msgspec.Struct] | types.UnionType, msgspec.json.Decoder[Any]] = {}


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


@overload
def decode(data: bytes) -> AnyWire: ...
@overload
def decode(data: bytes, kind: type[M]) -> M: ...
@overload
def decode(data: bytes, kind: types.UnionType) -> Any: ...
def decode(data: bytes, kind: type[msgspec.Struct] | types.UnionType = AnyWire) -> msgspec.Struct:
    """Decode ``data`` as ``kind`` (a record class or a union of wire records); raise WireError on any
    problem (too large, bad JSON, unknown type, bad schema, unsupported ``v``, ``too_deep``: nesting
    beyond the interpreter's recursion limit, which msgspec reports as ``RecursionError``)."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError("too_large", f"{len(data)} bytes > {MAX_MESSAGE_BYTES}")
    dec = _decoders.get(kind)
    if dec is None:
        dec = _decoders[kind] = msgspec.json.Decoder(kind)
    try:
        msg: msgspec.Struct = dec.decode(data)
    except msgspec.DecodeError as e:
        text = str(e)
        if "Invalid value" in text and "type" in text:
            reason = "unknown_type"
        elif text.startswith("JSON is malformed") or "malformed" in text or "truncated" in text:
            reason = "bad_json"
        else:
            reason = "bad_schema"
        raise WireError(reason, text) from None
    except RecursionError:  # e.g. 2 KB of "[[[[..." in an ignored field: not a DecodeError in msgspec
        raise WireError("too_deep", f"nesting too deep in {len(data)} bytes") from None
    version = getattr(msg, "v", None)  # every wire and admin record has ``v``; msgspec.Struct does not
    if version not in SUPPORTED_VERSIONS:
        raise WireError("bad_version", f"schema version {version} not in {sorted(SUPPORTED_VERSIONS)}")
    return msg


def to_builtins(msg: msgspec.Struct) -> Any:
    return msgspec.to_builtins(msg)
