"""NATS nkeys and JWTs, as much as the auth callout needs (ed25519 through ``cryptography``).

Role: the encoding the nats-server expects for an account signing key (``A...`` public key,
``SA...`` seed) and for the ``ed25519-nkey`` JWTs of an auth callout exchange: the server's
authorization request (signed by the server's ``N...`` key: verified here), the user JWT and the
authorization response (signed by our account key).

An nkey is base32 (no padding) of ``prefix byte(s) + raw key + CRC-16/XMODEM`` (little-endian); a seed
carries two prefix bytes (``S`` and the key type). Pure functions and one small class; no I/O.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import time
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

PREFIX_SEED = 18 << 3  # "S"
PREFIX = {"account": 0, "server": 13 << 3, "operator": 14 << 3, "user": 20 << 3}  # "A", "N", "O", "U"
_JWT_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}


class NkeyError(ValueError):
    """A malformed key, seed or JWT, or a signature that does not verify."""


def _b32(raw: bytes) -> str:
    return base64.b32encode(raw).decode().rstrip("=")


def _checked(text: str) -> bytes:
    try:
        raw = base64.b32decode(text + "=" * (-len(text) % 8))
    except (binascii.Error, ValueError):
        raise NkeyError("not base32") from None
    body, crc = raw[:-2], raw[-2:]
    if len(raw) < 3 or binascii.crc_hqx(body, 0).to_bytes(2, "little") != crc:
        raise NkeyError("bad checksum")
    return body


def _with_crc(body: bytes) -> str:
    return _b32(body + binascii.crc_hqx(body, 0).to_bytes(2, "little"))


def encode_public(kind: str, raw: bytes) -> str:
    return _with_crc(bytes([PREFIX[kind]]) + raw)


def decode_public(key: str) -> tuple[str, bytes]:
    """(kind, raw 32-byte ed25519 public key) of an nkey public key."""
    body = _checked(key)
    kinds = {v: k for k, v in PREFIX.items()}
    if body[0] not in kinds or len(body) != 33:
        raise NkeyError(f"not an nkey public key: {key[:8]}...")
    return kinds[body[0]], body[1:]


class KeyPair:
    """An ed25519 key pair of one nkey kind (``account`` for the callout issuer)."""

    def __init__(self, kind: str, raw_seed: bytes) -> None:
        if kind not in PREFIX or len(raw_seed) != 32:
            raise NkeyError(f"bad {kind} seed")
        self.kind = kind
        self._sk = Ed25519PrivateKey.from_private_bytes(raw_seed)
        self._raw_seed = raw_seed
        self.public_key = encode_public(kind, self._sk.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))

    @classmethod
    def create(cls, kind: str) -> KeyPair:
        return cls(kind, os.urandom(32))

    @classmethod
    def from_seed(cls, seed: str) -> KeyPair:
        body = _checked(seed.strip())
        if len(body) != 34 or body[0] & 0xF8 != PREFIX_SEED:
            raise NkeyError("not an nkey seed")
        prefix = ((body[0] & 7) << 5) | ((body[1] & 0xF8) >> 3)
        kind = next((k for k, v in PREFIX.items() if v == prefix), None)
        if kind is None:
            raise NkeyError("unknown seed type")
        return cls(kind, body[2:])

    @property
    def seed(self) -> str:
        p = PREFIX[self.kind]
        return _with_crc(bytes([PREFIX_SEED | (p >> 5), (p & 31) << 3]) + self._raw_seed)

    def sign(self, data: bytes) -> bytes:
        return self._sk.sign(data)

    def __repr__(self) -> str:  # never the seed
        return f"KeyPair({self.kind}, {self.public_key})"


def _b64u(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64u(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def encode_jwt(claims: dict[str, Any], signer: KeyPair, now: float | None = None) -> str:
    """A JWT of ``claims`` issued (``iss``) and signed by ``signer``; ``iat`` and ``jti`` are filled in."""
    body = dict(claims, iss=signer.public_key)
    body.setdefault("iat", int(now if now is not None else time.time()))
    body["jti"] = _b32(hashlib.sha256(json.dumps(body, sort_keys=True).encode()).digest())
    head = _b64u(json.dumps(_JWT_HEADER).encode())
    payload = _b64u(json.dumps(body, separators=(",", ":")).encode())
    return f"{head}.{payload}.{_b64u(signer.sign(f'{head}.{payload}'.encode()))}"


def decode_jwt(token: str, *, issuer_kind: str | None = None) -> dict[str, Any]:
    """The claims of a JWT whose signature verifies against its ``iss`` nkey (of ``issuer_kind``)."""
    try:
        head, payload, sig = token.strip().split(".")
        if json.loads(_unb64u(head)).get("alg") != _JWT_HEADER["alg"]:
            raise NkeyError("not an ed25519-nkey JWT")
        claims = json.loads(_unb64u(payload))
        kind, raw = decode_public(claims["iss"])
        if issuer_kind is not None and kind != issuer_kind:
            raise NkeyError(f"issued by a {kind} key, expected {issuer_kind}")
        Ed25519PublicKey.from_public_bytes(raw).verify(_unb64u(sig), f"{head}.{payload}".encode())
    except InvalidSignature:
        raise NkeyError("bad signature") from None
    except (ValueError, KeyError, TypeError, binascii.Error) as e:
        if isinstance(e, NkeyError):
            raise
        raise NkeyError(f"malformed JWT: {type(e).__name__}") from None
    return claims
