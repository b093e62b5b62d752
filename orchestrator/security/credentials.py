"""Per-node NATS credentials in the shell: issued at launch through enrolment, revoked when the node leaves.

Role: glue between the executor, ``NodeCredentialIssuer`` (nats_auth: per-node users in the server's
users include, reload on change) and ``EnrolmentBroker`` (providers/bootstrap: single-use, expiring
enrolment tokens). Nothing long-lived travels in user data (readable from the metadata service):

1. ``on_launch(node_ids)`` (the executor, before provider.launch) mints one enrolment token per node
   and adds a per-node *enrol user* ``enrol-<node>`` whose password is that token (bcrypt hash only).
   The enrol user may only publish ``orch.enrol.<node>`` and receive replies on ``_INBOX.<node>.enrol.>``,
   so the token is checked by nats-server at connect and the reply (which carries the real password)
   cannot be read by any other node. The tokens go to ``NodeBootstrap.node_credentials`` ->
   ``ORCH_AGENT_ENROL_TOKEN`` in the user data.
2. The agent connects as ``enrol-<node>`` and requests ``orch.enrol.<node>`` with the token;
   ``serve(nc)`` answers: ``EnrolmentBroker.redeem`` (single use, TTL) -> ``issuer.issue(node)`` ->
   ``{"user": "node-<node>", "password": ...}``; refusals answer ``{"error": reason}`` (``reused``
   means someone else read the user data: logged as an error). The agent keeps the password on local
   disk (0600) and connects as ``node-<node>`` (``agent_permissions``: its own subjects only, the log
   and notice subjects of the job and cloud given to ``on_launch``).
3. ``on_gone(node)`` (the executor, on NodeGone, and for launch nodes that got no instance) drops the
   token, the enrol user and revokes the node user: the server closes its connection on reload.

Idempotence: a Launch re-executed for the same node ids gets the same token back while this process
lives (the first VM of an idempotent launch carries it). Tokens and enrol users are in memory only:
after an orchd restart an unenrolled node cannot enrol (it never registers and is replaced after the
heartbeat timeout), the same gap as the broker's.

Concurrency contract: every method is synchronous, thread-safe (one lock) and may block (bcrypt,
file write, reload): the executor calls them via ``anyio.to_thread``. Secrets are never logged.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

import anyio
import structlog

from orchestrator.security.nats_auth import (
    NodeCredentialIssuer,
    Permissions,
    User,
    agent_permissions,
    check_token,
    hash_password,
    render_authorization,
)
from providers.bootstrap import ENROL_TTL_S, EnrolmentBroker, EnrolmentError

log = structlog.get_logger("orchd.credentials")

ENROL_SUBJECT_PREFIX = "orch.enrol"


def enrol_subject(node_id: str) -> str:
    return f"{ENROL_SUBJECT_PREFIX}.{check_token(node_id)}"


def enrol_user(node_id: str) -> str:
    return f"enrol-{check_token(node_id)}"


def enrol_inbox(node_id: str) -> str:
    """Inside the node's own inbox space (``_INBOX.<node>``): no other party can read the reply, and
    orchd's plain ``_INBOX.>`` publish permission covers it (its ``allow_responses`` grant does not
    survive the reload that issuing the credential triggers between request and reply)."""
    return f"_INBOX.{check_token(node_id)}.enrol"


def enrol_permissions(node_id: str) -> Permissions:
    """The enrol user of one node: one request subject, replies on its own inbox prefix, nothing else."""
    return Permissions(publish=(enrol_subject(node_id),), subscribe=(f"{enrol_inbox(node_id)}.>",),
                       inbox_prefix=enrol_inbox(node_id))


class EnrollingIssuer(NodeCredentialIssuer):
    """``NodeCredentialIssuer`` that also renders the per-node enrol users (in memory, not persisted)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._enrol: dict[str, str] = {}  # node -> bcrypt hash of its enrolment token
        super().__init__(*args, **kwargs)

    def set_enrol_user(self, node_id: str, token_hash: str | None) -> None:
        """Add (hash) or remove (None) the node's enrol user; rewrites and reloads when it changed."""
        if token_hash is None:
            if self._enrol.pop(node_id, None) is None:
                return
        else:
            self._enrol[check_token(node_id)] = token_hash
        self._apply()

    def render(self) -> str:
        enrol = [User(name=enrol_user(n), password_hash=h, permissions=enrol_permissions(n))
                 for n, h in sorted(self._enrol.items())]
        return render_authorization([*self.static_users, *enrol, *self.node_users()])


class _IssuerAdapter:
    """``CredentialIssuer`` (providers/bootstrap) over ``NodeCredentialIssuer``: the credential as JSON,
    scoped to the node's job and cloud from ``scopes`` (node -> (job, cloud), filled at launch)."""

    def __init__(self, issuer: NodeCredentialIssuer, scopes: dict[str, tuple[str | None, str | None]]) -> None:
        self.issuer = issuer
        self.scopes = scopes

    def issue(self, node_id: str) -> str:
        job_id, cloud = self.scopes.get(node_id, (None, None))
        cred = self.issuer.issue(node_id, job_id=job_id, cloud=cloud)
        return json.dumps({"user": cred.user, "password": cred.password, "expires_at": cred.expires_at})

    def revoke(self, node_id: str) -> None:
        self.issuer.revoke(node_id)


class Credentials(Protocol):
    """What the executor and orchd's start-up need of a credentials mode: ``NodeCredentials`` (the
    ``file`` mode) or ``authcallout.CalloutCredentials`` (the ``callout`` mode)."""

    def on_launch(self, node_ids: Iterable[str], *, job_id: str | None = None,
                  cloud: str | None = None) -> dict[str, str]: ...

    def on_gone(self, node_id: str) -> None: ...

    async def serve(self, nc: Any) -> Any: ...


class NodeCredentials:
    """What the executor calls at launch and when a node leaves; ``serve`` is the enrol endpoint."""

    def __init__(self, issuer: EnrollingIssuer, *, enrol_ttl_s: float = ENROL_TTL_S,
                 clock: Callable[[], float] | None = None) -> None:
        self.issuer = issuer
        self._scopes: dict[str, tuple[str | None, str | None]] = {}  # node -> (job, cloud), from the launch
        self.broker = EnrolmentBroker(_IssuerAdapter(issuer, self._scopes), ttl_s=enrol_ttl_s,
                                      **({"clock": clock} if clock else {}))
        self._lock = threading.RLock()
        self._tokens: dict[str, str] = {}  # node -> its live enrolment token (same token on a re-launch)

    def on_launch(self, node_ids: Iterable[str], *, job_id: str | None = None,
                  cloud: str | None = None) -> dict[str, str]:
        """node -> enrolment token for the user data. Idempotent per node while the token is unused.
        ``job_id``/``cloud``: the launch's, the only log and notice subjects of the nodes' credentials."""
        out: dict[str, str] = {}
        with self._lock:
            for n in node_ids:
                agent_permissions(n, job_id=job_id, cloud=cloud)  # unsafe tokens fail here, not at enrolment
                self._scopes[n] = (job_id, cloud)
                token = self._tokens.get(n)
                if token is None:
                    token = self.broker.mint(check_token(n))
                    self.issuer.set_enrol_user(n, hash_password(token))
                    self._tokens[n] = token
                    log.info("enrolment_token_minted", node=n)
                out[n] = token
        return out

    def redeem(self, node_id: str, token: str) -> dict[str, Any]:
        """The node's credential (dict with user/password), once. Raises EnrolmentError."""
        with self._lock:
            cred = json.loads(self.broker.redeem(node_id, token))
        log.info("node_enrolled", node=node_id, user=cred["user"])
        return cred

    def on_gone(self, node_id: str) -> None:
        """Drop the node's token and enrol user, revoke its NATS user (its connection is closed)."""
        with self._lock:
            known = self._tokens.pop(node_id, None) is not None or node_id in self.issuer.issued()
            self._scopes.pop(node_id, None)
            self.issuer.set_enrol_user(node_id, None)
            self.broker.forget(node_id)  # revokes the node user (a no-op when none was issued)
        if known:
            log.info("node_credential_revoked", node=node_id)

    async def serve(self, nc: Any) -> Any:
        """Subscribe the enrol endpoint on ``orch.enrol.*`` (returns the subscription)."""
        return await serve_enrol_endpoint(nc, lambda node, token: anyio.to_thread.run_sync(self.redeem, node, token))


async def serve_enrol_endpoint(nc: Any, redeem: Callable[[str, str], Awaitable[dict[str, Any]]]) -> Any:
    """``orch.enrol.<node>`` with the token as payload -> ``{"user", "password"}`` from ``redeem(node,
    token)``, or ``{"error": reason}`` (EnrolmentError's reason; ``internal`` for anything else, logged)."""

    async def handle(msg: Any) -> None:
        node = msg.subject.rsplit(".", 1)[-1]
        try:
            cred = await redeem(node, msg.data.decode())
            reply = {"user": cred["user"], "password": cred["password"]}
        except EnrolmentError as e:
            (log.error if e.reason == "reused" else log.warning)("enrolment_refused", node=node, reason=e.reason)
            reply = {"error": e.reason}
        except Exception as e:  # a bad node id, a failed reload or KV write: refuse, keep serving
            log.exception("enrolment_failed", node=node, error=repr(e))
            reply = {"error": "internal"}
        if msg.reply:
            await msg.respond(json.dumps(reply).encode())

    return await nc.subscribe(f"{ENROL_SUBJECT_PREFIX}.*", cb=handle)
