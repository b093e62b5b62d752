"""The records the shell's modules hand each other, at the bottom of orchd's shell.

Every other module of ``orchestrator.daemon`` may import this one, and it imports none of them:

    ``ShellItem``, ``Batch``   what the intake buffers and the decide loop takes (``ingest.Intake``)
    ``Result``                 what a finished command gives back (``executor``), fed to the intake
    ``Decided``                what deciding a batch produced (``pipeline``), read by persist, ack,
                               dispatch and the observers (``observe``, ``tracking``)
    ``NotLeader``, ``ShuttingDown``  why an admin intent got no decision (``loop``, ``admin``)
    ``encode_command``, ``decode_command``, ``outbox_key``, ``agent_command_kind``  a command's bytes,
                               outbox key and kind
    ``bad_kv_key``, ``bad_subject``  why a key or subject can never be written (a permanent refusal)

Pure data: no I/O, no NATS calls (``Msg`` appears only as a type).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections import Counter
from dataclasses import dataclass, field

import msgspec
from nats.aio.msg import Msg

import wire as ev
from orchestrator.core import State
from orchestrator.core.commands import Command
from orchestrator.core.inputs import CoreEvent


class NotLeader(Exception):
    """An admin request this orchd took in but cannot answer: it lost the leader lease meanwhile."""


class ShuttingDown(Exception):
    """An admin request that came after the final batch was taken: nothing more is decided here."""


@dataclass(frozen=True, slots=True)
class Result:
    """What a finished command gives back: events for the core and the outbox key to clear."""

    outbox_key: str
    events: tuple[CoreEvent, ...] = ()


@dataclass
class ShellItem:
    """An input from the shell: a core event (optionally answered after persist) or an executor result."""

    event: CoreEvent | Result
    reply: asyncio.Future[None] | None = None


@dataclass
class Batch:
    """One take of the intake: JetStream messages (with their consumer's kind), heartbeats, shell inputs."""

    js: list[tuple[str, Msg]]
    hb: list[Msg]
    shell: list[ShellItem]

    def __len__(self) -> int:
        return len(self.js) + len(self.hb) + len(self.shell)


@dataclass(slots=True)
class Decided:
    """What deciding a batch produced: the input of persist, ack and dispatch."""

    state: State
    dirty: set[str] = field(default_factory=set)  # record keys to write with this batch
    liveness: set[str] = field(default_factory=set)  # node keys changed by heartbeats only (flushed later)
    commands: dict[str, Command] = field(default_factory=dict)  # outbox key -> command
    done_keys: list[str] = field(default_factory=list)  # outbox entries whose results were decided
    audit: list[tuple[str | None, bytes]] = field(default_factory=list)  # (job id, encoded entry)
    counts: Counter[str] = field(default_factory=Counter)  # decided events by type name
    holds: Counter[str] = field(default_factory=Counter)  # restart holds decided, by reason (a metric)
    at_risk: Counter[str] = field(default_factory=Counter)  # deadline_at_risk audit entries, by reason (a metric)
    decided: int = 0
    notice_ts: dict[str, float] = field(default_factory=dict)  # checkpoint cmd_id -> its notice's publish ts
    to_ack: list[Msg] = field(default_factory=list)
    to_term: list[Msg] = field(default_factory=list)  # rejected, or poison for the core: never redelivered
    to_retry: list[tuple[Msg, float]] = field(default_factory=list)  # ahead of the state: back after the delay
    to_park: list[tuple[Msg, str]] = field(default_factory=list)  # (message, reason): dead-lettered, then termed
    replies: list[asyncio.Future[None]] = field(default_factory=list)  # admin requests answered after persist
    seen: list[CoreEvent] = field(default_factory=list)  # the events decided (not refused, not failed): metrics
    sent: list[str] = field(default_factory=list)  # outbox keys handed to the executor before the outbox


_command_enc = msgspec.json.Encoder()
_command_dec = msgspec.json.Decoder(Command)


def encode_command(cmd: Command) -> bytes:
    return _command_enc.encode(cmd)


def decode_command(data: bytes) -> Command:
    cmd: Command = _command_dec.decode(data)
    return cmd


_KV_KEY = re.compile(r"[-/_=a-zA-Z0-9]+(\.[-/_=a-zA-Z0-9]+)*")
MAX_KV_KEY = 1024


def bad_kv_key(key: str) -> str | None:
    """Why ``key`` cannot be a JetStream KV key (the NATS clients' key rule: ``[-/_=.a-zA-Z0-9]+``, no empty
    part between dots; at most ``MAX_KV_KEY`` characters), or None. A write the server can never accept
    is a permanent refusal: retrying it would stall the loop forever."""
    if len(key) > MAX_KV_KEY:
        return "key_too_long"
    if _KV_KEY.fullmatch(key) is None:
        return "bad_key"
    return None


def bad_subject(subject: str) -> str | None:
    """Why ``subject`` cannot be published to (empty token, white space, a wildcard), or None."""
    if not subject or len(subject) > MAX_KV_KEY + 64:
        return "bad_subject"
    for token in subject.split("."):
        if not token or token in ("*", ">") or any(c.isspace() or not c.isprintable() for c in token):
            return "bad_subject"
    return None


def agent_command_kind(c: ev.AgentCommand) -> str:
    """The wire tag of an agent command (``checkpoint``, ``start_generation``...): CommandFailed's kind."""
    return str(type(c).__struct_config__.tag)


def outbox_key(cmd: Command) -> str:
    """A KV key that is the same for the same command (ids and tokens are deterministic in the state)."""
    digest = hashlib.blake2b(encode_command(cmd), digest_size=12).hexdigest()
    return f"{type(cmd).__name__.lower()}.{digest}"
