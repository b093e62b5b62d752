"""One frozen, typed Settings object for orchd, loaded once from TOML plus ``ORCH_*`` overrides.

Role: parse and validate configuration at start. Every problem in the file and the environment is
collected and reported in ONE ``SettingsError`` that lists each bad key and why, so an operator fixes
them all in one go. The result is immutable and passed explicitly; nothing reads the environment later.

Environment overrides: ``ORCH_<SECTION>__<KEY>`` (double underscore between path parts), e.g.
``ORCH_NATS__URLS=nats://a:4222,nats://b:4222`` or ``ORCH_DAEMON__HEARTBEAT_TIMEOUT_S=20``. Each
value is converted by its field's type (``wire.config.from_env``): ``ORCH_DAEMON__CLUSTER_ID=2024`` is the
string "2024", a comma splits only a list.

Secrets from systemd credentials: when ``$CREDENTIALS_DIRECTORY`` is set (``LoadCredential=`` in
systemd/orchd.service), each file of ``CREDENTIAL_FILES`` found there fills its setting - a secret
(``nats.password``, ``nats.token``) with the file's text, a file setting (``nats.creds_file``,
``nats.tls_ca_file``, ``credentials.issuer_seed_file`` ...) with the file's path. Precedence: a value
given in the TOML file or an ``ORCH_*`` variable wins; the credentials directory fills only settings left
empty; an empty credential file (the unit's ``SetCredential=`` default for one it may not have) counts
as absent. So the configuration file holds no secret at all.

Sections are frozen dataclasses built by the one loader, ``wire.config``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainer.contract import MODEL_SCHEMES, scheme_names
from wire.config import (
    SettingsError,
    from_env,
    load_dataclass,
    merge,
    problem_path,
    read_toml,
    without_problems,
)
from wire.names import BadName, check_token

__all__ = ["Settings", "SettingsError", "load_settings", "settings_and_problems"]

ENV_PREFIX = "ORCH_"
CREDENTIAL_FILES: dict[str, tuple[str, str, bool]] = {
    "nats.password": ("nats", "password", True),
    "nats.token": ("nats", "token", True),
    "nats.creds": ("nats", "creds_file", False),
    "nats.nkey": ("nats", "nkey_seed_file", False),
    "nats-ca.pem": ("nats", "tls_ca_file", False),
    "nats-client.pem": ("nats", "tls_cert_file", False),
    "nats-client.key": ("nats", "tls_key_file", False),
    "callout-issuer.seed": ("credentials", "issuer_seed_file", False),
    "callout-auth.password": ("credentials", "auth_password_file", False),
}
"""Credential name in ``$CREDENTIALS_DIRECTORY`` -> (section, setting, the value is the file's text (a
secret) rather than its path). The same names as ``orchestrator.security.nats_auth.connect_options``."""


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
    """This deployment's identity: the tag on every instance it launches (the reaper only touches these),
    its MLflow runs and its checkpoint roots. Kept in the state once set: a new state takes this value when
    it is set here, else a unique generated one (``orch-<12 hex digits>``, never this shared default); a
    state of an older release keeps the value it ran with; a state's own identity wins over this one."""
    heartbeat_interval_s: float = field(default=2.0, metadata={"gt": 0})
    heartbeat_timeout_s: float = field(default=10.0, metadata={"gt": 0})
    tick_s: float = field(default=1.0, metadata={"gt": 0})
    """Period of the Tick event that drives timers (timeouts, periodic price/budget checks)."""
    price_confirm_s: float = field(default=60.0, metadata={"ge": 0})
    """A new pool price moves money (pause, migration, scale-up, cost accrual, budget stops) only once
    it has held this long (docs/core.md, "Price confirmation"); 0 = at once."""
    sender_rate_per_s: float = field(default=20.0, metadata={"ge": 0})
    """Per-node rate limit on heartbeats, node events and notices, each (orchestrator/daemon/ratelimit.py):
    messages over it are refused and counted (``rate_limited``) before they are buffered; 0 = no limit."""
    sender_burst: float = field(default=200.0, metadata={"ge": 1})
    restart_backoff_base_s: float = field(default=30.0, metadata={"gt": 0})
    """A job whose generation ended by a trainer failure (also an exit 0 before total_steps) or a storage
    error waits this long before its next generation, doubling with each such end in a row (a commit starts
    over), at most ``restart_backoff_max_s`` (docs/core.md, "Restart hold")."""
    restart_backoff_max_s: float = field(default=900.0, metadata={"gt": 0})
    boot_estimate_s: float = field(default=240.0, metadata={"gt": 0})
    """Launch -> trainer running, as the budget and deadline estimates assume (a launch is refused when the
    budget cannot carry a node through it)."""
    terminate_billing_s: float = field(default=60.0, metadata={"ge": 0})
    """Billing still accrues this long after a Terminate: the tail a budget keeps in reserve at the worst
    price (a job stops once the tail no longer fits). Set both to what the clouds in use show."""
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
    stall_after_s: float = field(default=20.0, metadata={"gt": 0})
    """A leader whose decide loop made no progress this long (connected to NATS) stops feeding the systemd
    watchdog, which then restarts it; keep it above ``lease_ttl_s`` and below the unit's ``WatchdogSec``."""
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
    refresh_s: float = field(default=10.0, metadata={"gt": 0})
    """The gauges computed from the state (jobs, nodes, costs and budgets, heartbeat ages; O(nodes)) are
    recomputed this often, on a Tick; counters and histograms move as events happen. Keep it under the
    scrape interval's multiple the alert windows assume."""


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
class TrackingServer:
    uri: str
    """The MLflow server's URI (http:// or https://, no user part: credentials come from orchd's
    environment, MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN)."""
    plain_http_credentials: bool = False
    """Send orchd's MLflow credentials to this server over plain http (refused unless set: https only)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrackingSettings:
    """``[tracking]``: the MLflow servers orchd may use (docs/tracking.md). A job spec names one of them
    (``tracking.server``) or inherits ``default``; orchd never sends its credentials anywhere else."""

    servers: Mapping[str, TrackingServer] = field(default_factory=dict)
    default: str = ""
    """The server of a spec's ``[tracking]`` that names none ("" = such a spec is refused)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerSettings:
    """``[trainer]``: what the jobs' trainers may do on the nodes, whatever a job spec says."""

    model_schemes: tuple[str, ...] = MODEL_SCHEMES
    """Where a Hugging Face model, tokenizer or dataset (``trainer.args.model`` / ``tokenizer`` / ``dataset``) may
    come from: any of file, s3, gs, az, hub, builtin (aliases s3a, gcs, abfs, abfss). A job whose source shows
    another scheme is refused at submit; every generation gets the list (``ORCH_MODEL_SCHEMES``) and its trainer
    refuses the rest (a bare name: a hub id or a relative path, only the node can tell). A job cannot set it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    nats: NatsSettings = NatsSettings()
    daemon: DaemonSettings = DaemonSettings()
    executor: ExecutorSettings = ExecutorSettings()
    metrics: MetricsSettings = MetricsSettings()
    log: LogSettings = LogSettings()
    providers: ProvidersSettings = ProvidersSettings()
    credentials: CredentialsSettings = CredentialsSettings()
    tracking: TrackingSettings = TrackingSettings()
    trainer: TrainerSettings = TrainerSettings()

    @property
    def state_path(self) -> Path:
        return Path(self.daemon.state_dir)


def load_settings(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Load the TOML file (if any), apply ORCH_* overrides, validate everything, return Settings."""
    settings, problems = settings_and_problems(path, env)
    if problems or settings is None:
        raise SettingsError(problems, str(path) if path is not None else "settings")
    return settings


def settings_and_problems(path: str | os.PathLike[str] | None = None,
                          env: Mapping[str, str] | None = None) -> tuple[Settings | None, list[str]]:
    """(settings, every problem). With problems the settings are built from the valid part (each bad key at
    its default), so that orchd's later start-up checks (providers, ports) still run and join the one
    report; None only when the file cannot be read. Never use such settings to run."""
    env = os.environ if env is None else env
    try:
        raw: dict[str, Any] = read_toml(path) if path is not None else {}
    except SettingsError as e:
        return None, list(e.problems)
    overrides, problems = from_env(Settings, env, ENV_PREFIX)
    merged = merge(raw, overrides)
    settings, more = load_dataclass(Settings, merged)
    problems += more
    if settings is None:
        settings, _ = load_dataclass(Settings, without_problems(merged, more))
    if settings is not None:
        settings = _with_credentials_directory(settings, env, problems)
        failed = {problem_path(p).split(".")[0] for p in problems}  # a rule on a stand-in default says nothing
        problems += [p for p in _cross_checks(settings) if problem_path(p).split(".")[0] not in failed]
    return settings, problems


def _with_credentials_directory(s: Settings, env: Mapping[str, str], problems: list[str]) -> Settings:
    """``s`` with every empty setting of ``CREDENTIAL_FILES`` filled from ``$CREDENTIALS_DIRECTORY``."""
    cdir = env.get("CREDENTIALS_DIRECTORY", "")
    if not cdir:
        return s
    if not os.path.isdir(cdir):
        problems.append(f"CREDENTIALS_DIRECTORY: {cdir!r} is not a directory")
        return s
    for name, (section, key, secret) in CREDENTIAL_FILES.items():
        path = os.path.join(cdir, name)
        table = getattr(s, section)
        if getattr(table, key) or not os.path.isfile(path):
            continue  # the configuration's own value wins; a credential the unit did not load is absent
        try:
            with open(path) as f:
                text = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            problems.append(f"{section}.{key}: cannot read credential {path}: {e}")
            continue
        if text:  # empty: the unit's SetCredential= default, i.e. not given
            s = dataclasses.replace(s, **{section: dataclasses.replace(table, **{key: text if secret else path})})
    return s


def _cross_checks(s: Settings) -> list[str]:
    out = []
    try:  # instances are tagged with it and MLflow runs carry it: a token (wire.names)
        check_token("daemon.cluster_id", s.daemon.cluster_id)
    except BadName as e:
        out.append(str(e))
    if s.nats.password and not s.nats.user:
        out.append("nats.password: given (in the settings or as credential nats.password) but nats.user is "
                   "empty: name the user it belongs to")
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
    return out + _tracking_checks(s.tracking) + _trainer_checks(s.trainer)


def _trainer_checks(t: TrainerSettings) -> list[str]:
    unknown = [x for x in scheme_names(t.model_schemes) if x not in MODEL_SCHEMES]
    if unknown:
        return [f"trainer.model_schemes: {', '.join(repr(x) for x in unknown)} not among {', '.join(MODEL_SCHEMES)}"]
    if not scheme_names(t.model_schemes):
        return [f"trainer.model_schemes: name at least one of {', '.join(MODEL_SCHEMES)} (builtin alone: only the "
                "model configs shipped with the trainer)"]
    return []


def _tracking_checks(t: TrackingSettings) -> list[str]:
    out = []
    for name, server in t.servers.items():
        if not name or not all(ch.isalnum() or ch in "_-" for ch in name) or len(name) > 64:
            out.append(f"tracking.servers.{name[:64]}: a server's name is letters, digits, '_' and '-' (1-64)")
        scheme, _, rest = server.uri.partition("://")
        host = rest.split("/", 1)[0]
        if scheme not in ("http", "https") or not host:
            out.append(f"tracking.servers.{name}.uri: an http:// or https:// URI with a host, got "
                       f"{server.uri[:100]!r}")
        elif "@" in host:  # never echo the secret back
            out.append(f"tracking.servers.{name}.uri: must not carry credentials (user:password@host): orchd "
                       "takes them from its environment (MLFLOW_TRACKING_USERNAME/PASSWORD or _TOKEN)")
    if t.default and t.default not in t.servers:
        out.append(f"tracking.default: {t.default!r} is not one of tracking.servers ({', '.join(sorted(t.servers))})")
    return out
