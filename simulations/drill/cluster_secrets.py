"""The drill's secrets, made fresh under its temp dir: a throwaway CA and the NATS servers' certificate,
the auth callout's account key and auth user, and the static users with their roles.

Role: what an operator prepares on a fresh control host (docs/operations.md, section 4) before starting
NATS and orchd, written where systemd would hand it over: one credentials directory per service
(``LoadCredential=`` names, orchestrator/settings.py ``CREDENTIAL_FILES``), each file 0600.

Logins of the drill's cluster:

- ``orchd-auth``: the callout's auth user (bypasses the callout; orchd's callout connection);
- ``orchd`` (role orchd), ``ops`` (role orchctl: every orchctl call of the drill), ``price-feed`` (role
  ``feed:local``: the drill's price ticks): static users whose logins orchd decides through the callout;
- ``drill-observer``: a second auth user with orchd's rights, the drill's own login for what an operator
  does with the ``nats`` CLI (waiting for JetStream before any orchd runs, pausing a consumer);
- nodes: per-node credentials, enrolled with the single-use token of their launch.

TLS: every client listener presents a certificate for 127.0.0.1 signed by the CA; clients verify it
(``nats-ca.pem``). Client certificates are not required: agents have none.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from orchestrator.security.nats_auth import (
    TlsFiles,
    User,
    auth_user_permissions,
    hash_password,
    orchd_permissions,
    render_callout_authorization,
)
from orchestrator.security.nkeys import KeyPair

AUTH_USER = "orchd-auth"
OBSERVER = "drill-observer"
STATIC_ROLES = {"orchd": "orchd", "ops": "orchctl", "price-feed": "feed:local"}


def _write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return path


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_tls(directory: Path, *, days: int = 2) -> TlsFiles:
    """A CA and a server certificate for 127.0.0.1 and localhost (ECDSA P-256), under ``directory``."""
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "orch drill CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "nats")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(san, critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return TlsFiles(cert_file=str(_write(directory / "server.pem", cert.public_bytes(pem))),
                    key_file=str(_write(directory / "server.key", _pem_key(key))),
                    ca_file=str(_write(directory / "ca.pem", ca.public_bytes(pem))), verify=False)


@dataclass
class Secrets:
    """Every secret of the drill's cluster (see the module docstring), under ``root``."""

    root: Path
    tls: TlsFiles = field(init=False)
    issuer: KeyPair = field(init=False)
    passwords: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.tls = make_tls(self.root / "pki")
        self.issuer = KeyPair.create("account")
        self.passwords = {name: secrets.token_urlsafe(18)
                          for name in (AUTH_USER, OBSERVER, *STATIC_ROLES)}
        users = [{"name": n, "password_hash": hash_password(self.passwords[n]), "role": r}
                 for n, r in STATIC_ROLES.items()]
        _write(self.static_users, json.dumps(users, indent=2))
        _write(self.auth_conf, render_callout_authorization(self.issuer.public_key, [
            User(name=AUTH_USER, password_hash=hash_password(self.passwords[AUTH_USER]),
                 permissions=auth_user_permissions()),
            User(name=OBSERVER, password_hash=hash_password(self.passwords[OBSERVER]), permissions=orchd_permissions()),
        ]))

    @property
    def static_users(self) -> Path:
        return self.root / "static-users.json"

    @property
    def auth_conf(self) -> Path:
        """The servers' include: the auth users and ``auth_callout`` (the same file on every server)."""
        return self.root / "auth.conf"

    def orchd_credentials(self, directory: Path) -> Path:
        """What systemd hands orchd.service (``LoadCredential=``): its password, the CA, the account seed
        and the auth user's password."""
        ca = Path(self.tls.ca_file).read_text()
        for name, text in (("nats.password", self.passwords["orchd"]), ("nats-ca.pem", ca),
                           ("callout-issuer.seed", self.issuer.seed),
                           ("callout-auth.password", self.passwords[AUTH_USER])):
            _write(directory / name, text + ("\n" if not text.endswith("\n") else ""))
        return directory

    def agent_credentials(self, directory: Path) -> Path:
        """What systemd hands orch-agent.service on an enrolled node: the CA only (its NATS login comes
        from the enrolment token of its launch)."""
        _write(directory / "nats-ca.pem", Path(self.tls.ca_file).read_text())
        return directory
