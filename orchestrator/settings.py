"""One frozen, typed Settings object for orchd, loaded once from TOML plus ``ORCH_*`` overrides.

Role: parse and validate configuration at start. Every problem in the file and the environment is
collected and reported in ONE ``SettingsError`` that lists each bad key and why, so an operator fixes
them all in one go. The result is immutable and passed explicitly; nothing reads the environment later.

Environment overrides: ``ORCH_<SECTION>__<KEY>`` (double underscore between path parts), e.g.
``ORCH_NATS__URLS=nats://a:4222,nats://b:4222`` or ``ORCH_DAEMON__HEARTBEAT_TIMEOUT_S=20``. Values
are parsed as TOML scalars where they can be (numbers, booleans), lists split on commas.

Sections are frozen dataclasses; ``load_dataclass`` works for any of them (providers reuse it).
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

ENV_PREFIX = "ORCH_"


class SettingsError(ValueError):
    def __init__(self, problems: list[str], source: str = "settings") -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid {source} ({len(problems)} problem{'s' * (len(problems) != 1)}):\n{lines}")


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
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 10.0
    tick_s: float = 1.0
    """Period of the Tick event that drives timers (timeouts, periodic price/budget checks)."""
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
    lease_ttl_s: float = 6.0
    """HA leader lease TTL; the revision is the fencing token."""
    ha: bool = False


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
    level: str = "info"
    format: str = "auto"
    """auto (console on a TTY, JSON otherwise) | json | console"""


@dataclass(frozen=True, slots=True, kw_only=True)
class FeedSettings:
    enabled: bool = True
    interval_s: float = 300.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ProvidersSettings:
    enabled: tuple[str, ...] = ()
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
    """JSON list of ``{"name", "password_hash" (bcrypt), "role": "orchd" | "orchctl"}``, always rendered."""
    server_pid_file: str = ""
    """nats-server's ``pid_file``: orchd sends it SIGHUP after each change (same host)."""
    enrol_ttl_s: float = 1800.0
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


_CHOICES: dict[tuple[type, str], tuple[str, ...]] = {
    (LogSettings, "level"): ("debug", "info", "warning", "error"),
    (LogSettings, "format"): ("auto", "json", "console"),
    (ProvidersSettings, "enabled"): ("aws", "gcp", "azure", "local", "fake"),
}
_POSITIVE = {"heartbeat_interval_s", "heartbeat_timeout_s", "tick_s", "interval_s", "lease_ttl_s", "enrol_ttl_s"}


def load_settings(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Load the TOML file (if any), apply ORCH_* overrides, validate everything, return Settings."""
    raw: dict[str, Any] = {}
    problems: list[str] = []
    source = "settings"
    if path is not None:
        source = str(path)
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except FileNotFoundError:
            raise SettingsError([f"file not found: {path}"], source) from None
        except tomllib.TOMLDecodeError as e:
            raise SettingsError([f"not valid TOML: {e}"], source) from None
    problems += _apply_env(raw, os.environ if env is None else env)
    settings, more = load_dataclass(Settings, raw)
    problems += more
    if settings is not None:
        problems += _cross_checks(settings)
    if problems:
        raise SettingsError(problems, source)
    assert settings is not None
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


def _apply_env(raw: dict[str, Any], env: Mapping[str, str]) -> list[str]:
    problems = []
    for key, value in env.items():
        if not key.startswith(ENV_PREFIX) or "__" not in key:
            continue
        parts = [p.lower() for p in key[len(ENV_PREFIX) :].split("__")]
        if not all(parts):
            problems.append(f"{key}: empty path component")
            continue
        node = raw
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                problems.append(f"{key}: {'.'.join(parts[:-1])} is not a table")
                break
            node = child
        else:
            node[parts[-1]] = _parse_env_value(value)
    return problems


def _parse_env_value(value: str) -> Any:
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    if "," in value:
        return [v.strip() for v in value.split(",") if v.strip()]
    return value


def load_dataclass(cls: type[T], raw: Any, path: str = "") -> tuple[T | None, list[str]]:
    """Build frozen dataclass ``cls`` from ``raw``; return (instance or None, every problem found)."""
    where = path or "<root>"
    if not isinstance(raw, Mapping):
        return None, [f"{where}: expected a table, got {type(raw).__name__}"]
    problems: list[str] = []
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for key in raw:
        if key not in fields:
            known = ", ".join(sorted(fields))
            problems.append(f"{_join(path, key)}: unknown key (known: {known})")
    kwargs: dict[str, Any] = {}
    for name in fields:
        if name not in raw:
            continue
        value, more = _convert(hints[name], raw[name], _join(path, name), cls, name)
        problems += more
        if not more:
            kwargs[name] = value
    if problems:
        return None, problems
    return cls(**kwargs), []


def load_checked(cls: type[T], raw: Any, path: str) -> T:
    """``load_dataclass`` plus the class's own ``check(path) -> list[str]`` cross checks; raise one
    SettingsError listing every problem (used by each provider's Config)."""
    cfg, problems = load_dataclass(cls, raw, path)
    if cfg is not None:
        problems += cfg.check(path)  # type: ignore[attr-defined]
    if problems:
        raise SettingsError(problems, path)
    assert cfg is not None
    return cfg


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _convert(tp: Any, value: Any, path: str, owner: type, name: str) -> tuple[Any, list[str]]:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return load_dataclass(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        errors: list[str] = []
        for arg in args:
            if arg is type(None) and value is None:
                return None, []
            v, errs = _convert(arg, value, path, owner, name)
            if not errs:
                return v, []
            errors = errs
        return None, errors
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple):
            return None, [f"{path}: expected a list, got {type(value).__name__}"]
        item_tp = args[0] if args else Any
        out, problems = [], []
        for i, item in enumerate(value):
            v, errs = _convert(item_tp, item, f"{path}[{i}]", owner, name)
            out.append(v)
            problems += errs
        return tuple(out), problems
    if origin in (Mapping, dict) or tp in (Mapping, dict):
        if not isinstance(value, Mapping):
            return None, [f"{path}: expected a table, got {type(value).__name__}"]
        val_tp = args[1] if len(args) == 2 else Any
        if val_tp is Any:
            return dict(value), []
        out_map, problems = {}, []
        for k, item in value.items():
            v, errs = _convert(val_tp, item, f"{path}.{k}", owner, name)
            out_map[k] = v
            problems += errs
        return out_map, problems
    if tp is Any:
        return value, []
    if tp is bool:
        if isinstance(value, bool):
            return value, []
        return None, [f"{path}: expected true/false, got {value!r}"]
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if name in _POSITIVE and value <= 0:
                return None, [f"{path}: must be > 0, got {value!r}"]
            return float(value), []
        return None, [f"{path}: expected a number, got {value!r}"]
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value, []
        return None, [f"{path}: expected an integer, got {value!r}"]
    if tp is str:
        if not isinstance(value, str):
            return None, [f"{path}: expected a string, got {value!r}"]
        choices = _CHOICES.get((owner, name))
        if choices and value not in choices:
            return None, [f"{path}: {value!r} is not one of {', '.join(choices)}"]
        return value, []
    return None, [f"{path}: unsupported setting type {tp!r}"]
