"""One frozen, typed Settings object for orchd, loaded once from TOML plus ``ORCH_*`` overrides.

Role: parse and validate configuration at start. Every problem in the file and the environment is
collected and reported in ONE ``SettingsError`` that lists each bad key and why, so an operator fixes
them all in one go. The result is immutable and passed explicitly; nothing reads the environment later.

Environment overrides: ``ORCH_<SECTION>__<KEY>`` (double underscore between path parts), e.g.
``ORCH_NATS__URLS=nats://a:4222,nats://b:4222`` or ``ORCH_DAEMON__HEARTBEAT_TIMEOUT_S=20``. Each
value is converted by its field's type (``wire.config.from_env``): ``ORCH_DAEMON__CLUSTER_ID=2024`` is the
string "2024", a comma splits only a list.

Sections are frozen dataclasses built by the one loader, ``wire.config``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from wire.config import SettingsError, from_env, load_dataclass, merge, read_toml

__all__ = ["Settings", "SettingsError", "load_settings"]

ENV_PREFIX = "ORCH_"


@dataclass(frozen=True, slots=True, kw_only=True)
class NatsSettings:
    urls: tuple[str, ...] = ()
    """Servers to connect to. Empty: start an embedded nats-server with JetStream on loopback."""
    user: str = ""
    password: str = ""
    token: str = ""
    creds_file: str = ""
    """A NATS .creds file (JWT + nkey seed)."""
    nkey_seed_file: str = ""
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_hostname: str = ""
    connect_timeout_s: float = 2.0
    reconnect_wait_s: float = 0.5
    stream_replicas: int = 1
    """JetStream replicas for streams and KV buckets (3 on a cluster)."""
    embedded_port: int = -1
    """Port of the embedded server; -1 picks a free one."""
    embedded_host: str = "127.0.0.1"


@dataclass(frozen=True, slots=True, kw_only=True)
class DaemonSettings:
    state_dir: str = "./var/orchd"
    cluster_id: str = "orch-default"
    """Tag put on every instance this deployment launches; the reaper only touches these."""
    heartbeat_interval_s: float = field(default=2.0, metadata={"gt": 0})
    heartbeat_timeout_s: float = field(default=10.0, metadata={"gt": 0})
    tick_s: float = field(default=1.0, metadata={"gt": 0})
    """Period of the Tick event that drives timers (timeouts, periodic price/budget checks)."""
    price_confirm_s: float = field(default=60.0, metadata={"ge": 0})
    """A new pool price moves money (pause, migration, scale-up, cost accrual, budget stops) only once
    it has held this long (docs/core.md, "Price confirmation"); 0 = at once."""
    shutdown_grace_s: float = 10.0
    command_ack_timeout_s: float = 2.0
    command_retries: int = 5
    liveness_flush_s: float = 5.0
    """Heartbeat-only changes (last_seen, step) are persisted at most this often per node (the core
    leaves them out of ``dirty``); every other change is persisted with its batch."""
    reap_interval_s: float = 0.0
    """Run the orphan reaper (providers.reaper) every this many seconds while leading; 0 = only on
    demand (``orchctl reap``)."""
    reap_grace_s: float = 600.0
    """An instance must look orphaned this long before the reaper terminates it."""
    liveness_flush_max: int = 500
    """At most this many liveness records per batch, so a flush never stalls the decide loop."""
    lease_ttl_s: float = field(default=6.0, metadata={"gt": 0})
    """HA leader lease TTL; the revision is the fencing token."""
    ha: bool = False
    dead_after_deliveries: int = field(default=5, metadata={"gt": 1})
    """A JetStream message delivered this many times without an ack is parked in ``ORCH_DEAD``
    (``orchctl dead list``) and terminated instead of handled again; below ``bus.MAX_DELIVER`` (20)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutorSettings:
    concurrency_per_cloud: int = 4
    retry_base_s: float = 1.0
    retry_max_s: float = 60.0
    max_attempts: int = 6


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsSettings:
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 9464
    """0 picks a free port."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LogSettings:
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "json", "console"] = "auto"
    """auto (console on a TTY, JSON otherwise) | json | console"""


@dataclass(frozen=True, slots=True, kw_only=True)
class FeedSettings:
    enabled: bool = True
    interval_s: float = field(default=300.0, metadata={"gt": 0})


@dataclass(frozen=True, slots=True, kw_only=True)
class ProvidersSettings:
    enabled: tuple[Literal["aws", "gcp", "azure", "local", "fake"], ...] = ()
    """Which providers orchd drives: any of aws, gcp, azure, local, fake."""
    aws: Mapping[str, Any] = field(default_factory=dict)
    gcp: Mapping[str, Any] = field(default_factory=dict)
    azure: Mapping[str, Any] = field(default_factory=dict)
    local: Mapping[str, Any] = field(default_factory=dict)
    fake: Mapping[str, Any] = field(default_factory=dict)
    """Per-provider tables, validated by each provider's own config class at start."""
    feeds: Mapping[str, FeedSettings] = field(default_factory=dict)
    """Price feed per cloud: [providers.feeds.aws] interval_s = 300."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CredentialsSettings:
    """Per-node NATS credentials through enrolment (orchestrator/credentials.py, docs/operations.md)."""

    enabled: bool = False
    """Off: launches carry no credential and nothing is revoked (agents use whatever they are given)."""
    auth_file: str = ""
    """The nats-server users include orchd owns and rewrites (``include "auth.conf"`` in its config)."""
    static_users_file: str = ""
    """JSON list of ``{"name", "password_hash" (bcrypt), "role"}``, always rendered; role: ``orchd``,
    ``orchctl``, ``feed`` (price publisher) or ``feed:<cloud>`` (``nats_auth.role_permissions``)."""
    server_pid_file: str = ""
    """nats-server's ``pid_file``: orchd sends it SIGHUP after each change (same host)."""
    enrol_ttl_s: float = field(default=1800.0, metadata={"gt": 0})
    """Lifetime of an enrolment token in the user data (until the agent redeems it)."""
    mode: str = "file"
    """``file``: orchd rewrites one local server's users include and reloads it (auth_file,
    server_pid_file). ``callout``: every server of a cluster asks orchd (NATS auth callout,
    orchestrator/authcallout.py); credentials live in an R3 KV bucket, any orchd can answer."""
    issuer_seed_file: str = ""
    """callout: the account nkey seed (``SA...``) that signs the user JWTs (a LoadCredential file)."""
    auth_user: str = "orchd-auth"
    """callout: the user orchd answers the callout as (the server config's ``auth_users``)."""
    auth_password_file: str = ""
    """callout: that user's password (a LoadCredential file)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    nats: NatsSettings = NatsSettings()
    daemon: DaemonSettings = DaemonSettings()
    executor: ExecutorSettings = ExecutorSettings()
    metrics: MetricsSettings = MetricsSettings()
    log: LogSettings = LogSettings()
    providers: ProvidersSettings = ProvidersSettings()
    credentials: CredentialsSettings = CredentialsSettings()

    @property
    def state_path(self) -> Path:
        return Path(self.daemon.state_dir)


def load_settings(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Load the TOML file (if any), apply ORCH_* overrides, validate everything, return Settings."""
    raw: dict[str, Any] = read_toml(path) if path is not None else {}
    source = str(path) if path is not None else "settings"
    overrides, problems = from_env(Settings, os.environ if env is None else env, ENV_PREFIX)
    settings, more = load_dataclass(Settings, merge(raw, overrides))
    problems += more
    if settings is not None:
        problems += _cross_checks(settings)
    if problems or settings is None:
        raise SettingsError(problems, source)
    return settings


def _cross_checks(s: Settings) -> list[str]:
    out = []
    if s.daemon.heartbeat_timeout_s <= s.daemon.heartbeat_interval_s:
        out.append("daemon.heartbeat_timeout_s: must be greater than daemon.heartbeat_interval_s")
    if s.nats.tls_cert_file and not s.nats.tls_key_file:
        out.append("nats.tls_key_file: required when nats.tls_cert_file is set")
    c = s.credentials
    if c.mode not in ("file", "callout"):
        out.append(f"credentials.mode: {c.mode!r} is not one of file, callout")
    elif c.enabled:
        if not s.nats.urls:
            out.append("credentials.enabled: needs nats.urls (external nats-servers with authorization; the "
                       "embedded server runs without it)")
        needed = ("auth_file", "server_pid_file") if c.mode == "file" else ("issuer_seed_file", "auth_password_file")
        for name in ("static_users_file", *needed):
            if not getattr(c, name):
                out.append(f"credentials.{name}: required when credentials.enabled (mode {c.mode})")
    return out
