"""The agent's configuration: one frozen ``AgentConfig`` from a TOML file, ``ORCH_AGENT_*`` env and flags.

Precedence: command-line flags > environment ``ORCH_AGENT_<KEY>`` > ``--config FILE`` (TOML, the same
keys as the fields below) > defaults. Every bad key or value is reported in one ``ConfigError``.

Names the bootstrap script writes (providers/bootstrap.py) are understood: ``ORCH_AGENT_NODE_ID``,
``ORCH_AGENT_NATS_URLS`` (comma separated), ``ORCH_AGENT_CLOUD`` (the metadata flavour to watch),
``ORCH_AGENT_ENROL_TOKEN`` (redeemed for the node's NATS credential, see agent/main.py ``enrol``).
Secrets: ``nats_password`` / ``nats_token`` from the environment or the file, never needed on a command
line; under systemd, ``$CREDENTIALS_DIRECTORY/nats.password`` (LoadCredential=) is used when no
password is configured, and ``$CREDENTIALS_DIRECTORY/nats-ca.pem`` as the TLS CA when present.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from agent.watchers import DEFAULT_ENDPOINT
from wire import PoolKey

ENV_PREFIX = "ORCH_AGENT_"


class ConfigError(ValueError):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("invalid orch-agent configuration:\n" + "\n".join(f"  - {p}" for p in problems))
        self.problems = problems


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
    metadata: str = "none"
    """Metadata flavour to watch: aws | gcp | azure | none."""
    metadata_endpoint: str = DEFAULT_ENDPOINT
    cloud_name: str = ""
    """Cloud named in notice subjects and payloads; empty: the metadata flavour."""
    work_dir: str = "./var/agent"
    instance_id: str = ""
    pool: PoolKey | None = None
    heartbeat_s: float = 2.0
    metadata_poll_s: float = 0.5
    gcp_notice_s: float = 30.0
    checkpoint_on_notice: bool = True
    sigterm_grace_s: float = 30.0
    collective_timeout_s: float = 60.0
    exit_with_parent: bool = False
    advertise_host: str = ""
    """Address other nodes reach this one at (the rendezvous host when it is rank 0); default: hostname."""
    warm_ranks: int = 0
    """Pre-started interpreters with torch imported, handed to the next generation's ranks (0 = off)."""
    log_level: str = "info"


_ALIASES = {"cloud": "metadata", "nats_url": "nats_urls", "creds": "nats_creds_file", "nats_creds": "nats_creds_file"}
_CHOICES = {"metadata": ("aws", "gcp", "azure", "none"), "log_level": ("debug", "info", "warning", "error")}


def _convert(name: str, tp: Any, value: Any) -> Any:
    if name == "pool":
        if isinstance(value, str):
            return msgspec.json.decode(value, type=PoolKey) if value else None
        return msgspec.convert(value, PoolKey)
    if name == "nats_urls":
        items = value.split(",") if isinstance(value, str) else list(value)
        return tuple(u.strip() for u in items if str(u).strip())
    if tp in (float, "float"):
        return float(value)
    if tp in (int, "int"):
        if isinstance(value, bool):
            raise ValueError("expected an integer")
        return int(value)
    if tp in (bool, "bool"):
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"expected true/false, got {value!r}")
    value = str(value)
    if name in _CHOICES and value not in _CHOICES[name]:
        raise ValueError(f"{value!r} is not one of {', '.join(_CHOICES[name])}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orch-agent", description="The orchd node agent (see docs/agent.md).")
    a = p.add_argument
    a("--config", "-c", help="TOML file with the same keys as the options (underscores)")
    a("--node-id")
    a("--nats-url", action="append", dest="nats_urls", help="NATS server URL (repeatable)")
    a("--nats-user")
    a("--nats-password", help="prefer ORCH_AGENT_NATS_PASSWORD or the credentials directory")
    a("--nats-token", help="prefer ORCH_AGENT_NATS_TOKEN")
    a("--nats-creds", dest="nats_creds_file", help="NATS .creds file")
    a("--nats-tls-ca", dest="nats_tls_ca_file", help="CA bundle for TLS to NATS")
    a("--metadata", choices=_CHOICES["metadata"], help="metadata service to watch (env ORCH_AGENT_CLOUD)")
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
    a("--log-level", choices=_CHOICES["log_level"])
    return p


def load_config(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> AgentConfig:
    env = os.environ if env is None else env
    args = build_parser().parse_args(argv)
    fields = {f.name: f for f in dataclasses.fields(AgentConfig)}
    raw: dict[str, Any] = {}
    problems: list[str] = []
    if args.config:
        try:
            with open(args.config, "rb") as f:
                table = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError([f"{args.config}: {e}"]) from None
        for k, v in table.items():
            raw[_ALIASES.get(k, k)] = (f"{args.config}: {k}", v)
    for k, v in env.items():
        if k.startswith(ENV_PREFIX):
            name = k[len(ENV_PREFIX):].lower()
            name = _ALIASES.get(name, name)
            if name in fields:
                raw[name] = (k, v)
            else:
                problems.append(f"{k}: unknown setting")
    for name, v in vars(args).items():
        if name != "config" and v is not None:
            raw[name] = (f"--{name.replace('_', '-')}", v)
    kwargs: dict[str, Any] = {}
    for name, (where, v) in raw.items():
        if name not in fields:
            problems.append(f"{where}: unknown setting (known: {', '.join(sorted(fields))})")
            continue
        try:
            kwargs[name] = _convert(name, fields[name].type, v)
        except (ValueError, TypeError, msgspec.ValidationError, msgspec.DecodeError) as e:
            problems.append(f"{where}: {e}")
    if problems:
        raise ConfigError(problems)
    kwargs.setdefault("node_id", socket.gethostname().split(".")[0])
    creds_dir = env.get("CREDENTIALS_DIRECTORY", "")
    if creds_dir:
        pw = os.path.join(creds_dir, "nats.password")
        if not kwargs.get("nats_password") and os.path.exists(pw):
            with open(pw) as f:
                kwargs["nats_password"] = f.read().strip()
        ca = os.path.join(creds_dir, "nats-ca.pem")
        if not kwargs.get("nats_tls_ca_file") and os.path.exists(ca):
            kwargs["nats_tls_ca_file"] = ca
    return AgentConfig(**kwargs)
