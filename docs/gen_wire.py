"""Generate docs/wire.md from the code: ``python docs/gen_wire.py > docs/wire.md`` (from the repo root).

What comes from where:

- every record of ``wire.messages`` and ``wire.admin``: fields, types, defaults (as JSON), docstrings and
  the fields' trailing comments, grouped by the ``# ----`` section headers of ``wire/messages.py``;
  the enums with their values;
- the subjects table from the functions of ``wire.subjects`` (publisher and payload notes are kept
  here, in ``SUBJECTS``, and must name every subject function);
- streams, consumers and KV buckets by running ``orchestrator.bus.ensure_topology`` (ORCH_LOGS through
  ``agent.logship.ensure_logs_stream``) / ``ensure_consumers``, ``orchestrator.daemon.lease.lease_bucket``
  against a recording fake JetStream (nothing connects anywhere);
- the admin endpoints from ``wire.ADMIN_ENDPOINTS``.

The prose around them is written here. This script lives outside the packages so that it may import all
of them (``wire`` itself may not import ``orchestrator``). tests/lint/test_docs.py checks that
docs/wire.md is what this prints.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Coroutine, Iterable
from typing import Any

import msgspec
import nats.js.errors
from nats.js.api import ConsumerConfig, KeyValueConfig, StreamConfig

import agent.logship
import orchestrator.daemon.admin
import orchestrator.daemon.feeds
import orchestrator.daemon.lease
import orchestrator.daemon.store
import wire
import wire.admin
import wire.messages
import wire.subjects
from orchestrator import bus
from orchestrator.settings import DaemonSettings, NatsSettings

COMMAND = "python docs/gen_wire.py > docs/wire.md"

# Notes on each subject function of wire.subjects: (publisher, payload). The transport column is derived
# from the streams below (or, for a subject no stream stores, TRANSPORTS).
SUBJECTS: dict[str, tuple[str, str]] = {
    "subject_price": (f"price feeds (in orchd: `{orchestrator.daemon.feeds.__name__}`), external publishers",
                      "`PriceTick`"),
    "subject_notice": ("agents (metadata watchers), cloud event bridges", "`PreemptionNotice`"),
    "subject_heartbeat": ("agents, every `heartbeat_interval_s`", "`Heartbeat`"),
    "subject_node_event": ("agents", " ".join(f"`{t.__name__}`" for t in typing.get_args(wire.NodeEvent))),
    "subject_command": ("orchd -> one agent", " ".join(f"`{t.__name__}`" for t in typing.get_args(wire.AgentCommand))),
    "subject_logs": ("agents", "`LogLine`"),
    "admin_subject": ("orchctl, tools -> orchd", "the admin requests and replies (below; see [admin.md](admin.md))"),
}

_QUEUE_GROUP = re.search(r'queue_group="([^"]+)"', inspect.getsource(orchestrator.daemon.admin))
if _QUEUE_GROUP is None:
    raise SystemExit("docs/gen_wire.py: no queue_group=\"...\" in orchestrator/daemon/admin.py any more")
TRANSPORTS: dict[str, str] = {
    "subject_heartbeat": f"core NATS (latest value matters, no history); orchd subscribes `{bus.SUBJECT_HEARTBEATS}`",
    "subject_command": "core NATS request/reply; the reply is a `CommandAck`",
    "admin_subject": (f"`nats.micro` service `{wire.ADMIN_SERVICE_NAME}` {wire.ADMIN_SERVICE_VERSION} (request/reply, "
                      f"queue group `{_QUEUE_GROUP.group(1)}`)"),
}

STREAM_NOTES: dict[str, str] = {
    bus.STREAM_EVENTS: "agents' node events and preemption notices",
    bus.STREAM_MARKET: "price ticks",
    bus.STREAM_AUDIT: "the core's decision audit (`AuditEntry` records), append-only; read by `orchctl explain`",
    bus.STREAM_DEAD: (f"dead letters: JetStream messages orchd gave up on (the core raised on it, or delivered "
                      f"`daemon.dead_after_deliveries` times), subject `{bus.SUBJECT_DEAD_PREFIX}.<kind>`, the "
                      f"original subject, reason and delivery count in the headers `{bus.HDR_DEAD_SUBJECT}`, "
                      f"`{bus.HDR_DEAD_REASON}`, `{bus.HDR_DEAD_DELIVERIES}`; read by `orchctl dead list`, "
                      "republished by `orchctl dead replay SEQ`"),
    agent.logship.LOGS_STREAM: ("trainer log lines; at most "
                                f"{agent.logship.LOGS_PER_SUBJECT:,} lines per subject (one node of one job, "
                                "the oldest go first) and "
                                f"{agent.logship.LOGS_MAX_MSG_BYTES // 1024} KiB a message; created by orchd when "
                                "missing, an existing one is brought to this config at orchd's start; agents only "
                                "publish to it, an agent on an open server also creates it; read by `orchctl logs`"),
}

KV_NOTES: dict[str, str] = {
    bus.KV_STATE: "the core's records: `job.<id>`, `node.<id>`, `pool.<name>`, `meta`",
    bus.KV_OUTBOX: "commands decided and persisted, not yet completed",
    orchestrator.daemon.lease.LEASE_BUCKET: (f"the HA leader lease, key `{orchestrator.daemon.lease.LEASE_KEY}`; its "
                                             "revision is the fencing token; ttl = `daemon.lease_ttl_s`"),
}

# command tag -> meaning (must name every AgentCommand)
COMMANDS: dict[str, str] = {
    "checkpoint": ("checkpoint at a step all ranks agree on, commit, end this generation (emergency / resize / pause "
                   "/ migrate / drain); `deadline_ts` is the notice deadline"),
    "start_generation": ("start generation `generation` with this node as `node_rank` of `nnodes`; resume from "
                         "`resume_from` (None: fresh); periodic checkpoints every `checkpoint_interval_s`"),
    "stop": "stop the job's ranks (`checkpoint_first`: save first)",
    "abandon_generation": "kill the generation's ranks without saving (a member was lost)",
    "drain": "finish and leave: the node will be terminated",
}


# --- the topology, recorded -------------------------------------------------------------------------


class _RecordingJetStream:
    """Answers like an empty server: nothing exists, every create is recorded."""

    def __init__(self) -> None:
        self.streams: list[StreamConfig] = []
        self.buckets: list[KeyValueConfig] = []
        self.consumers: list[tuple[str, ConsumerConfig]] = []

    def jetstream(self, **_kw: Any) -> _RecordingJetStream:  # the nc
        return self

    async def stream_info(self, name: str, *_a: Any, **_kw: Any) -> Any:
        raise nats.js.errors.NotFoundError

    async def add_stream(self, config: StreamConfig | None = None, **params: Any) -> None:
        self.streams.append(config if config is not None else StreamConfig(**params))

    async def key_value(self, bucket: str) -> Any:
        raise nats.js.errors.BucketNotFoundError

    async def create_key_value(self, config: KeyValueConfig | None = None, **params: Any) -> None:
        self.buckets.append(dataclasses.replace(config, **params) if config is not None else KeyValueConfig(**params))

    async def add_consumer(self, stream: str, config: ConsumerConfig | None = None, **_kw: Any) -> None:
        assert config is not None
        self.consumers.append((stream, config))


def _drive(coro: Coroutine[Any, Any, Any]) -> None:
    """Run a coroutine that only awaits the recorder (which never suspends): no event loop needed."""
    try:
        coro.send(None)
    except StopIteration:
        return
    coro.close()
    raise RuntimeError("the topology code awaited something real")


def recorded_topology() -> _RecordingJetStream:
    js = _RecordingJetStream()
    replicas = NatsSettings().stream_replicas
    _drive(bus.ensure_topology(js, replicas))  # type: ignore[arg-type]
    _drive(bus.ensure_consumers(js, ack_wait=bus.ack_wait_s(DaemonSettings().lease_ttl_s)))  # type: ignore[arg-type]
    _drive(orchestrator.daemon.lease.lease_bucket(js, ttl_s=DaemonSettings().lease_ttl_s, replicas=replicas))
    return js


# --- formatting -------------------------------------------------------------------------------------


def _para(text: str) -> list[str]:
    return textwrap.wrap(text, 110, break_long_words=False, break_on_hyphens=False)


def _bullet(text: str) -> list[str]:
    return textwrap.wrap(text, 110, initial_indent="- ", subsequent_indent="  ", break_long_words=False,
                         break_on_hyphens=False)


def _heading_text(text: str) -> str:
    """Subjects in a heading as code (``<node>`` would read as an HTML tag)."""
    return re.sub(r"[\w.]*<\w+>[\w.<>]*", lambda m: f"`{m.group(0)}`", text)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: Iterable[str], rows: Iterable[Iterable[str]]) -> list[str]:
    header = list(header)
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


def _duration(s: float | None) -> str:
    if not s:
        return "unlimited"
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s % n == 0:
            return f"{int(s // n)} {unit}"
    return f"{s:g} s"


def _size(n: int | None) -> str:
    if n is None or n < 0:
        return "unlimited"
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def type_name(tp: Any) -> str:
    """A field's type as it reads in the source: ``NodeId``, ``float | None``, ``tuple[GpuStats, ...]``."""
    if tp is type(None):
        return "None"
    if tp is Any:
        return "Any"
    if hasattr(tp, "__supertype__"):  # NewType
        return str(tp.__name__)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in sorted(args, key=lambda a: a is type(None)))
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    return str(getattr(tp, "__name__", repr(tp)))


def _default(f: msgspec.structs.FieldInfo) -> str:
    if f.default is not msgspec.NODEFAULT:
        value = f.default
    elif f.default_factory is not msgspec.NODEFAULT:
        value = f.default_factory()
    else:
        return ""
    if value is msgspec.UNSET:  # an optional field left out of the encoding when unset
        return "unset"
    return msgspec.json.encode(value).decode()


def _line_comments(obj: type) -> dict[str, str]:
    """name -> the trailing ``#`` comment of its line, for the annotated fields / enum members of a class."""
    lines, start = inspect.getsourcelines(obj)
    source = textwrap.dedent("".join(lines))
    comments = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and not tok.string.startswith(("# noqa", "# type:")):
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    cls_node = ast.parse(source).body[0]
    assert isinstance(cls_node, ast.ClassDef)
    out = {}
    for node in cls_node.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign)
                                                                       else None)
        if isinstance(target, ast.Name) and node.lineno in comments:
            out[target.id] = comments[node.lineno]
    return out


def _field_comment(cls: type, name: str) -> str:
    for base in cls.__mro__:  # the class that declares the field
        if name in base.__dict__.get("__annotations__", {}):
            return _line_comments(base).get(name, "")
    return ""


def _doc(obj: Any) -> str:
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else obj.__doc__
    return inspect.cleandoc(doc) if doc else ""


def record(cls: type[msgspec.Struct]) -> list[str]:
    config = cls.__struct_config__
    title = f"#### {cls.__name__}" + (f' ({config.tag_field} = "{config.tag}")' if config.tag else "")
    out = [title, ""]
    if doc := _doc(cls):
        out += [doc, ""]
    hints = typing.get_type_hints(cls)
    rows = [(f"`{f.name}`", f"`{type_name(hints[f.name])}`", f"`{d}`" if (d := _default(f)) else "",
             _field_comment(cls, f.name)) for f in msgspec.structs.fields(cls)]
    return out + _table(("field", "type", "default", "notes"), rows) + [""]


def _public_structs(module: types.ModuleType) -> list[type[msgspec.Struct]]:
    found = [obj for name, obj in vars(module).items()
             if isinstance(obj, type) and issubclass(obj, msgspec.Struct) and obj.__module__ == module.__name__
             and not name.startswith("_")]
    return sorted(found, key=lambda c: inspect.getsourcelines(c)[1])


def _sections(module: types.ModuleType) -> list[tuple[int, str]]:
    """(line, title) of the ``# ----`` section headers of a module's source."""
    lines = inspect.getsource(module).splitlines()
    return [(i + 2, lines[i + 1].lstrip("# ").strip()) for i in range(len(lines) - 1)
            if lines[i].startswith("# ---") and lines[i + 1].startswith("# ")]


def records(module: types.ModuleType, heading: str | None = None) -> list[str]:
    sections = _sections(module)
    out: list[str] = []
    current = None
    for cls in _public_structs(module):
        line = inspect.getsourcelines(cls)[1]
        title = heading or next((t for n, t in reversed(sections) if n < line), "Other")
        if title != current:
            out += [f"### {_heading_text(title)}", ""]
            current = title
        out += record(cls)
    return out


def enums() -> list[str]:
    out = ["### Enumerations", "", "Sent as their string values.", ""]
    for name, obj in vars(wire.messages).items():
        if isinstance(obj, type) and issubclass(obj, enum.Enum) and obj.__module__ == wire.messages.__name__:
            notes = _line_comments(obj)
            out += [f"#### {name}", ""]
            out += _table(("value", "notes"), ((f'`"{m.value}"`', notes.get(m.name, "")) for m in obj))
            out.append("")
    return out


# --- subjects and topology --------------------------------------------------------------------------


def _matches(pattern: str, filt: str) -> bool:
    """Whether every subject of ``pattern`` (``<x>`` tokens: any one token) is in the NATS filter ``filt``."""
    p, f = pattern.split("."), filt.split(".")
    for i, ft in enumerate(f):
        if ft == ">":
            return len(p) > i
        if i >= len(p) or (ft != "*" and ft != p[i]):
            return False
    return len(p) == len(f)


def subject_pattern(fn: Any) -> str:
    params = list(inspect.signature(fn).parameters)
    subject = str(fn(*(f"PARAM{i}X" for i in range(len(params)))))
    for i, name in enumerate(params):
        subject = subject.replace(f"PARAM{i}X", f"<{name}>")
    return subject


def _transport(subject: str, js: _RecordingJetStream, fallback: str) -> str:
    for s in js.streams:
        if any(_matches(subject, f) for f in s.subjects or ()):
            consumers = [c.durable_name for stream, c in js.consumers if stream == s.name]
            via = f", durable pull consumer {', '.join(f'`{c}`' for c in consumers)}" if consumers else ""
            return f"JetStream stream `{s.name}`{via}"
    if not fallback:
        raise SystemExit(f"{subject}: no stream stores it and TRANSPORTS does not say how it travels")
    return fallback


def subjects(js: _RecordingJetStream) -> list[str]:
    fns = [obj for name, obj in vars(wire.subjects).items()
           if inspect.isfunction(obj) and not name.startswith("_") and obj.__module__ == wire.subjects.__name__]
    missing = {f.__name__ for f in fns} ^ set(SUBJECTS)
    if missing:
        raise SystemExit(f"docs/gen_wire.py SUBJECTS is out of date with wire/subjects.py: {sorted(missing)}")
    rows = []
    for fn in sorted(fns, key=lambda f: inspect.getsourcelines(f)[1]):
        publisher, payload = SUBJECTS[fn.__name__]
        subject = subject_pattern(fn)
        rows.append((f"`{subject}`", publisher, _transport(subject, js, TRANSPORTS.get(fn.__name__, "")), payload))
    audit = subject_pattern(orchestrator.daemon.store.audit_subject)
    rows.append((f"`{audit}` (`{orchestrator.daemon.store.audit_subject(None)}` for entries without a job)", "orchd",
                 _transport(audit, js, ""), "the core's `AuditEntry` records"))
    dead = f"{bus.SUBJECT_DEAD_PREFIX}.<kind>"
    rows.append((f"`{dead}` (kind: price, notice, node_event, other)", "orchd (pipeline `acknowledge`)",
                 _transport(f"{bus.SUBJECT_DEAD_PREFIX}.x", js, ""), "the parked message's bytes, unchanged"))
    return _table(("subject", "publisher", "transport", "payload"), rows)


def topology(js: _RecordingJetStream) -> list[str]:
    out = ["### Streams", ""]
    streams = []
    for s in js.streams:
        names = ", ".join(f"`{c.durable_name}`" for stream, c in js.consumers if stream == s.name)
        limits = f"{_duration(s.max_age)}, {_size(s.max_bytes)}"
        dedup = _duration(s.duplicate_window) if s.duplicate_window else "default (2 min)"
        storage = s.storage.value if s.storage else "default (file)"
        streams.append((f"`{s.name}`", ", ".join(f"`{x}`" for x in s.subjects or ()), limits, storage, dedup,
                        names or "-", STREAM_NOTES[s.name or ""]))
    out += _table(("stream", "subjects", "max age, max bytes", "storage", "duplicate window", "consumers", "what"),
                  streams)
    out += ["", *_para("orchd's streams and the KV buckets have `nats.stream_replicas` replicas (3 on a cluster); "
                       "every stream discards its oldest messages at its limits."), ""]
    out += ["### Consumers", ""]
    consumers = [(f"`{c.durable_name}`", f"`{stream}`", ", ".join(f"`{x}`" for x in c.filter_subjects or ()),
                  f"{c.ack_policy.value if c.ack_policy else ''} ack, ack wait {_duration(c.ack_wait)}, max deliver "
                  f"{c.max_deliver}, max ack pending {c.max_ack_pending:,}") for stream, c in js.consumers]
    out += _table(("durable", "stream", "filter", "delivery"), consumers)
    out += ["", "### KV buckets", "", "A bucket `B` is stored in the stream `KV_B`.", ""]
    buckets = [(f"`{b.bucket}`", str(b.history), _duration(b.ttl) if b.ttl else "none", KV_NOTES[b.bucket])
               for b in js.buckets]
    out += _table(("bucket", "history", "ttl", "what"), buckets)
    return out + [""]


def admin_endpoints() -> list[str]:
    rows = [(f"`{wire.admin_subject(resource, verb)}`", f"`{req.__name__}`", f"`{reply.__name__}`")
            for (resource, verb), (req, reply) in wire.ADMIN_ENDPOINTS.items()]
    return _table(("subject", "request", "reply"), rows)


# --- the page ---------------------------------------------------------------------------------------


def render() -> str:
    js = recorded_topology()
    ds = DaemonSettings()
    events_consumer = next(c for stream, c in js.consumers if stream == bus.STREAM_EVENTS)
    command_tags = {t.__struct_config__.tag for t in typing.get_args(wire.AgentCommand)}
    if command_tags != set(COMMANDS):
        raise SystemExit(f"docs/gen_wire.py COMMANDS is out of date with wire.AgentCommand: {sorted(command_tags)}")
    wire_types = ", ".join(f"`{t.__name__}`" for t in wire.WIRE_TYPES)
    out = [
        f"# Wire protocol (schema version {wire.SCHEMA_VERSION})",
        "",
        f"<!-- Generated by `{COMMAND}` from wire/, orchestrator/bus.py and the code that creates the lease "
        "bucket and the log stream. Do not edit by hand: edit the code or docs/gen_wire.py and regenerate. -->",
        "",
        *_para("Every message between orchd, agents, price publishers and orchctl is a JSON object defined as a "
               "frozen `msgspec.Struct` in the `wire` package (`wire/messages.py`; admin requests and replies in "
               "`wire/admin.py`): the single source of truth, this page is generated from it and explained. Codecs: "
               "`wire.encode(msg)` / `wire.decode(data, kind)` (`wire/codec.py`); by default `decode` accepts any "
               f"of {wire_types}. It raises `WireError(reason)` with one of `too_large` "
               f"(> {_size(wire.MAX_MESSAGE_BYTES)}), `bad_json`, `bad_schema`, `unknown_type`, `bad_version`, and "
               "orchd counts rejections as `orchd_messages_rejected_total{kind, reason}`."),
        "",
        "## Conventions",
        "",
        *_bullet("`type`: the tag that selects the record in a union (e.g. `\"preemption_notice\"`)."),
        *_bullet("`v`: schema version. orchd accepts the versions in `SUPPORTED_VERSIONS` "
                 f"(`{{{', '.join(map(str, sorted(wire.SUPPORTED_VERSIONS)))}}}`); adding an optional field keeps "
                 "the version (unknown fields are ignored by decoders); removing or changing a field's meaning bumps "
                 "it, and orchd accepts both versions for one release."),
        *_bullet("`id`: a message id, unique per logical message. JetStream publishers MUST also send it as the "
                 "`Nats-Msg-Id` header: the streams drop a duplicate inside their "
                 f"{_duration(bus.DUPLICATE_WINDOW_S)} duplicate window, so a publisher retries a timed-out publish "
                 "with the same id (a timed-out publish may have been stored)."),
        *_bullet("Times are Unix seconds (float, UTC); money is USD; units are in the field names."),
        *_bullet("Ids used in subjects (`node`, `cloud`, `region`, `job`) contain no `.`, space, `*` or `>`. Values "
                 "with dots (instance types such as `p4d.24xlarge`) are only in payloads."),
        "",
        "## Subjects",
        "",
        *subjects(js),
        "",
        "## Streams, consumers and KV buckets",
        "",
        *_para("Created (idempotently) by orchd at start-up (`orchestrator/bus.py`; the lease bucket by "
               "`orchestrator/daemon/lease.py`; `ORCH_LOGS` through `agent/logship.py`). See "
               "[architecture.md](architecture.md)."),
        "",
        *topology(js),
        "## Delivery guarantees",
        "",
        *_bullet("JetStream events are acked by orchd only after the decision they caused is persisted (state "
                 "records and outbox). Unacked messages are redelivered after "
                 f"{_duration(events_consumer.ack_wait)} (`max_deliver` {events_consumer.max_deliver}); redelivered "
                 "events are decided again and the core ignores what it has already seen (ids, generations, "
                 "phases)."),
        *_bullet("A malformed JetStream message is counted and **terminated** (`+TERM`), so it is never "
                 "redelivered. A message the core raises on (a core bug) is logged, counted with reason "
                 "`core_error`, and terminated too. A malformed heartbeat is counted and dropped."),
        *_bullet("Heartbeats are best effort: a lost one only delays liveness by one interval. The core persists "
                 "only the non-liveness changes a heartbeat causes with its batch; liveness-only changes (last seen, "
                 f"step, loss) are written every `daemon.liveness_flush_s` (default {ds.liveness_flush_s:g} s)."),
        "",
        "## Commands to agents",
        "",
        *_para("orchd sends each command as a request on `orch.cmd.<node>` and waits "
               f"`daemon.command_ack_timeout_s` (default {ds.command_ack_timeout_s:g} s) for a `CommandAck` whose "
               "`cmd_id` matches. Without one it retries with the **same** `cmd_id` (the agent de-duplicates by "
               f"`cmd_id`) up to `daemon.command_retries` (default {ds.command_retries}) times, then reports "
               "`CommandFailed` to the core. While orchd's own NATS connection is down, attempts are not spent (an "
               "outage is not an agent failure)."),
        "",
        *_para("Every command carries `fencing_token`: the revision of the leader lease of the daemon that decided "
               "it. Agents remember the highest token they have seen and refuse lower ones "
               "(`CommandAck(ok=false, error=\"stale_fencing_token\")`), so a deposed or restarted-stale daemon "
               "cannot drive a node. Command ids are deterministic in the core's state: a command re-executed from "
               "the outbox after a crash has the same `cmd_id` (and a Launch the same idempotency token)."),
        "",
        *_table(("command (`type`)", "meaning"), ((f"`{tag}`", text) for tag, text in COMMANDS.items())),
        "",
        "## Records",
        "",
        "Defaults are shown as JSON; a field without one is required.",
        "",
        *records(wire.messages),
        *enums(),
        "## Admin API",
        "",
        _doc(wire.admin),
        "",
        "Endpoints (`wire.ADMIN_ENDPOINTS`); [admin.md](admin.md) says what each one does:",
        "",
        *admin_endpoints(),
        "",
        *records(wire.admin, heading="Admin requests and replies"),
    ]
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
