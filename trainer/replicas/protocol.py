"""The replica holder's wire protocol: frames, keys, the authentication handshake (torch-free).

Role: the one definition the holder (``trainer.replicas.holder``), the ranks' client and the agent share.

Frames: a 4-byte big-endian length, a JSON header (msgspec; at most ``MAX_HEADER``), and for ``put`` and
``data`` a body of exactly ``nbytes`` bytes after it.

Operations (after the handshake): ``put{rank, step, world_size, nbytes, crc, certified}`` + body ->
``stored``; ``commit{step, world_size}`` -> ``committed`` (``certified`` and ``commit``: every rank's copy of that step
is over, the holder drops what is older); ``get{rank, step}`` -> ``data`` + body or ``absent``; ``list``
-> ``inventory``; ``stats``; the agent's ``generation{generation}``; any refusal -> ``refused{reason}``.

Keys. orchd issues one random secret per job (``StartGenerationCmd.replica_secret``, sent on the node's
own command subject). The agent hands its holder the secret and the ranks only the key of their
generation, ``generation_key(secret, G) = HMAC-SHA256(secret, "orch-replica-gen|<G>")``: a rank of an
older generation holds an older key, so it cannot speak for the current one. The agent tells the holder
the current generation (its commands are fenced by orchd's fencing token); the holder refuses a client of
another job, of another generation, or one whose MAC is wrong, and counts each refusal.

Handshake (mutual): holder -> ``hello{job, nonce}``; client -> ``auth{job, generation, role, cnonce, mac}``
with ``mac = HMAC(key, "c|<nonce>|<job>|<generation>|<role>")`` (key: the generation key for ``role="rank"``,
the job secret for ``role="agent"``); holder -> ``ok{mac}`` with ``HMAC(key, "s|<cnonce>|<job>|<generation>")``
(the client checks it: a holder of another job cannot pose as this one's) or ``refused{reason}``.

The channel is authenticated, not encrypted: a replica's bytes carry a CRC32C against corruption, not
against a forger on the path (see docs/trainer.md, Replicas).
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
from typing import Any, Final

import msgspec

MAX_HEADER: Final = 64 * 1024
LEN = struct.Struct(">I")
ROLE_RANK: Final = "rank"
ROLE_AGENT: Final = "agent"

ENV_HOLDER: Final = "ORCH_REPLICA_HOLDER"  # host:port of this node's holder
ENV_KEY: Final = "ORCH_REPLICA_KEY"  # hex generation key
ENV_EVERY: Final = "ORCH_REPLICA_EVERY"  # replicate every k steps (0/unset: off)
ENV_STEP: Final = "ORCH_REPLICA_STEP"  # resume from this replicated step (orchd's choice), else the durable one
ENV_BUDDY: Final = "ORCH_REPLICA_BUDDY"  # the node (its node rank) whose holder keeps this node's second copies


class ProtocolError(Exception):
    """A malformed or refused exchange."""


def generation_key(secret: str, generation: int) -> bytes:
    return hmac.new(secret.encode(), f"orch-replica-gen|{generation}".encode(), hashlib.sha256).digest()


def mac(key: bytes, *parts: object) -> str:
    return hmac.new(key, "|".join(str(p) for p in parts).encode(), hashlib.sha256).hexdigest()


def same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def encode_frame(header: dict[str, Any]) -> bytes:
    body = msgspec.json.encode(header)
    if len(body) > MAX_HEADER:
        raise ProtocolError(f"header of {len(body)} bytes")
    return LEN.pack(len(body)) + body


def decode_header(body: bytes) -> dict[str, Any]:
    try:
        out = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"undecodable header: {e}") from None
    if not isinstance(out, dict) or not isinstance(out.get("op"), str):
        raise ProtocolError("header is not an object with an op")
    return out


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes (one buffer, filled in place) or ProtocolError when the peer closed first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)  # one wake-up, not one per segment
        if k == 0:
            raise ProtocolError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf) if n < (1 << 16) else buf  # type: ignore[return-value]


def recv_header(sock: socket.socket) -> dict[str, Any]:
    (n,) = LEN.unpack(recv_exact(sock, 4))
    if n > MAX_HEADER:
        raise ProtocolError(f"header of {n} bytes")
    return decode_header(bytes(recv_exact(sock, n)))


def int_field(h: dict[str, Any], name: str, lo: int = 0, hi: int = 1 << 62) -> int:
    v = h.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ProtocolError(f"bad {name}: {str(v)[:40]!r}")
    return v
