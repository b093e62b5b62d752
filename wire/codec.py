"""Encoding and decoding of wire records: ``encode``, ``decode`` (raises ``WireError`` with a short
machine-readable ``reason`` so callers can count rejections by cause).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from typing import Any, Final, Union

import msgspec

from wire.messages import (
    MAX_MESSAGE_BYTES,
    SUPPORTED_VERSIONS,
    AbandonGenerationCmd,
    CheckpointCmd,
    CheckpointCommitted,
    CommandAck,
    DrainCmd,
    GenerationStarted,
    Heartbeat,
    NodeLeaving,
    NodeRegistered,
    PreemptionNotice,
    PriceTick,
    RanksExited,
    StartGenerationCmd,
    StopCmd,
)

WIRE_TYPES: Final[tuple[type, ...]] = (
    PriceTick,
    PreemptionNotice,
    Heartbeat,
    NodeRegistered,
    GenerationStarted,
    CheckpointCommitted,
    RanksExited,
    NodeLeaving,
    CheckpointCmd,
    StartGenerationCmd,
    StopCmd,
    AbandonGenerationCmd,
    DrainCmd,
    CommandAck,
)

AnyWire = Union[WIRE_TYPES]  # type: ignore[valid-type]


class WireError(ValueError):
    """A message that cannot be accepted. ``reason`` is a short label used for rejection counters."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, kind: Any = AnyWire) -> Any:
    """Decode ``data`` as ``kind`` (a wire type or a Union of them); raise WireError on any problem."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError("too_large", f"{len(data)} bytes > {MAX_MESSAGE_BYTES}")
    dec = _decoders.get(kind)
    if dec is None:
        dec = _decoders[kind] = msgspec.json.Decoder(kind)
    try:
        msg = dec.decode(data)
    except msgspec.DecodeError as e:
        text = str(e)
        if "Invalid value" in text and "type" in text:
            reason = "unknown_type"
        elif text.startswith("JSON is malformed") or "malformed" in text or "truncated" in text:
            reason = "bad_json"
        else:
            reason = "bad_schema"
        raise WireError(reason, text) from None
    if msg.v not in SUPPORTED_VERSIONS:
        raise WireError("bad_version", f"schema version {msg.v} not in {sorted(SUPPORTED_VERSIONS)}")
    return msg


def to_builtins(msg: msgspec.Struct) -> Any:
    return msgspec.to_builtins(msg)
