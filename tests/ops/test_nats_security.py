"""NATS least privilege, per-node credentials and TLS against a real nats-server.

The server runs with the config orchestrator.security.nats_auth renders (users with per-role permissions, in
an auth.conf include that the NodeCredentialIssuer rewrites and reloads). A forbidden publish,
subscribe or request is shown refused by the server's permissions-violation error (error_cb) AND by
the message not arriving; the allowed paths are shown working.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import io
import ipaddress
import json
import stat
from pathlib import Path

import nats
import nats.micro
import pytest
import structlog
from nats.errors import NoServersError
from nats.errors import TimeoutError as NatsTimeoutError

from orchestrator.natsserver import NatsServer
from orchestrator.security.nats_auth import (
    NodeCredentialIssuer,
    TlsFiles,
    User,
    agent_permissions,
    connect_options,
    feed_permissions,
    hash_password,
    node_user,
    orchctl_permissions,
    orchd_permissions,
    render_server_config,
    signal_reload,
)
from orchestrator.settings import NatsSettings
from tests.conftest import IN_CI
from wire import logs

pytestmark = pytest.mark.anyio

ORCHD_PW = "orchd-test-password"
ORCHCTL_PW = "orchctl-test-password"
FEED_PW = "feed-test-password"
SCOPES = {"n1": ("j1", "aws"), "n2": ("j2", "gcp"), "n3": ("j3", "aws")}
"""node -> (job, cloud) given to the issuer: the node's only log and notice subjects."""


class Secured:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.server: NatsServer | None = None
        self.issuer = NodeCredentialIssuer(
            root / "auth.conf",
            static_users=[User(name="orchd", password_hash=hash_password(ORCHD_PW), permissions=orchd_permissions()),
                          User(name="ops", password_hash=hash_password(ORCHCTL_PW),
                               permissions=orchctl_permissions()),
                          User(name="feed", password_hash=hash_password(FEED_PW), permissions=feed_permissions("aws"))],
            reload=self.reload,
        )
        self.reloads = 0

    def reload(self) -> None:
        if self.server is not None and self.server.proc is not None:
            before = self._reload_count()
            signal_reload(self.server.proc.pid)
            self.reloads += 1
            _wait(lambda: self._reload_count() > before, 5.0)

    def _reload_count(self) -> int:
        try:
            return self.server.log_path.read_text().count("Reloaded server configuration")
        except FileNotFoundError:
            return 0


def _wait(cond, timeout_s: float) -> None:
    import time
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def secured(tmp_path_factory) -> Secured:
    s = Secured(tmp_path_factory.mktemp("natssec"))
    s.creds = {n: s.issuer.issue(n, job_id=SCOPES[n][0], cloud=SCOPES[n][1]) for n in ("n1", "n2")}
    # server_name must equal NatsServer's `-n` name, or nats-server refuses to reload the config
    (s.root / "server.conf").write_text(render_server_config(host="127.0.0.1", port=-1, store_dir=None, http_port=None,
                                                             server_name="orch-embedded"))
    s.server = NatsServer(s.root / "srv", config_file=str(s.root / "server.conf")).start()
    yield s
    s.server.cleanup()


class Client:
    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc = None

    async def connect(self, url: str, user: str, password: str, inbox_prefix: str = "_INBOX", **kw) -> Client:
        async def on_error(e: Exception) -> None:
            self.errors.append(str(e))

        self.nc = await nats.connect(url, user=user, password=password, inbox_prefix=inbox_prefix,
                                     error_cb=on_error, allow_reconnect=False, max_reconnect_attempts=1,
                                     connect_timeout=2, **kw)
        return self

    async def violation(self, needle: str) -> str:
        """Wait for the server's permissions-violation error that names ``needle``."""
        for _ in range(100):
            hit = [e for e in self.errors if "permissions violation" in e.lower() and needle.lower() in e.lower()]
            if hit:
                return hit[0]
            await asyncio.sleep(0.02)
        raise AssertionError(f"no permissions violation for {needle}; errors: {self.errors}")


async def _agent(s: Secured, node: str) -> Client:
    cred = s.creds[node]
    return await Client().connect(s.server.url, cred.user, cred.password,
                                  inbox_prefix=agent_permissions(node).inbox_prefix)


async def _orchd(s: Secured) -> Client:
    return await Client().connect(s.server.url, "orchd", ORCHD_PW)


async def _orchctl(s: Secured) -> Client:
    return await Client().connect(s.server.url, "ops", ORCHCTL_PW, inbox_prefix=orchctl_permissions().inbox_prefix)


async def test_agent_allowed_paths(secured: Secured) -> None:
    orchd, agent = await _orchd(secured), await _agent(secured, "n1")
    try:
        js = orchd.nc.jetstream()
        await js.add_stream(name="ORCH_EVENTS", subjects=["orch.node.*.event", "orch.notice.>"])
        hbs: asyncio.Queue = asyncio.Queue()
        await orchd.nc.subscribe("orch.node.*.hb", cb=hbs.put)

        async def ack(msg) -> None:
            await msg.respond(b"ack:" + msg.data)

        await agent.nc.subscribe("orch.cmd.n1", cb=ack)
        await agent.nc.flush()
        await orchd.nc.flush()

        await agent.nc.publish("orch.node.n1.hb", b"hb")
        assert (await asyncio.wait_for(hbs.get(), 2)).data == b"hb"
        ajs = agent.nc.jetstream()
        assert (await ajs.publish("orch.node.n1.event", b"ev", headers={"Nats-Msg-Id": "e1"})).stream == "ORCH_EVENTS"
        assert (await ajs.publish("orch.notice.aws.n1", b"notice")).stream == "ORCH_EVENTS"
        await js.add_stream(name="ORCH_LOGS", subjects=["orch.logs.>"])
        assert (await ajs.publish("orch.logs.j1.n1", b"line")).stream == "ORCH_LOGS"  # its own job's logs
        reply = await orchd.nc.request("orch.cmd.n1", b"checkpoint", timeout=2)
        assert reply.data == b"ack:checkpoint"
        # orchd's own JetStream use works under its permissions: durable pull consumer + ack, KV
        psub = await js.pull_subscribe("orch.node.*.event", durable="orchd_events")
        (msg,) = await psub.fetch(1, timeout=2)
        assert msg.data == b"ev"
        await msg.ack_sync()
        kv = await js.create_key_value(bucket="orch_state_test")
        rev = await kv.create("job-1", b"{}")
        await kv.update("job-1", b"{}", last=rev)
        assert (await kv.get("job-1")).value == b"{}"
        assert agent.errors == [] and orchd.errors == []
    finally:
        await agent.nc.close()
        await orchd.nc.close()


async def test_agent_forbidden_paths_are_refused(secured: Secured) -> None:
    orchd, agent = await _orchd(secured), await _agent(secured, "n1")
    try:
        seen: asyncio.Queue = asyncio.Queue()
        await orchd.nc.subscribe("orch.>", cb=seen.put)
        await orchd.nc.flush()

        # another node's heartbeat, a forged command, a price tick
        for subject in ("orch.node.n2.hb", "orch.cmd.n2", "orch.price.aws.us-east-1"):
            await agent.nc.publish(subject, b"forged")
            await agent.violation(f'"{subject}"')
        # another node's commands, everybody's replies
        for subject in ("orch.cmd.n2", "_INBOX.>"):
            await agent.nc.subscribe(subject)
            await agent.violation(f'"{subject}"')
        # the admin service and the JetStream API
        for subject in ("orch.admin.v1.jobs.submit", "$JS.API.STREAM.DELETE.ORCH_EVENTS"):
            with pytest.raises(NatsTimeoutError):
                await agent.nc.request(subject, b"{}", timeout=0.3)
            await agent.violation(f'"{subject}"')
        await orchd.nc.flush()
        await asyncio.sleep(0.1)
        assert seen.empty(), [m.subject for m in [seen.get_nowait() for _ in range(seen.qsize())]]
        assert (await orchd.nc.jetstream().stream_info("ORCH_EVENTS")).config.name == "ORCH_EVENTS"
    finally:
        await agent.nc.close()
        await orchd.nc.close()


async def test_orchctl_only_calls_the_admin_service(secured: Secured) -> None:
    orchd, ctl = await _orchd(secured), await _orchctl(secured)
    try:
        async def jobs_list(req) -> None:
            await req.respond(b'{"jobs": []}')

        svc = await nats.micro.add_service(orchd.nc, name="orch-admin", version="1.0.0")
        group = svc.add_group(name="orch.admin.v1")
        await group.add_endpoint(name="jobs_list", subject="jobs.list", handler=jobs_list)
        await orchd.nc.flush()

        # A new queue subscription can briefly answer "no responders" right after the flush (seen ~1 in
        # 20 runs with nats-server 2.15; orchd's executor and client retry on it the same way).
        for attempt in range(20):
            try:
                reply = await ctl.nc.request("orch.admin.v1.jobs.list", b"{}", timeout=2)
                break
            except nats.errors.NoRespondersError:
                if attempt == 19:
                    raise
                await asyncio.sleep(0.05)
        assert reply.data == b'{"jobs": []}'
        ping = json.loads((await ctl.nc.request("$SRV.PING.orch-admin", b"", timeout=2)).data)
        assert ping["name"] == "orch-admin"
        assert ctl.errors == []

        await ctl.nc.publish("orch.cmd.n1", b"forged")
        await ctl.violation('"orch.cmd.n1"')
        await ctl.nc.subscribe("orch.node.>")
        await ctl.violation('"orch.node.>"')
        with pytest.raises(NatsTimeoutError):
            await ctl.nc.request("$KV.orch_state.lease", b"x", timeout=0.3)
        await ctl.violation('"$KV.orch_state.lease"')
        await svc.stop()
    finally:
        await ctl.nc.close()
        await orchd.nc.close()


async def test_bad_password_is_refused(secured: Secured) -> None:
    c = Client()
    with pytest.raises((NoServersError, nats.errors.Error, OSError)):
        await c.connect(secured.server.url, node_user("n1"), "wrong")
    assert any("authorization violation" in e.lower() for e in c.errors), c.errors


async def test_revoked_node_is_disconnected_and_cannot_reconnect(secured: Secured) -> None:
    cred = secured.issuer.issue("n3", job_id="j3", cloud="aws")
    secured.creds["n3"] = cred
    agent = await _agent(secured, "n3")
    await agent.nc.publish("orch.node.n3.hb", b"hb")
    await agent.nc.flush()
    assert agent.errors == []

    assert secured.issuer.revoke("n3")
    for _ in range(100):
        if agent.nc.is_closed or not agent.nc.is_connected:
            break
        await asyncio.sleep(0.02)
    assert not agent.nc.is_connected  # the server dropped the live connection on reload
    assert agent.errors, "the client saw no disconnect"
    refused = Client()
    with pytest.raises((NoServersError, nats.errors.Error, OSError)):
        await refused.connect(secured.server.url, cred.user, cred.password, inbox_prefix="_INBOX.n3")
    assert any("authorization violation" in e.lower() for e in refused.errors), refused.errors
    # the other nodes keep their access
    other = await _agent(secured, "n1")
    await other.nc.publish("orch.node.n1.hb", b"hb")
    await other.nc.flush()
    assert other.errors == []
    await other.nc.close()
    assert not secured.issuer.revoke("n3")


def test_issuer_stores_no_secret_and_expires(tmp_path: Path) -> None:
    now = [1000.0]
    reloads = []
    issuer = NodeCredentialIssuer(tmp_path / "auth.conf", static_users=[], reload=lambda: reloads.append(1),
                                  ttl_s=60, clock=lambda: now[0])
    cred = issuer.issue("n9")
    assert cred.password not in repr(cred) and cred.expires_at == 1060.0
    for f in (tmp_path / "auth.conf", tmp_path / "auth.conf.json"):
        assert cred.password not in f.read_text()
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert node_user("n9") in (tmp_path / "auth.conf").read_text()
    # a restarted orchd keeps the issued set
    assert NodeCredentialIssuer(tmp_path / "auth.conf", static_users=[], reload=lambda: None).issued() == {"n9"}
    now[0] = 1059.0
    assert issuer.revoke_expired() == []
    now[0] = 1060.0
    assert issuer.revoke_expired() == ["n9"]
    assert node_user("n9") not in (tmp_path / "auth.conf").read_text()
    assert len(reloads) == 2
    with pytest.raises(ValueError):
        issuer.issue("bad.node")


def test_secrets_never_reach_logs(tmp_path: Path) -> None:
    issuer = NodeCredentialIssuer(tmp_path / "auth.conf", static_users=[], reload=lambda: None)
    cred = issuer.issue("n5")
    out = io.StringIO()
    logs.configure(level="debug", fmt="json", stream=out)
    try:
        log = structlog.get_logger()
        log.info("node_credential_issued", node=cred.node_id, user=cred.user, credential=cred)
        log.info("nats_connecting", password=cred.password, nats_token="t0ps3cret")
        log.info("node_credential_debug", cred=repr(cred))
    finally:
        structlog.reset_defaults()
    text = out.getvalue()
    assert "node_credential_issued" in text and "n5" in text
    assert cred.password not in text and "t0ps3cret" not in text


# ---------------------------------------------------------------------------------------------------
# TLS: server verification and client certificates


def _make_pki(d: Path) -> dict[str, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.UTC)

    def key():
        return ec.generate_private_key(ec.SECP256R1())

    def write(name: str, obj) -> Path:
        p = d / name
        if hasattr(obj, "private_bytes"):
            p.write_bytes(obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption()))
        else:
            p.write_bytes(obj.public_bytes(serialization.Encoding.PEM))
        return p

    def ca(cn: str):
        k = key()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(k.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=1))
                .not_valid_after(now + dt.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False,
                                             encipher_only=False, decipher_only=False), critical=True)
                .sign(k, hashes.SHA256()))
        return k, cert

    def leaf(ca_key, ca_cert, cn: str, usage, san=None):
        k = key()
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
             .issuer_name(ca_cert.subject).public_key(k.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - dt.timedelta(minutes=1)).not_valid_after(now + dt.timedelta(days=1))
             .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return k, b.sign(ca_key, hashes.SHA256())

    ca_key, ca_cert = ca("orch test CA")
    other_key, other_cert = ca("some other CA")
    s_key, s_cert = leaf(ca_key, ca_cert, "nats-1", ExtendedKeyUsageOID.SERVER_AUTH,
                         [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    c_key, c_cert = leaf(ca_key, ca_cert, "orchd", ExtendedKeyUsageOID.CLIENT_AUTH)
    return {"ca": write("ca.pem", ca_cert), "other_ca": write("other-ca.pem", other_cert),
            "server": write("server.pem", s_cert), "server_key": write("server.key", s_key),
            "client": write("client.pem", c_cert), "client_key": write("client.key", c_key)}


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    if not IN_CI:  # in CI (.ci/run) the dev extra provides it: a missing package must fail there
        pytest.importorskip("cryptography")
    d = tmp_path_factory.mktemp("natstls")
    pki = _make_pki(d)
    (d / "auth.conf").write_text(
        NodeCredentialIssuer(d / "unused.conf", static_users=[
            User(name="orchd", password_hash=hash_password(ORCHD_PW), permissions=orchd_permissions())],
            reload=lambda: None).render())
    (d / "server.conf").write_text(render_server_config(
        host="127.0.0.1", port=-1, store_dir=None, http_port=None,
        tls=TlsFiles(cert_file=str(pki["server"]), key_file=str(pki["server_key"]), ca_file=str(pki["ca"]))))
    server = NatsServer(d / "srv", config_file=str(d / "server.conf")).start()
    yield server, pki
    server.cleanup()


def _settings(url: str, pki: dict[str, Path], *, client_cert: bool = True, ca: str = "ca") -> NatsSettings:
    return NatsSettings(urls=(url.replace("nats://", "tls://"),), user="orchd", password=ORCHD_PW,
                        tls_ca_file=str(pki[ca]),
                        tls_cert_file=str(pki["client"]) if client_cert else "",
                        tls_key_file=str(pki["client_key"]) if client_cert else "")


async def test_tls_with_server_verification_and_client_cert(tls_server) -> None:
    server, pki = tls_server
    opts = connect_options(_settings(server.url, pki), credentials_dir="/nonexistent")
    nc = await nats.connect(**opts, allow_reconnect=False, connect_timeout=2, error_cb=_ignore)
    try:
        assert nc.is_connected
        sub = await nc.subscribe("orch.tls.test")
        await nc.publish("orch.tls.test", b"ok")
        assert (await sub.next_msg(timeout=2)).data == b"ok"
    finally:
        await nc.close()


@pytest.mark.parametrize("variant", ["no_client_cert", "untrusted_server"])
async def test_tls_refusals(tls_server, variant: str) -> None:
    server, pki = tls_server
    s = _settings(server.url, pki, client_cert=variant != "no_client_cert",
                  ca="other_ca" if variant == "untrusted_server" else "ca")
    with pytest.raises((NoServersError, nats.errors.Error, OSError)):
        nc = await nats.connect(**connect_options(s, credentials_dir="/nonexistent"), allow_reconnect=False,
                                max_reconnect_attempts=1, connect_timeout=2, error_cb=_ignore)
        await nc.close()


def test_connect_options_read_systemd_credentials(tmp_path: Path) -> None:
    (tmp_path / "nats.password").write_text("from-credential\n")
    opts = connect_options(NatsSettings(urls=("nats://h:4222",), user="node-n1", password="fallback"),
                           inbox_prefix="_INBOX.n1", credentials_dir=str(tmp_path))
    assert opts["password"] == "from-credential" and opts["user"] == "node-n1"
    assert opts["inbox_prefix"] == "_INBOX.n1" and opts["servers"] == ["nats://h:4222"]


def test_server_config_example_is_current(tmp_path: Path) -> None:
    """config/nats/server-secure.conf is what render_server_config produces for the documented paths."""
    from orchestrator.security.nats_auth import example_server_config

    path = Path(__file__).resolve().parents[2] / "config" / "nats" / "server-secure.conf"
    assert path.read_text() == example_server_config()


async def _ignore(_e: Exception) -> None:
    return None


def test_example_configs_are_valid_for_nats_server(tmp_path: Path) -> None:
    """config/nats/*.conf pass `nats-server -t` once their TLS paths point at real files."""
    import shutil
    import subprocess

    from orchestrator.natsserver import server_binary

    src = Path(__file__).resolve().parents[2] / "config" / "nats"
    tls = tmp_path / "tls"
    tls.mkdir()
    pki = _make_pki(tls)  # writes ca.pem, server.pem, server.key; the route cert reuses the server's
    shutil.copy(pki["server"], tls / "route.pem")
    shutil.copy(pki["server_key"], tls / "route.key")
    shutil.copy(src / "auth.conf.example", tmp_path / "auth.conf")
    confs = ["server-secure.conf", "cluster-1.conf", "cluster-2.conf", "cluster-3.conf"]
    for name in confs:
        text = (src / name).read_text().replace("/etc/nats/tls/", f"{tls}/")
        (tmp_path / name).write_text(text.replace("/var/lib/nats/jetstream", str(tmp_path / "js")))
        res = subprocess.run([server_binary(), "-t", "-c", str(tmp_path / name)], capture_output=True, text=True,
                             timeout=30)
        assert res.returncode == 0 and "is valid" in res.stdout + res.stderr, (name, res.stdout + res.stderr)
    # and with the auth callout include instead (credentials.mode = "callout"): the same server config
    shutil.copy(src / "auth-callout.conf.example", tmp_path / "auth.conf")
    res = subprocess.run([server_binary(), "-t", "-c", str(tmp_path / "cluster-1.conf")], capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0 and "is valid" in res.stdout + res.stderr, res.stdout + res.stderr
