"""Secrets from systemd credentials: orchd and orch-agent read ``$CREDENTIALS_DIRECTORY``.

systemd/orchd.service and orch-agent.service pass their NATS secrets with ``LoadCredential=`` (each with a
blank ``SetCredential=`` default, so a file a host does not have is no failure). The main test runs a real
orchd process against a real nats-server that requires TLS with client certificates and a password,
with a configuration that names the user and nothing secret: the password, the CA and the client
certificate and key come only from the credentials directory. The others pin the precedence (the
configuration's own value wins, a blank credential is absent) and the problems reported.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.config import load_config
from orchestrator.natsserver import NatsServer
from orchestrator.security.nats_auth import (
    NodeCredentialIssuer,
    TlsFiles,
    User,
    hash_password,
    orchd_permissions,
    render_server_config,
)
from orchestrator.settings import SettingsError, load_settings
from tests.conftest import IN_CI

ORCHD_PW = "orchd-credential-password"
ORCHD = str(Path(sys.executable).parent / "orchd")  # the installed console script


@pytest.fixture
def secure_server(tmp_path: Path):
    """nats-server with TLS (client certificates required, ``verify: true``) and a password user orchd."""
    if not IN_CI:
        pytest.importorskip("cryptography")
    from tests.ops.test_nats_security import _make_pki

    d = tmp_path / "nats"
    d.mkdir()
    pki = _make_pki(d)
    (d / "auth.conf").write_text(NodeCredentialIssuer(d / "unused.conf", reload=lambda: None, static_users=[
        User(name="orchd", password_hash=hash_password(ORCHD_PW), permissions=orchd_permissions())]).render())
    (d / "server.conf").write_text(render_server_config(
        host="127.0.0.1", port=-1, store_dir=None, http_port=None,
        tls=TlsFiles(cert_file=str(pki["server"]), key_file=str(pki["server_key"]), ca_file=str(pki["ca"]))))
    server = NatsServer(d / "srv", config_file=str(d / "server.conf")).start()
    yield server, pki
    server.cleanup()


def _credentials_dir(tmp_path: Path, pki: dict[str, Path]) -> Path:
    """What systemd would lay out for orchd.service on a TLS + password host: the password, the CA, the
    client certificate and key, and blank defaults (SetCredential=) for those this host has not."""
    c = tmp_path / "credentials"
    c.mkdir()
    (c / "nats.password").write_text(ORCHD_PW + "\n")
    (c / "nats-ca.pem").write_bytes(pki["ca"].read_bytes())
    (c / "nats-client.pem").write_bytes(pki["client"].read_bytes())
    (c / "nats-client.key").write_bytes(pki["client_key"].read_bytes())
    for blank in ("nats.creds", "callout-issuer.seed", "callout-auth.password"):
        (c / blank).write_text("\n")
    return c


def _config(tmp_path: Path, url: str) -> Path:
    cfg = tmp_path / "orchd.toml"
    cfg.write_text(f"""
[nats]
urls = ["{url.replace('nats://', 'tls://')}"]
user = "orchd"
connect_timeout_s = 2.0
[daemon]
state_dir = "{tmp_path / 'state'}"
[metrics]
port = 0
[log]
format = "json"
""")
    return cfg


def test_orchd_connects_with_secrets_only_from_the_credentials_directory(secure_server, tmp_path: Path) -> None:
    server, pki = secure_server
    cfg = _config(tmp_path, server.url)
    assert not any(s in cfg.read_text() for s in (ORCHD_PW, "pem", "key"))  # nothing secret in the file
    creds = _credentials_dir(tmp_path, pki)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
    env["CREDENTIALS_DIRECTORY"] = str(creds)
    discovery = tmp_path / "state" / "orchd.json"
    log = tmp_path / "orchd.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([ORCHD, "--config", str(cfg)],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not discovery.exists():  # written once the admin API answers
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "orchd not ready:\n" + log.read_text()[-3000:]
            time.sleep(0.1)
        assert json.loads(discovery.read_text())["nats_url"].startswith("tls://")
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert ORCHD_PW not in text  # the secret never reaches the log


def test_precedence_and_blank_credentials(tmp_path: Path) -> None:
    c = tmp_path / "creds"
    c.mkdir()
    (c / "nats.password").write_text("from-credential\n")
    (c / "nats-ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    (c / "nats.creds").write_text("\n")  # systemd's SetCredential= default: not given
    env = {"CREDENTIALS_DIRECTORY": str(c), "ORCH_NATS__USER": "orchd"}
    s = load_settings(None, env=env)
    assert s.nats.password == "from-credential" and s.nats.tls_ca_file == str(c / "nats-ca.pem")
    assert s.nats.creds_file == ""
    own = load_settings(None, env={**env, "ORCH_NATS__PASSWORD": "own", "ORCH_NATS__TLS_CA_FILE": "/etc/ca.pem"})
    assert (own.nats.password, own.nats.tls_ca_file) == ("own", "/etc/ca.pem")  # the configuration wins
    # the callout mode's files may come from the directory alone (no path in the settings)
    (c / "callout-issuer.seed").write_text("SA...\n")
    (c / "callout-auth.password").write_text("pw\n")
    (c / "users.json").write_text("[]")
    callout = load_settings(None, env={**env, "ORCH_NATS__URLS": "nats://n:4222", "ORCH_CREDENTIALS__ENABLED": "1",
                                       "ORCH_CREDENTIALS__MODE": "callout",
                                       "ORCH_CREDENTIALS__STATIC_USERS_FILE": str(c / "users.json")})
    assert callout.credentials.issuer_seed_file == str(c / "callout-issuer.seed")
    assert callout.credentials.auth_password_file == str(c / "callout-auth.password")
    # the agent: same names, same precedence, blank = absent
    agent = load_config(["--node-id", "n1"], {"CREDENTIALS_DIRECTORY": str(c)})
    assert (agent.nats_password, agent.nats_tls_ca_file, agent.nats_creds_file) == (
        "from-credential", str(c / "nats-ca.pem"), "")


def test_credential_problems_are_reported(tmp_path: Path) -> None:
    (tmp_path / "nats.password").write_text("pw")
    with pytest.raises(SettingsError) as e:
        load_settings(None, env={"CREDENTIALS_DIRECTORY": str(tmp_path / "missing")})
    assert "CREDENTIALS_DIRECTORY" in str(e.value) and "is not a directory" in str(e.value)
    with pytest.raises(SettingsError) as e:  # a password nobody would use: no user named
        load_settings(None, env={"CREDENTIALS_DIRECTORY": str(tmp_path)})
    assert "nats.password" in str(e.value) and "nats.user" in str(e.value)


def test_units_load_only_optional_credentials() -> None:
    """Every LoadCredential= of both units has a SetCredential= default, so no host is refused for a
    credential its role does not have (an enrolled agent has no password file)."""
    units = Path(__file__).resolve().parents[2] / "systemd"
    for unit in ("orchd.service", "orch-agent.service"):
        lines = (units / unit).read_text().splitlines()
        loaded = {ln.split("=", 1)[1].split(":", 1)[0] for ln in lines if ln.startswith("LoadCredential=")}
        defaults = {ln.split("=", 1)[1].split(":", 1)[0] for ln in lines if ln.startswith("SetCredential=")}
        assert loaded and loaded == defaults, (unit, loaded ^ defaults)
