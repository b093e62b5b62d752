"""The agent's configuration: one frozen ``AgentConfig`` from a TOML file, ``ORCH_AGENT_*`` env and flags.

Precedence: command-line flags > environment ``ORCH_AGENT_<KEY>`` > ``--config FILE`` (TOML, the same
keys as the fields below) > defaults. Loading is ``wire.config``'s (the one loader of the product): each
source becomes a raw table, environment strings and string flags are converted by their field's type,
the tables are merged in that order and checked once; every bad key or value is reported in one
``ConfigError``, each problem named by where its value came from (``--flag``, ``ORCH_AGENT_KEY`` or
``FILE: key``).

Names the bootstrap script writes (providers/bootstrap.py) are understood: ``ORCH_AGENT_NODE_ID``,
``ORCH_AGENT_NATS_URLS`` (comma separated), ``ORCH_AGENT_CLOUD`` (the metadata flavour to watch),
``ORCH_AGENT_ENROL_TOKEN`` (redeemed for the node's NATS credential, see agent/connection.py).
Secrets: ``nats_password`` / ``nats_token`` from the environment or the file, never needed on a command
line. Under systemd (``LoadCredential=`` in systemd/orch-agent.service) the files of
``CREDENTIAL_FILES`` in ``$CREDENTIALS_DIRECTORY`` fill the settings left empty, with orchd's precedence
(orchestrator/settings.py): a value given by a flag, the environment or the file wins; an empty credential
file (the unit's ``SetCredential=`` default for one this node may not have) counts as absent. An enrolled
node has no password credential: it redeems ``enrol_token`` instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import socket
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from agent.watchers import DEFAULT_ENDPOINT
from wire import PoolKey
from wire.config import SettingsError, env_value, from_env, load_dataclass, merge, read_toml

ENV_PREFIX = "ORCH_AGENT_"

MetadataFlavour = Literal["aws", "gcp", "azure", "none"]
LogLevel = Literal["debug", "info", "warning", "error"]


class ConfigError(SettingsError):
    """Every problem of the agent's configuration, each ``where: what is wrong``."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__(problems, "orch-agent configuration")


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentConfig:
    node_id: str
    nats_urls: tuple[str, ...] = ("nats://127.0.0.1:4222",)
    nats_user: str = ""
    nats_password: str = ""
    nats_token: str = ""
    nats_creds_file: str = ""
    nats_tls_ca_file: str = ""
    enrol_token: str = ""
    """Single-use enrolment token from the bootstrap (``ORCH_AGENT_ENROL_TOKEN``): exchanged once over
    NATS for this node's own credential, which is kept in ``<work_dir>/nats-credential.json`` (0600)."""
    metadata: MetadataFlavour = "none"
    """Metadata flavour to watch: aws | gcp | azure | none."""
    metadata_endpoint: str = DEFAULT_ENDPOINT
    cloud_name: str = ""
    """Cloud named in notice subjects and payloads; empty: the metadata flavour."""
    work_dir: str = "./var/agent"
    instance_id: str = ""
    pool: PoolKey | None = None
    heartbeat_s: float = field(default=2.0, metadata={"gt": 0})
    metadata_poll_s: float = field(default=0.5, metadata={"gt": 0})
    gcp_notice_s: float = field(default=30.0, metadata={"gt": 0})
    checkpoint_on_notice: bool = True
    sigterm_grace_s: float = field(default=30.0, metadata={"ge": 0})
    collective_timeout_s: float = field(default=60.0, metadata={"gt": 0})
    exit_with_parent: bool = False
    advertise_host: str = ""
    """Address other nodes reach this one at (the rendezvous host when it is rank 0); default: hostname."""
    warm_ranks: int = field(default=0, metadata={"ge": 0})
    """Pre-started interpreters with torch imported, handed to the next generation's ranks (0 = off)."""
    log_level: LogLevel = "info"


# other names of a setting, in the TOML file and the environment (the bootstrap writes ORCH_AGENT_CLOUD)
_ALIASES = {"cloud": "metadata", "nats_url": "nats_urls", "creds": "nats_creds_file", "nats_creds": "nats_creds_file"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orch-agent", description="The orchd node agent (see docs/agent.md).")
    a = p.add_argument
    a("--config", "-c", help="TOML file with the same keys as the options (underscores)")
    a("--version", action="version", version="%(prog)s " + next(
        (d.version for d in importlib.metadata.distributions(name="spot-orchestrator")), "unknown"))
    a("--node-id")
    a("--nats-url", action="append", dest="nats_urls", help="NATS server URL (repeatable)")
    a("--nats-user")
    a("--nats-password", help="prefer ORCH_AGENT_NATS_PASSWORD or the credentials directory")
    a("--nats-token", help="prefer ORCH_AGENT_NATS_TOKEN")
    a("--nats-creds", dest="nats_creds_file", help="NATS .creds file")
    a("--nats-tls-ca", dest="nats_tls_ca_file", help="CA bundle for TLS to NATS")
    a("--metadata", choices=get_args(MetadataFlavour), help="metadata service to watch (env ORCH_AGENT_CLOUD)")
    a("--metadata-endpoint", help=f"default {DEFAULT_ENDPOINT}")
    a("--cloud-name", help="cloud in notice subjects (default: the metadata flavour)")
    a("--work-dir")
    a("--instance-id")
    a("--pool", help="the node's PoolKey as JSON")
    a("--heartbeat-s", type=float)
    a("--metadata-poll-s", type=float)
    a("--gcp-notice-s", type=float)
    a("--sigterm-grace-s", type=float)
    a("--collective-timeout-s", type=float)
    a("--no-checkpoint-on-notice", dest="checkpoint_on_notice", action="store_const", const=False,
      help="only report notices; wait for orchd's checkpoint command")
    a("--advertise-host", help="address peers use to reach this node (default: hostname)")
    a("--warm-ranks", type=int, help="pre-start this many interpreters with torch imported")
    a("--exit-with-parent", action="store_const", const=True, help="leave when the parent process exits")
    a("--log-level", choices=get_args(LogLevel))
    return p


class _Sources:
    """The raw tables of the sources, lowest first, and where each key's winning value came from."""

    def __init__(self) -> None:
        self.raw: dict[str, Any] = {}
        self.where: dict[str, str] = {}
        self.problems: list[str] = []

    def add(self, table: Mapping[str, Any], where: Mapping[str, str]) -> None:
        self.raw = merge(self.raw, table)
        self.where.update(where)

    def named(self, problem: str) -> str:
        """``key...: why`` -> ``<where the key's value came from>...: why``."""
        for key, where in self.where.items():
            if problem.startswith(key) and problem[len(key):len(key) + 1] in (":", "[", "."):
                return where + problem[len(key):]
        return problem


def _toml_source(path: str) -> tuple[dict[str, Any], dict[str, str]]:
    try:
        table = read_toml(path)
    except SettingsError as e:
        raise ConfigError([f"{path}: {p}" for p in e.problems]) from None
    table = {_ALIASES.get(k, k): v for k, v in table.items()}
    if isinstance(table.get("nats_urls"), str):  # files written for earlier agents give "url1,url2"
        table["nats_urls"] = [u.strip() for u in table["nats_urls"].split(",") if u.strip()]
    return table, {k: f"{path}: {k}" for k in table}


def _env_source(env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    renamed: dict[str, str] = {}
    where: dict[str, str] = {}
    for key, text in env.items():
        if key.startswith(ENV_PREFIX):
            name = key[len(ENV_PREFIX):].lower()
            name = _ALIASES.get(name, name)
            renamed[ENV_PREFIX + name.upper()] = text
            where[name] = key
    table, problems = from_env(AgentConfig, renamed, ENV_PREFIX, nested=False)
    for name in table:
        if renamed[ENV_PREFIX + name.upper()] == "" and _optional(name):
            table[name] = None  # ORCH_AGENT_POOL= : no value
    return table, where, problems


def _flag_source(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    hints = typing.get_type_hints(AgentConfig)
    table: dict[str, Any] = {}
    for name, value in vars(args).items():
        if name == "config" or value is None:
            continue
        if isinstance(value, str):  # typed flags (floats, ints, lists) are converted by argparse already
            value = None if value == "" and _optional(name) else env_value(hints[name], value)
        table[name] = value
    return table, {k: f"--{k.replace('_', '-')}" for k in table}


def _optional(name: str) -> bool:
    return type(None) in get_args(typing.get_type_hints(AgentConfig)[name])


CREDENTIAL_FILES: dict[str, tuple[str, bool]] = {
    "nats.password": ("nats_password", True),
    "nats.token": ("nats_token", True),
    "nats.creds": ("nats_creds_file", False),
    "nats-ca.pem": ("nats_tls_ca_file", False),
}
"""Credential name -> (setting, the value is the file's text rather than its path)."""


def _with_credentials_directory(cfg: AgentConfig, env: Mapping[str, str]) -> AgentConfig:
    creds_dir = env.get("CREDENTIALS_DIRECTORY", "")
    if not creds_dir:
        return cfg
    problems = []
    for name, (key, secret) in CREDENTIAL_FILES.items():
        path = os.path.join(creds_dir, name)
        if getattr(cfg, key) or not os.path.isfile(path):
            continue
        try:
            with open(path) as f:
                text = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            problems.append(f"CREDENTIALS_DIRECTORY: cannot read credential {path}: {e}")
            continue
        if text:
            change: dict[str, Any] = {key: text if secret else path}
            cfg = dataclasses.replace(cfg, **change)
    if problems:
        raise ConfigError(problems)
    return cfg


def load_config(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> AgentConfig:
    env = os.environ if env is None else env
    args = build_parser().parse_args(argv)
    sources = _Sources()
    sources.add({"node_id": socket.gethostname().split(".")[0]}, {"node_id": "default node_id"})
    if args.config:
        sources.add(*_toml_source(args.config))
    table, where, env_problems = _env_source(env)
    sources.add(table, where)
    sources.add(*_flag_source(args))
    cfg, problems = load_dataclass(AgentConfig, sources.raw)
    problems = env_problems + [sources.named(p) for p in problems]
    if problems or cfg is None:
        raise ConfigError(problems)
    return _with_credentials_directory(cfg, env)
