"""Per-node NATS credentials on a NATS cluster: the auth callout, served by every orchd.

Role: the cluster-wide variant of ``orchestrator/credentials.py`` (``[credentials] mode = "callout"``).
That one writes one server's users file and keeps enrolment tokens in one orchd's memory, so it cannot
serve an HA deployment. Here:

- Every nats-server of the cluster has the same static config (``nats_auth.render_callout_authorization``):
  ``authorization { users: [<auth user>], auth_callout { issuer: <account nkey>, auth_users: [...] } }``.
  The server asks ``$SYS.REQ.USER.AUTH`` about every other connection.
- Every orchd - leader and standbys - connects as the auth user (the only one that bypasses the
  callout) and answers those requests in one queue group (``AuthCallout``). It looks the presented
  name and password up in the static users (bcrypt) or in the R3 KV bucket ``ORCH_CREDS``, and replies
  with a user JWT signed by the issuer account key. That JWT carries the same permissions as the file
  mode: ``role_permissions`` (orchd, orchctl, feed), ``enrol_permissions``, ``agent_permissions`` (scoped
  to the node's job and cloud, recorded with its enrolment at launch and copied to its credential).
- The enrolment flow is the file mode's, and the agent does not change. At launch an enrolment token
  per node (its SHA-256 in the bucket, with an expiry) goes into the user data. The agent connects as
  ``enrol-<node>``, redeems the token over ``orch.enrol.<node>`` (the leader's endpoint), and gets a
  password for ``node-<node>`` (its SHA-256 in the bucket). Secrets are 32 random bytes, so a fast
  hash suffices. Any orchd can check them, and a token minted by one leader can be redeemed through
  the next.
- Revocation (NodeGone) deletes the node's records: every later connection or reconnect is refused.
  A live connection keeps its JWT. The JWT has no expiry, because nats-py closes a connection for good
  on "User Authentication Expired" instead of reconnecting. A gone node's VM is gone too.

Concurrency contract: ``AuthCallout`` and ``CredentialStore`` are asyncio objects on the daemon's
loop; ``CalloutCredentials`` offers the executor's synchronous interface (the executor calls it from a
worker thread, which hops back onto the loop with ``anyio.from_thread``). Secrets are never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.from_thread
import bcrypt
import nats.js.errors
import structlog

from orchestrator.security.credentials import enrol_permissions, serve_enrol_endpoint
from orchestrator.security.nats_auth import (
    AUTH_SUBJECT,
    Permissions,
    agent_permissions,
    check_token,
    node_user,
    role_permissions,
)
from orchestrator.security.nkeys import KeyPair, NkeyError, decode_jwt, encode_jwt
from providers.bootstrap import ENROL_TTL_S, EnrolmentError

log = structlog.get_logger("orchd.authcallout")

CREDS_BUCKET = "ORCH_CREDS"
QUEUE = "orchd-auth"
RESPONSE_TTL_NS = 60 * 10**9  # allow_responses: one reply within 1 min (as the file mode's users)


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


# --- the shared credential records --------------------------------------------------------------------


class CredentialStore:
    """``enrol.<node>`` = {"hashes": [...], "exp": ts, "job", "cloud"} and ``node.<node>`` = {"hash", "job",
    "cloud"} in KV (job and cloud: the launch's, the node's only log and notice subjects)."""

    def __init__(self, kv: Any, clock: Callable[[], float] = time.time) -> None:
        self.kv = kv
        self.clock = clock

    @classmethod
    async def open(cls, js: Any, replicas: int = 1, **kw: Any) -> CredentialStore:
        try:
            kv = await js.key_value(CREDS_BUCKET)
        except nats.js.errors.BucketNotFoundError:
            kv = await js.create_key_value(bucket=CREDS_BUCKET, history=1, replicas=replicas)
        return cls(kv, **kw)

    async def _get(self, key: str) -> tuple[dict | None, int]:
        try:
            entry = await self.kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None, 0
        if not entry.value:
            return None, entry.revision or 0
        return json.loads(entry.value), entry.revision or 0

    async def add_enrolment(self, node_id: str, token: str, ttl_s: float, *, job_id: str | None = None,
                            cloud: str | None = None) -> None:
        """One more valid token for the node (a Launch re-executed after a failover mints another one
        while the VM of the first attempt may still carry the first)."""
        key = f"enrol.{check_token(node_id)}"
        while True:
            rec, rev = await self._get(key)
            hashes = [h for h in (rec or {}).get("hashes", [])][-4:]
            value = json.dumps({"hashes": [*hashes, _digest(token)], "exp": self.clock() + ttl_s,
                                "job": job_id, "cloud": cloud}).encode()
            try:
                await (self.kv.update(key, value, last=rev) if rev else self.kv.create(key, value))
                return
            except nats.js.errors.KeyWrongLastSequenceError:
                continue  # raced with another writer: read again

    def _refusal(self, rec: dict | None, token: str) -> str | None:
        """Why an enrolment record does not accept ``token`` now (unknown | expired), or None."""
        if rec is None or not any(hmac.compare_digest(h, _digest(token)) for h in rec["hashes"]):
            return "unknown"
        return "expired" if self.clock() > rec["exp"] else None

    async def check_enrolment(self, node_id: str, token: str) -> str | None:
        """None if the token is valid now, else the refusal reason (unknown | expired)."""
        rec, _ = await self._get(f"enrol.{check_token(node_id)}")
        return self._refusal(rec, token)

    async def redeem(self, node_id: str, token: str) -> str:
        """The node's new password, once: the enrolment record is deleted (compare-and-set) first.
        (A redeemed token is "unknown": it cannot even log in again, see ``AuthCallout.decide``.)"""
        key = f"enrol.{check_token(node_id)}"
        rec, rev = await self._get(key)
        reason = self._refusal(rec, token)
        if reason is not None:
            raise EnrolmentError(reason, node_id)
        try:
            await self.kv.delete(key, last=rev)
        except nats.js.errors.KeyWrongLastSequenceError:
            raise EnrolmentError("reused", node_id) from None
        password = secrets.token_urlsafe(32)
        scope = rec or {}  # not None: _refusal accepted it
        value = {"hash": _digest(password), "ts": self.clock(), "job": scope.get("job"), "cloud": scope.get("cloud")}
        await self.kv.put(f"node.{node_id}", json.dumps(value).encode())
        return password

    async def check_node(self, node_id: str, password: str) -> bool:
        return await self.node_record(node_id, password) is not None

    async def node_record(self, node_id: str, password: str) -> dict | None:
        """The node's credential record (with its ``job`` and ``cloud``) if ``password`` is its password."""
        rec, _ = await self._get(f"node.{check_token(node_id)}")
        return rec if rec is not None and hmac.compare_digest(rec["hash"], _digest(password)) else None

    async def forget(self, node_id: str) -> bool:
        """Delete the node's enrolment and credential; True if there was either."""
        known = False
        for key in (f"enrol.{check_token(node_id)}", f"node.{node_id}"):
            rec, _ = await self._get(key)
            if rec is not None:
                known = True
                await self.kv.delete(key)
        return known


# --- the callout service --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StaticUser:
    name: str
    password_hash: str  # bcrypt
    role: str  # orchd | orchctl | feed | feed:<cloud> (nats_auth.role_permissions)


class AuthCallout:
    """Answers the servers' authorization requests (``serve``) from the static users and the store."""

    def __init__(self, issuer: KeyPair, store: CredentialStore, static_users: Iterable[StaticUser],
                 *, account: str = "$G") -> None:
        if issuer.kind != "account":
            raise ValueError("the callout issuer must be an account key")
        self.issuer = issuer
        self.store = store
        self.static = {u.name: u for u in static_users}
        self.account = account
        self._verified: set[tuple[str, str]] = set()  # (user, sha256(password)) that bcrypt accepted

    async def decide(self, user: str, password: str) -> tuple[Permissions | None, str]:
        """(permissions, "") for a known user with the right password, else (None, reason)."""
        if user in self.static:
            u = self.static[user]
            key = (user, _digest(password))
            if key not in self._verified:  # bcrypt costs ~50 ms: once per good password, not per login
                if not await anyio.to_thread.run_sync(bcrypt.checkpw, password.encode(), u.password_hash.encode()):
                    return None, "bad_password"
                self._verified.add(key)
            return role_permissions(u.role), ""
        try:
            if user.startswith("enrol-"):
                node = user.removeprefix("enrol-")
                reason = await self.store.check_enrolment(node, password)
                return (enrol_permissions(node), "") if reason is None else (None, f"enrolment_{reason}")
            if user.startswith("node-"):
                node = user.removeprefix("node-")
                rec = await self.store.node_record(node, password)
                if rec is None:
                    return None, "node_unknown_or_revoked"
                return agent_permissions(node, job_id=rec.get("job"), cloud=rec.get("cloud")), ""
        except ValueError:  # not a safe node id
            return None, "bad_user"
        return None, "unknown_user"

    def user_jwt(self, user: str, user_nkey: str, perms: Permissions) -> str:
        nats_claims: dict[str, Any] = {
            "pub": {"allow": list(perms.publish)}, "sub": {"allow": list(perms.subscribe)},
            "subs": -1, "data": -1, "payload": -1, "type": "user", "version": 2,
        }
        if perms.allow_responses:
            nats_claims["resp"] = {"max": 1, "ttl": RESPONSE_TTL_NS}
        return encode_jwt({"sub": user_nkey, "name": user, "aud": self.account, "nats": nats_claims}, self.issuer)

    async def respond_to(self, request: bytes) -> bytes | None:
        """The signed authorization response to one request JWT (None: not a valid server request)."""
        try:
            claims = decode_jwt(request.decode(), issuer_kind="server")
            req = claims["nats"]
            user_nkey, server_id = req["user_nkey"], req["server_id"]["id"]
            opts = req.get("connect_opts") or {}
            user, password = str(opts.get("user") or ""), str(opts.get("pass") or "")
        except (NkeyError, KeyError, TypeError, UnicodeDecodeError) as e:
            log.warning("auth_request_rejected", error=str(e)[:200])
            return None
        perms, reason = await self.decide(user, password)
        body: dict[str, Any] = {"type": "authorization_response", "version": 2}
        if perms is None:
            body["error"] = "not authorized"
            log.warning("auth_denied", user=user[:80], reason=reason)
        else:
            body["jwt"] = self.user_jwt(user, user_nkey, perms)
            log.debug("auth_granted", user=user)
        return encode_jwt({"sub": user_nkey, "aud": server_id, "nats": body}, self.issuer).encode()

    async def serve(self, nc: Any) -> Any:
        """Answer ``$SYS.REQ.USER.AUTH`` on ``nc`` (the auth user's connection), in the queue group."""

        async def handle(msg: Any) -> None:
            try:
                reply = await self.respond_to(msg.data)
            except Exception as e:  # a KV outage: no answer, the server refuses the connection
                log.exception("auth_callout_failed", error=repr(e))
                return
            if reply is not None and msg.reply:
                await msg.respond(reply)

        return await nc.subscribe(AUTH_SUBJECT, queue=QUEUE, cb=handle)


# --- the executor's interface (same as orchestrator.security.credentials.NodeCredentials) ----------------------


class CalloutCredentials:
    """Enrolment tokens at launch, revocation at NodeGone, the enrol endpoint - on the shared store."""

    def __init__(self, store: CredentialStore, *, enrol_ttl_s: float = ENROL_TTL_S) -> None:
        self.store = store
        self.enrol_ttl_s = enrol_ttl_s
        self._tokens: dict[str, str] = {}  # node -> the token this process minted (re-executed launches)

    def on_launch(self, node_ids: Iterable[str], *, job_id: str | None = None,
                  cloud: str | None = None) -> dict[str, str]:
        """node -> enrolment token (called from a worker thread). ``job_id``/``cloud``: the launch's,
        the only log and notice subjects of the nodes' credentials."""
        return anyio.from_thread.run(self._on_launch, list(node_ids), job_id, cloud)

    async def _on_launch(self, node_ids: list[str], job_id: str | None = None,
                         cloud: str | None = None) -> dict[str, str]:
        out = {}
        for n in node_ids:
            agent_permissions(n, job_id=job_id, cloud=cloud)  # unsafe tokens fail here, not at login
            token = self._tokens.get(n)
            if token is None:
                token = secrets.token_urlsafe(32)
                await self.store.add_enrolment(n, token, self.enrol_ttl_s, job_id=job_id, cloud=cloud)
                self._tokens[n] = token
                log.info("enrolment_token_minted", node=n)
            out[n] = token
        return out

    def on_gone(self, node_id: str) -> None:
        anyio.from_thread.run(self._on_gone, node_id)

    async def _on_gone(self, node_id: str) -> None:
        self._tokens.pop(node_id, None)
        if await self.store.forget(node_id):
            log.info("node_credential_revoked", node=node_id)

    async def redeem(self, node_id: str, token: str) -> dict[str, Any]:
        password = await self.store.redeem(node_id, token)
        self._tokens.pop(node_id, None)
        user = node_user(node_id)
        log.info("node_enrolled", node=node_id, user=user)
        return {"user": user, "password": password}

    async def serve(self, nc: Any) -> Any:
        """The enrol endpoint ``orch.enrol.*`` (the leader's)."""
        return await serve_enrol_endpoint(nc, self.redeem)
