"""``nats.nkey_seed_file`` and ``nats.creds_file`` logins against a real nats-server.

nats-py signs the server's nonce with the ``nkeys`` package (its ``nkeys`` extra): without it both
logins die with ``ModuleNotFoundError: No module named 'nkeys'`` before reaching the server. Here:

* an nkey user (``users = [{nkey: U...}]``), logged in through the settings' ``nkey_seed_file``;
* a ``.creds`` file (user JWT + seed) on a server in operator mode (operator and account JWTs
  preloaded in a memory resolver), logged in through the settings' ``creds_file``;

both with orchctl's own connect path (``AdminClient.connect``): a round trip proves the login, and a
wrong seed is refused by the server.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from orchestrator.cli.client import AdminClient, AdminUnreachable
from orchestrator.natsserver import NatsServer
from orchestrator.security.nats_auth import User, orchctl_permissions, render_authorization
from orchestrator.security.nkeys import KeyPair, encode_jwt
from orchestrator.settings import NatsSettings

pytestmark = pytest.mark.anyio

_UNLIMITED = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True,
              "conn": -1, "leaf": -1}


def test_nats_py_has_its_nkeys_extra() -> None:
    assert importlib.util.find_spec("nkeys") is not None, "install nats-py[nkeys] (pyproject dependencies)"


def _server(root: Path, conf: str) -> NatsServer:
    (root / "server.conf").write_text(conf)
    return NatsServer(root / "srv", jetstream=False, config_file=str(root / "server.conf")).start()


async def _round_trip(urls: list[str], settings: NatsSettings) -> None:
    """Logged in: CONNECT answered by PONG (an authorization error would come first), and a
    subscription inside the role's inbox round-trips with the server."""
    c = await AdminClient.connect(urls, timeout_s=3.0, nats_settings=settings)
    try:
        await c.nc.subscribe("_INBOX.orchctl.check")
        await c.nc.flush(timeout=3)
        assert c.nc.is_connected and c.nc.last_error is None
    finally:
        await c.close()


async def test_nkey_seed_login(tmp_path: Path) -> None:
    user = KeyPair.create("user")
    seed = tmp_path / "orchctl.nk"
    seed.write_text(user.seed + "\n")
    auth = render_authorization([User(name="ops", nkey=user.public_key, permissions=orchctl_permissions())])
    server = _server(tmp_path, f"listen: \"127.0.0.1:-1\"\n{auth}")
    try:
        await _round_trip([server.url], NatsSettings(urls=(server.url,), nkey_seed_file=str(seed)))
        other = tmp_path / "other.nk"
        other.write_text(KeyPair.create("user").seed)
        with pytest.raises(AdminUnreachable, match="(?i)authoriz"):
            await AdminClient.connect([server.url], timeout_s=3.0,
                                      nats_settings=NatsSettings(urls=(server.url,), nkey_seed_file=str(other)))
    finally:
        server.cleanup()


def _creds(jwt: str, seed: str) -> str:
    return (f"-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n"
            "************************* IMPORTANT *************************\n"
            "NKEY Seed printed below can be used to sign and prove identity.\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n")


async def test_creds_file_login_in_operator_mode(tmp_path: Path) -> None:
    op, acc, user = KeyPair.create("operator"), KeyPair.create("account"), KeyPair.create("user")
    op_jwt = encode_jwt({"sub": op.public_key, "name": "op", "nats": {"type": "operator", "version": 2}}, op)
    acc_jwt = encode_jwt({"sub": acc.public_key, "name": "orch",
                          "nats": {"type": "account", "version": 2, "limits": _UNLIMITED}}, op)
    perms = orchctl_permissions()
    user_jwt = encode_jwt({"sub": user.public_key, "name": "ops", "nats": {
        "type": "user", "version": 2, "subs": -1, "data": -1, "payload": -1,
        "pub": {"allow": list(perms.publish)}, "sub": {"allow": list(perms.subscribe)}}}, acc)
    creds = tmp_path / "ops.creds"
    creds.write_text(_creds(user_jwt, user.seed))
    server = _server(tmp_path, f"listen: \"127.0.0.1:-1\"\noperator: {op_jwt}\nresolver: MEMORY\n"
                               f"resolver_preload: {{\n  {acc.public_key}: {acc_jwt}\n}}\n")
    try:
        await _round_trip([server.url], NatsSettings(urls=(server.url,), creds_file=str(creds)))
        # the same JWT with another user's seed: the nonce signature does not match
        creds.write_text(_creds(user_jwt, KeyPair.create("user").seed))
        with pytest.raises(AdminUnreachable, match="(?i)authoriz"):
            await AdminClient.connect([server.url], timeout_s=3.0,
                                      nats_settings=NatsSettings(urls=(server.url,), creds_file=str(creds)))
    finally:
        server.cleanup()
