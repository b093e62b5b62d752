"""Node bootstrap: the user data / startup script that installs and starts orch-agent, and enrolment.

Role: render the script every provider passes to a new VM (EC2 user data, GCE ``startup-script``
metadata, Azure ``user_data``), and the enrolment design that keeps long-lived secrets out of it.

Why enrolment: user data and instance metadata are readable by any process on the VM that can reach
169.254.169.254 (a container, a compromised trainer dependency), and on AWS/GCP for the VM's lifetime.
So the script carries NO NATS credential. It carries a short-lived, single-use *enrolment token*
(``EnrolmentBroker.mint``). At start the agent presents (node id, token) to orchd; orchd redeems it once
(``EnrolmentBroker.redeem``) and answers with the node's real credential from a ``CredentialIssuer``
(scoped to that node's subjects: issue 7). The agent stores it on local disk (root, 0600). After that
the token in the metadata service is worthless: redeemed tokens and expired tokens are refused, and a
second redemption attempt is reported (it means someone else read the user data). On AWS the launch
also sets IMDSv2-only with a hop limit of 1, so containers on the host cannot reach the metadata.

Concurrency contract: ``EnrolmentBroker`` is thread-safe (one lock); rendering is pure.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import shlex
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from providers.base import NodeBootstrap

ENROL_TTL_S = 1800.0
"""Default lifetime of an enrolment token: long enough to boot and pip install, short enough to be useless later."""


@runtime_checkable
class CredentialIssuer(Protocol):
    """Issues and revokes a node's NATS credential (issue 7 implements it: creds scoped to the node's subjects).

    ``issue`` returns the credential text (e.g. a .creds file: JWT + nkey seed); ``revoke`` makes it
    useless (called when the node is terminated or reaped). Both may block; both must be thread-safe."""

    def issue(self, node_id: str) -> str: ...

    def revoke(self, node_id: str) -> None: ...


class EnrolmentError(Exception):
    """A token was refused. ``reason``: unknown | expired | reused | wrong_node."""

    def __init__(self, reason: str, node_id: str) -> None:
        super().__init__(f"enrolment refused for {node_id}: {reason}")
        self.reason = reason
        self.node_id = node_id


@dataclass(slots=True)
class _Pending:
    digest: bytes
    expires_ts: float
    redeemed: bool = False


class EnrolmentBroker:
    """Mints single-use enrolment tokens and exchanges them for the node's credential.

    Only a hash of each token is kept (a dump of orchd's memory or state does not yield usable tokens).
    A node may hold several live tokens: a launch retried under the same idempotency token gets a
    freshly minted token, but the provider may return the VM of the first attempt, whose user data
    carries the first token. Any live token of the node enrols it, once; after that every token of that
    node is refused (``reused``).

    State is in memory: a token minted by a daemon that restarts before the node enrols is refused and
    the node never registers; the heartbeat timeout replaces it. (Persisting the hashes in KV would
    survive restarts; a later step.)"""

    def __init__(self, issuer: CredentialIssuer, *, ttl_s: float = ENROL_TTL_S,
                 clock: Callable[[], float] = time.time) -> None:
        self._issuer = issuer
        self._ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[str, list[_Pending]] = {}
        self._enrolled: set[str] = set()

    def mint(self, node_id: str) -> str:
        token = secrets.token_urlsafe(32)
        with self._lock:
            self._pending.setdefault(node_id, []).append(_Pending(_digest(node_id, token), self._clock() + self._ttl_s))
        return token

    def mint_for(self, bootstrap: NodeBootstrap, node_ids: tuple[str, ...]) -> NodeBootstrap:
        """The bootstrap with a fresh per-node token for each node (what the executor passes to launch)."""
        import msgspec

        return msgspec.structs.replace(bootstrap, credential="",
                                       node_credentials={n: self.mint(n) for n in node_ids})

    def redeem(self, node_id: str, token: str) -> str:
        """The node's credential, once. Raises EnrolmentError for unknown, expired or reused tokens."""
        digest = _digest(node_id, token)
        with self._lock:
            tokens = self._pending.get(node_id)
            if not tokens:
                raise EnrolmentError("reused" if node_id in self._enrolled else "unknown", node_id)
            match = next((p for p in tokens if hmac.compare_digest(p.digest, digest)), None)
            if match is None:
                raise EnrolmentError("wrong_token", node_id)
            if match.redeemed or node_id in self._enrolled:
                raise EnrolmentError("reused", node_id)
            if self._clock() > match.expires_ts:
                tokens.remove(match)
                raise EnrolmentError("expired", node_id)
            for p in tokens:  # one enrolment per node: every other token of it is dead now
                p.redeemed = True
            self._enrolled.add(node_id)
        return self._issuer.issue(node_id)

    def forget(self, node_id: str) -> None:
        """The node is gone: drop its tokens and revoke its credential."""
        with self._lock:
            self._pending.pop(node_id, None)
            self._enrolled.discard(node_id)
        self._issuer.revoke(node_id)

    def expire(self) -> int:
        """Drop expired, never-redeemed tokens; returns how many."""
        now = self._clock()
        n = 0
        with self._lock:
            for node_id in list(self._pending):
                keep = [p for p in self._pending[node_id] if p.redeemed or now <= p.expires_ts]
                n += len(self._pending[node_id]) - len(keep)
                if keep:
                    self._pending[node_id] = keep
                else:
                    del self._pending[node_id]
        return n


def _digest(node_id: str, token: str) -> bytes:
    return hashlib.sha256(f"{node_id}\0{token}".encode()).digest()


def render_user_data(node_id: str, bootstrap: NodeBootstrap, *, cloud: str) -> str:
    """A bash script (cloud-init runs it as root at first boot; GCE runs it at every boot).

    It installs the agent into /opt/orch-agent, writes /etc/orch-agent/agent.env (0600) with the node id, the
    NATS URLs and the enrolment token, and starts the ``orch-agent`` systemd unit. Every value is
    shell-quoted. Idempotent: a second run (GCE reboot) reinstalls nothing and restarts the unit."""
    token = bootstrap.node_credentials.get(node_id, bootstrap.credential)
    env = {
        "ORCH_AGENT_NODE_ID": node_id,
        "ORCH_AGENT_CLOUD": cloud,
        "ORCH_AGENT_NATS_URLS": ",".join(bootstrap.nats_urls),
        "ORCH_AGENT_ENROL_TOKEN": token,
    }
    env_lines = "\n".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    args = " ".join(shlex.quote(a) for a in bootstrap.agent_args)
    pkg = shlex.quote(bootstrap.agent_package)
    return f"""#!/bin/bash
# orch-agent bootstrap for node {shlex.quote(node_id)} (rendered by orchd; no long-lived secret here:
# ORCH_AGENT_ENROL_TOKEN is single-use and short-lived, exchanged by the agent for its NATS credential).
set -euo pipefail
umask 077
mkdir -p /etc/orch-agent /var/lib/orch-agent
cat > /etc/orch-agent/agent.env <<'ORCH_ENV_EOF'
{env_lines}
ORCH_ENV_EOF
chmod 600 /etc/orch-agent/agent.env
if [ ! -x /opt/orch-agent/bin/orch-agent ]; then
  python3 -m venv /opt/orch-agent
  /opt/orch-agent/bin/pip install --quiet {pkg}
fi
cat > /etc/systemd/system/orch-agent.service <<'ORCH_UNIT_EOF'
[Unit]
Description=orch-agent (spot training node agent)
After=network-online.target
Wants=network-online.target

[Service]
EnvironmentFile=/etc/orch-agent/agent.env
ExecStart=/opt/orch-agent/bin/orch-agent --work-dir /var/lib/orch-agent {args}
Restart=on-failure
RestartSec=2
KillSignal=SIGTERM
TimeoutStopSec=90

[Install]
WantedBy=multi-user.target
ORCH_UNIT_EOF
systemctl daemon-reload
systemctl enable orch-agent.service
systemctl restart orch-agent.service
"""
