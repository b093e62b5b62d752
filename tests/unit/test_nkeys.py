"""nkeys and JWTs of the auth callout (orchestrator/nkeys.py): encoding, interop vector, tampering."""

from __future__ import annotations

import pytest

from orchestrator.security.nkeys import KeyPair, NkeyError, decode_jwt, decode_public, encode_jwt

# An account public key published in the NATS documentation's auth callout example (nats-by-example).
DOC_ACCOUNT_KEY = "ABJHLOVMPA4CI6R5KLNGOB4GSLNIY7IOUPAJC4YFNDLQVIOBYQGUWVLA"


def test_seed_round_trip_and_prefixes() -> None:
    kp = KeyPair.create("account")
    assert kp.public_key.startswith("A") and len(kp.public_key) == 56
    assert kp.seed.startswith("SA") and len(kp.seed) == 58
    again = KeyPair.from_seed(kp.seed + "\n")
    assert again.public_key == kp.public_key and again.kind == "account"
    assert kp.seed not in repr(kp)
    assert KeyPair.create("user").seed.startswith("SU")


def test_a_published_key_decodes_and_a_typo_does_not() -> None:
    kind, raw = decode_public(DOC_ACCOUNT_KEY)
    assert kind == "account" and len(raw) == 32
    typo = DOC_ACCOUNT_KEY[:10] + ("B" if DOC_ACCOUNT_KEY[10] != "B" else "C") + DOC_ACCOUNT_KEY[11:]
    with pytest.raises(NkeyError, match="checksum"):
        decode_public(typo)
    with pytest.raises(NkeyError):
        KeyPair.from_seed(DOC_ACCOUNT_KEY)  # a public key is not a seed


def test_jwt_round_trip_and_tampering() -> None:
    issuer = KeyPair.create("account")
    token = encode_jwt({"sub": "UABC", "nats": {"type": "user", "version": 2}}, issuer, now=1000)
    claims = decode_jwt(token, issuer_kind="account")
    assert claims["iss"] == issuer.public_key and claims["iat"] == 1000 and claims["jti"]
    head, payload, sig = token.split(".")
    forged = encode_jwt({"sub": "UEVIL", "nats": {"type": "user", "version": 2}}, KeyPair.create("account"))
    with pytest.raises(NkeyError, match="signature"):
        decode_jwt(f"{head}.{forged.split('.')[1]}.{sig}")  # someone else's claims under our signature
    with pytest.raises(NkeyError, match="expected server"):
        decode_jwt(token, issuer_kind="server")
    with pytest.raises(NkeyError, match="malformed"):
        decode_jwt("not.a.jwt")
