"""NATS security: least-privilege permissions per role, server config rendering, per-node credentials.

Role: the one place that knows which subjects each party may use (see docs/operations.md, "NATS
security"). Three roles:

* ``orchd``   - the control plane: JetStream/KV management, commands to agents, the admin service.
* ``agent``   - one user per node: may publish only its own heartbeats/events/notices/logs, receive only
  its own commands (``orch.cmd.<node>``) and replies on its own inbox prefix (``_INBOX.<node>.>``, so it
  cannot read other parties' replies); it answers command requests through ``allow_responses``.
* ``orchctl`` - operators: only the admin service (``orch.admin.v1.>``, ``$SRV.>`` discovery), reading
  the trainer logs one stored message at a time (``$JS.API.STREAM.MSG.GET.ORCH_LOGS``: read-only, no
  consumer) and replies on the ``_INBOX.orchctl.>`` prefix.
* ``feed``    - an external price publisher: only ``orch.price.>`` (``feed:<cloud>``: only
  ``orch.price.<cloud>.>``) and its JetStream PubAcks on the ``_INBOX.feed.>`` prefix.

An agent's notice and log subjects name its cloud and its job (``orch.notice.<cloud>.<node>``,
``orch.logs.<job>.<node>``): both are known when orchd issues the node's credential at launch and are
granted exactly; a credential issued without them gets neither subject.

Per-node credentials: ``NodeCredentialIssuer`` issues a random password per node at launch (only its
bcrypt hash is stored, in the server's ``auth.conf`` include and a JSON state file, both 0600), and
revokes it when the node leaves (or when it expires: ``revoke_expired``). Each change rewrites
``auth.conf`` atomically and calls ``reload`` (``signal_reload(pid)`` for the embedded server: SIGHUP;
nats-server re-checks connected clients on reload and closes the revoked ones).

Concurrency contract: the issuer is synchronous and not thread-safe; orchd calls it from one task
(via ``to_thread`` if bcrypt's ~50 ms matter). Secrets never reach a log line: ``NodeCredential``
hides its password from ``repr``; log only ``node_id``/``user``.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import ssl
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bcrypt

from wire import NodeId

ORCHCTL_INBOX = "_INBOX.orchctl"
FEED_INBOX = "_INBOX.feed"
BCRYPT_ROUNDS = 10
_TOKEN_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


@dataclass(frozen=True, slots=True, kw_only=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False
    inbox_prefix: str = "_INBOX"
    """The inbox prefix the client must connect with (nats.connect(inbox_prefix=...))."""

    def render(self) -> str:
        pub = ", ".join(_q(s) for s in self.publish)
        sub = ", ".join(_q(s) for s in self.subscribe)
        out = f"{{ publish: {{ allow: [{pub}] }}, subscribe: {{ allow: [{sub}] }}"
        if self.allow_responses:
            out += ", allow_responses: { max: 1, expires: \"1m\" }"
        return out + " }"


def _q(s: str) -> str:
    if any(c in s for c in '"\\\n'):
        raise ValueError(f"bad character in {s!r}")
    return f'"{s}"'


def check_token(node_id: str) -> str:
    """Node ids become subject tokens and user names: no dots, wildcards or spaces."""
    if not node_id or not set(node_id) <= _TOKEN_OK:
        raise ValueError(f"node id {node_id!r} is not a safe subject token")
    return node_id


def orchd_permissions() -> Permissions:
    return Permissions(
        # orch.>: commands to agents, price ticks of built-in feeds; $JS/$KV: streams, consumers,
        # acks, flow control, KV puts; $SRV: the admin micro service's discovery replies.
        publish=("orch.>", "$JS.>", "$KV.>", "$SRV.>", "_INBOX.>"),
        subscribe=("orch.>", "$SRV.>", "_INBOX.>"),
        allow_responses=True,  # admin service replies go to orchctl's inbox
    )


def agent_permissions(node_id: str, *, job_id: str | None = None, cloud: str | None = None) -> Permissions:
    """One node: its heartbeat and events; the notice subject of its ``cloud`` and the log subject of
    its ``job_id`` only when given (None: not granted)."""
    n = check_token(node_id)
    scoped = ((f"orch.notice.{check_token(cloud)}.{n}",) if cloud is not None else ()) + (
        (f"orch.logs.{check_token(job_id)}.{n}",) if job_id is not None else ())
    return Permissions(
        # JetStream publishes (events, notices) need no $JS.API: the PubAck comes to the agent's inbox.
        publish=(f"orch.node.{n}.hb", f"orch.node.{n}.event", *scoped),
        subscribe=(f"orch.cmd.{n}", f"_INBOX.{n}.>"),
        allow_responses=True,  # the CommandAck reply to orchd's request (once, within 1m)
        inbox_prefix=f"_INBOX.{n}",
    )


def orchctl_permissions() -> Permissions:
    return Permissions(publish=("orch.admin.v1.>", "$SRV.>", "$JS.API.STREAM.MSG.GET.ORCH_LOGS"),
                       subscribe=(f"{ORCHCTL_INBOX}.>",), inbox_prefix=ORCHCTL_INBOX)


def feed_permissions(cloud: str | None = None) -> Permissions:
    """An external price publisher: price ticks only (of one cloud when given), JetStream-published
    (the PubAck comes to its inbox: no $JS.API needed)."""
    price = f"orch.price.{check_token(cloud)}.>" if cloud is not None else "orch.price.>"
    return Permissions(publish=(price,), subscribe=(f"{FEED_INBOX}.>",), inbox_prefix=FEED_INBOX)


def role_permissions(role: str) -> Permissions:
    """A static user's permissions from its role in ``static_users_file``: ``orchd``, ``orchctl``,
    ``feed`` or ``feed:<cloud>``. ValueError for anything else."""
    if role == "orchd":
        return orchd_permissions()
    if role == "orchctl":
        return orchctl_permissions()
    kind, sep, cloud = role.partition(":")
    if kind == "feed":
        return feed_permissions(cloud if sep else None)
    raise ValueError(f"unknown role {role!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class User:
    """One entry of the server's users list: a bcrypt password hash or an nkey public key."""

    name: str
    permissions: Permissions
    password_hash: str = ""
    nkey: str = ""

    def render(self) -> str:
        cred = f"nkey: {_q(self.nkey)}" if self.nkey else f"user: {_q(self.name)}, password: {_q(self.password_hash)}"
        return f"    {{ {cred}, permissions: {self.permissions.render()} }}"


def hash_password(password: str) -> str:
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(BCRYPT_ROUNDS)).decode()


def render_authorization(users: Sequence[User], timeout_s: float = 2.0) -> str:
    """The ``authorization { users = [...] }`` block (the content of auth.conf)."""
    body = "\n".join(u.render() for u in users)
    return f"authorization {{\n  timeout: {timeout_s}\n  users = [\n{body}\n  ]\n}}\n"


AUTH_SUBJECT = "$SYS.REQ.USER.AUTH"
"""Where nats-server sends its authorization requests when ``auth_callout`` is configured."""


def auth_user_permissions() -> Permissions:
    """The callout's auth user (orchd's callout connection): orchd's own rights plus the callout subject."""
    p = orchd_permissions()
    return Permissions(publish=p.publish, subscribe=(*p.subscribe, AUTH_SUBJECT),
                       allow_responses=True, inbox_prefix=p.inbox_prefix)


def render_callout_authorization(issuer_public_key: str, auth_users: Sequence[User], timeout_s: float = 2.0) -> str:
    """The ``authorization`` block for ``[credentials] mode = "callout"`` (orchestrator/authcallout.py): the
    same static file on every server of a cluster, never rewritten. ``auth_users`` bypass the callout;
    every other login is decided by orchd and signed by the account key ``issuer_public_key``."""
    if not issuer_public_key.startswith("A"):
        raise ValueError("the callout issuer must be an account public key (A...)")
    body = "\n".join(u.render() for u in auth_users)
    names = ", ".join(_q(u.name) for u in auth_users)
    return (f"authorization {{\n  timeout: {timeout_s}\n  users = [\n{body}\n  ]\n"
            f"  auth_callout {{\n    issuer: {_q(issuer_public_key)}\n    auth_users: [{names}]\n  }}\n}}\n")


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsFiles:
    cert_file: str
    key_file: str
    ca_file: str
    verify: bool = True
    """Require and verify client certificates (mutual TLS)."""


def render_server_config(*, auth_include: str | None = "auth.conf", host: str = "0.0.0.0", port: int = 4222,
                         store_dir: str | None = "/var/lib/nats/jetstream", tls: TlsFiles | None = None,
                         server_name: str = "", cluster: Mapping[str, Any] | None = None,
                         http_port: int | None = 8222) -> str:
    """A nats-server config: client listener, JetStream, TLS, users from ``auth_include``, optional
    cluster block (``{"name", "host", "port", "routes": [...], "tls": TlsFiles|None}``)."""
    lines = ["# Rendered by orchestrator.security.nats_auth.render_server_config - see docs/operations.md.",
             f"listen: {_q(f'{host}:{port}')}"]
    if server_name:
        lines.append(f"server_name: {_q(server_name)}")
    if http_port is not None:
        lines.append(f"http: {_q(f'127.0.0.1:{http_port}')}  # monitoring, loopback only")
    if store_dir is not None:  # None: JetStream enabled on the command line (-js -sd), as NatsServer does
        lines.append(f"jetstream {{ store_dir: {_q(store_dir)} }}")
    if tls:
        lines.append(_render_tls(tls, indent=""))
    if cluster:
        routes = ", ".join(_q(r) for r in cluster.get("routes", ()))
        lines.append("cluster {")
        lines.append(f"  name: {_q(cluster['name'])}")
        listen = f"{cluster.get('host', host)}:{cluster['port']}"
        lines.append(f"  listen: {_q(listen)}")
        lines.append(f"  routes: [{routes}]")
        if cluster.get("tls"):
            lines.append(_render_tls(cluster["tls"], indent="  "))
        lines.append("}")
    if auth_include:  # None: no authorization (loopback tests only)
        lines.append(f"include {_q(auth_include)}")
    return "\n".join(lines) + "\n"


def _render_tls(t: TlsFiles, indent: str) -> str:
    return (f"{indent}tls {{\n{indent}  cert_file: {_q(t.cert_file)}\n{indent}  key_file: {_q(t.key_file)}\n"
            f"{indent}  ca_file: {_q(t.ca_file)}\n{indent}  verify: {'true' if t.verify else 'false'}\n"
            f"{indent}  timeout: 2\n{indent}}}")


# ---------------------------------------------------------------------------------------------------
# Per-node credentials


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeCredential:
    """What a new node receives at launch (cloud secret store / user-data -> LoadCredential file)."""

    node_id: NodeId
    user: str
    password: str = field(repr=False)
    expires_at: float | None = None


def node_user(node_id: str) -> str:
    return f"node-{check_token(node_id)}"


def _write_private(path: Path, text: str) -> None:
    """Atomic replace with mode 0600 (the file holds password hashes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def signal_reload(pid: int) -> None:
    """Make a local nats-server re-read its config (same as ``nats-server --signal reload=<pid>``)."""
    os.kill(pid, signal.SIGHUP)


class NodeCredentialIssuer:
    """Issues and revokes per-node NATS users by rewriting the server's users include and reloading.

    ``static_users`` (orchd, orchctl operators) are always rendered first. State (node -> bcrypt hash,
    expiry) persists in ``<auth_file>.json`` so a restarted orchd keeps the issued set.
    """

    def __init__(self, auth_file: str | os.PathLike[str], *, static_users: Sequence[User],
                 reload: Callable[[], None], ttl_s: float | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.auth_file = Path(auth_file)
        self.state_file = self.auth_file.with_name(self.auth_file.name + ".json")
        self.static_users = tuple(static_users)
        self._reload = reload
        self.ttl_s = ttl_s
        self._clock = clock
        self._nodes: dict[str, dict[str, Any]] = (
            json.loads(self.state_file.read_text()) if self.state_file.exists() else {}
        )

    def issued(self) -> frozenset[str]:
        return frozenset(self._nodes)

    def issue(self, node_id: str, *, job_id: str | None = None, cloud: str | None = None) -> NodeCredential:
        """A fresh credential for ``node_id`` (replacing any earlier one), active when this returns.
        ``job_id``/``cloud``: the node's job and cloud, its only log and notice subjects."""
        password = secrets.token_urlsafe(32)
        expires = self._clock() + self.ttl_s if self.ttl_s else None
        agent_permissions(node_id, job_id=job_id, cloud=cloud)  # refuse unsafe tokens before storing
        self._nodes[check_token(node_id)] = {"hash": hash_password(password), "expires_at": expires,
                                             "job": job_id, "cloud": cloud}
        self._apply()
        return NodeCredential(node_id=NodeId(node_id), user=node_user(node_id), password=password,
                              expires_at=expires)

    def revoke(self, node_id: str) -> bool:
        """Remove the node's user; its connection is closed by the server on reload. False if unknown."""
        if self._nodes.pop(node_id, None) is None:
            return False
        self._apply()
        return True

    def revoke_expired(self) -> list[str]:
        now = self._clock()
        gone = [n for n, v in self._nodes.items() if v["expires_at"] is not None and v["expires_at"] <= now]
        for n in gone:
            del self._nodes[n]
        if gone:
            self._apply()
        return gone

    def render(self) -> str:
        return render_authorization([*self.static_users, *self.node_users()])

    def node_users(self) -> list[User]:
        """The issued nodes' users, each scoped to its job and cloud (``issue``)."""
        return [User(name=node_user(n), password_hash=v["hash"],
                     permissions=agent_permissions(n, job_id=v.get("job"), cloud=v.get("cloud")))
                for n, v in sorted(self._nodes.items())]

    def _apply(self) -> None:
        _write_private(self.auth_file, self.render())
        _write_private(self.state_file, json.dumps(self._nodes, sort_keys=True))
        self._reload()


# ---------------------------------------------------------------------------------------------------
# Client side


def connect_options(settings: Any, *, inbox_prefix: str = "_INBOX",
                    credentials_dir: str | None = None) -> dict[str, Any]:
    """Keyword arguments for ``nats.connect`` from ``NatsSettings`` plus systemd credentials.

    Secrets come from ``$CREDENTIALS_DIRECTORY`` (LoadCredential=) when present: ``nats.password``,
    ``nats.creds``, ``nats.nkey``, ``nats-ca.pem``, ``nats-client.pem``/``nats-client.key``; values in
    settings are the fallback. The returned dict holds secrets: never log it.
    """
    cdir = Path(credentials_dir or os.environ.get("CREDENTIALS_DIRECTORY", "") or "/nonexistent")

    def cred(name: str) -> str:
        p = cdir / name
        return str(p) if p.is_file() else ""

    opts: dict[str, Any] = {"inbox_prefix": inbox_prefix}
    if settings.urls:
        opts["servers"] = list(settings.urls)
    password = Path(cred("nats.password")).read_text().strip() if cred("nats.password") else settings.password
    if settings.user:
        opts["user"], opts["password"] = settings.user, password
    elif settings.token:
        opts["token"] = settings.token
    creds = cred("nats.creds") or settings.creds_file
    if creds:
        opts["user_credentials"] = creds
    seed = cred("nats.nkey") or settings.nkey_seed_file
    if seed:
        opts["nkeys_seed"] = seed
    ca = cred("nats-ca.pem") or settings.tls_ca_file
    cert = cred("nats-client.pem") or settings.tls_cert_file
    key = cred("nats-client.key") or settings.tls_key_file
    if ca or cert:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca or None)
        if cert:
            ctx.load_cert_chain(cert, key or None)
        opts["tls"] = ctx
        if settings.tls_hostname:
            opts["tls_hostname"] = settings.tls_hostname
    return opts


# ---------------------------------------------------------------------------------------------------
# The example configs shipped in config/nats (regenerate: python -m orchestrator.security.nats_auth)

_ETC = "/etc/nats"


def _example_tls() -> TlsFiles:
    return TlsFiles(cert_file=f"{_ETC}/tls/server.pem", key_file=f"{_ETC}/tls/server.key",
                    ca_file=f"{_ETC}/tls/ca.pem")


def example_server_config() -> str:
    """One secured server (orchd's host or a standalone NATS): TLS with client certs, users include."""
    return render_server_config(auth_include="auth.conf", tls=_example_tls(), server_name="nats-1")


def example_cluster_configs(hosts: Sequence[str] = ("nats-1.internal", "nats-2.internal", "nats-3.internal"),
                            ) -> dict[str, str]:
    """Three servers, JetStream replicated (streams/KV with replicas=3), TLS on clients and routes."""
    routes = [f"nats-route://{h}:6222" for h in hosts]
    route_tls = TlsFiles(cert_file=f"{_ETC}/tls/route.pem", key_file=f"{_ETC}/tls/route.key",
                         ca_file=f"{_ETC}/tls/ca.pem")
    return {
        f"cluster-{i}.conf": render_server_config(
            auth_include="auth.conf", tls=_example_tls(), server_name=f"nats-{i}",
            cluster={"name": "orch", "port": 6222, "routes": routes, "tls": route_tls},
        )
        for i, _host in enumerate(hosts, start=1)
    }


def example_files() -> dict[str, str]:
    users = [
        User(name="orchd", password_hash="$2b$10$REPLACE.WITH.bcrypt.HASH.OF.ORCHD.PASSWORD.xxxxxxxxxxx",
             permissions=orchd_permissions()),
        User(name="ops-alice", password_hash="$2b$10$REPLACE.WITH.bcrypt.HASH.OF.OPERATOR.PASSWORD.xxxxxxxx",
             permissions=orchctl_permissions()),
        User(name="price-feed", password_hash="$2b$10$REPLACE.WITH.bcrypt.HASH.OF.FEED.PASSWORD.xxxxxxxxxxxx",
             permissions=feed_permissions("aws")),
        User(name=node_user("example-node"),
             password_hash="$2b$10$ISSUED.BY.orchd.NodeCredentialIssuer.xxxxxxxxxxxxxxx",
             permissions=agent_permissions("example-node", job_id="example-job", cloud="aws")),
    ]
    header = ("# Example users include. In production orchd's NodeCredentialIssuer owns this file: it keeps\n"
              "# the static users (orchd, operators, price feeds) and adds/removes one user per node (scoped\n"
              "# to its job and cloud), then reloads.\n")
    callout = ("# Example users include for [credentials] mode = \"callout\" (docs/operations.md): the same\n"
               "# file on every server, never rewritten. Replace the issuer with the public key of orchd's\n"
               "# credentials.issuer_seed_file and the hash with that of credentials.auth_password_file.\n")
    auth_user = User(name="orchd-auth", password_hash="$2b$10$REPLACE.WITH.bcrypt.HASH.OF.AUTH.PASSWORD.xxxxxxxxxxxx",
                     permissions=auth_user_permissions())
    example_issuer = "ABJHLOVMPA4CI6R5KLNGOB4GSLNIY7IOUPAJC4YFNDLQVIOBYQGUWVLA"  # the NATS docs' example key
    return {"server-secure.conf": example_server_config(), **example_cluster_configs(),
            "auth.conf.example": header + render_authorization(users),
            "auth-callout.conf.example": callout + render_callout_authorization(example_issuer, [auth_user])}


if __name__ == "__main__":  # pragma: no cover - regenerates config/nats
    out = Path(__file__).resolve().parents[2] / "config" / "nats"
    for name, text in example_files().items():
        (out / name).write_text(text)
        print(f"wrote {out / name}")
