"""The NATS bus of orchd: connection, JetStream streams, durable consumers, KV buckets.

Role: everything that knows how orchd's subjects map onto NATS objects. The daemon, the benchmark and
the tests call ``connect`` and ``ensure_topology`` and then use the handles in ``Topology``.

Objects (all created idempotently; a changed config is applied with ``update_stream``):

    stream ORCH_EVENTS    orch.notice.>, orch.node.*.event     durable consumer "orchd-events"
    stream ORCH_MARKET    orch.price.>                          durable consumer "orchd-market"
    stream ORCH_AUDIT     orch.audit.>    decision audit (append-only, limited by age/bytes)
    stream ORCH_DEAD      orch.dead.>     dead letters: JetStream messages orchd gave up on (``park``),
                                          with their original subject, reason and delivery count
    KV ORCH_STATE         the core's records: job.<id>, node.<id>, pool.<name>, meta
    KV ORCH_OUTBOX        commands decided and persisted but not yet completed
    KV orch_lease         the leader lease (orchestrator.daemon.lease); its revision is the fencing token

Both ingestion streams de-duplicate on ``Nats-Msg-Id`` inside ``DUPLICATE_WINDOW_S``.

Concurrency contract: coroutines on the asyncio event loop of the daemon (nats-py is asyncio-only).
The connection reconnects forever (``max_reconnect_attempts=-1``); its state changes are reported
through ``on_state(connected: bool)`` so the daemon can feed ``BusState`` to the core.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import nats
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NotFoundError
from nats.js.kv import KeyValue

from agent.logship import ensure_logs_stream
from orchestrator.settings import NatsSettings

log = structlog.get_logger("orchd.bus")

STREAM_EVENTS = "ORCH_EVENTS"
STREAM_MARKET = "ORCH_MARKET"
STREAM_AUDIT = "ORCH_AUDIT"
CONSUMER_EVENTS = "orchd-events"
CONSUMER_MARKET = "orchd-market"
KV_STATE = "ORCH_STATE"
KV_OUTBOX = "ORCH_OUTBOX"
SUBJECTS_EVENTS = ("orch.notice.>", "orch.node.*.event")
SUBJECTS_MARKET = ("orch.price.>",)
SUBJECT_HEARTBEATS = "orch.node.*.hb"
SUBJECT_AUDIT_PREFIX = "orch.audit"
STREAM_DEAD = "ORCH_DEAD"
SUBJECT_DEAD_PREFIX = "orch.dead"
DEAD_MAX_BYTES = 256 << 20
DEAD_MAX_AGE_S = 14 * 86400.0
DEAD_AFTER_DELIVERIES = 5
"""A JetStream message delivered this many times without being acked is parked in ``ORCH_DEAD`` and
terminated instead of being handled again (``orchd``: ``daemon.dead_after_deliveries``); must stay
below ``MAX_DELIVER``, after which the server stops redelivering on its own."""
HDR_DEAD_SUBJECT = "Orch-Dead-Subject"
HDR_DEAD_REASON = "Orch-Dead-Reason"
HDR_DEAD_DELIVERIES = "Orch-Dead-Deliveries"
HDR_DEAD_STREAM_SEQ = "Orch-Dead-Stream-Seq"
DUPLICATE_WINDOW_S = 120.0
MAX_DELIVER = 20
ACK_WAIT_S = 30.0
"""The consumers' ack wait where no lease TTL is given (tools, tests); orchd uses ``ack_wait_s``."""


def ack_wait_s(lease_ttl_s: float) -> float:
    """orchd's consumers' ack wait: twice the leader lease's TTL, at least 10 s. A message the server
    delivered to a leader that was then cut off stays unacked until this passes; only then does the new
    leader get it. So a notice delivered just before a partition reaches the new leader within this
    time (12 s at the default 6 s TTL, inside a 30 s GCP/Azure notice). Redelivery is harmless (the
    core ignores what it has seen); the floor keeps a busy orchd from redelivering its own backlog."""
    return max(10.0, 2.0 * lease_ttl_s)
MAX_ACK_PENDING = 100_000


def tls_context(s: NatsSettings) -> ssl.SSLContext | None:
    if not (s.tls_ca_file or s.tls_cert_file):
        return None
    ctx = ssl.create_default_context(cafile=s.tls_ca_file or None)
    if s.tls_cert_file:
        ctx.load_cert_chain(s.tls_cert_file, s.tls_key_file or None)
    return ctx


def connect_options(s: NatsSettings, urls: tuple[str, ...], *, name: str) -> dict:
    """nats.connect keyword arguments for a long-running client (reconnects forever)."""
    opts: dict = {
        "servers": list(urls),
        "name": name,
        "connect_timeout": s.connect_timeout_s,
        "reconnect_time_wait": s.reconnect_wait_s,
        "max_reconnect_attempts": -1,
        "allow_reconnect": True,
        "ping_interval": 5,
        "max_outstanding_pings": 3,
        "pending_size": 64 * 1024 * 1024,
    }
    opts.update(auth_options(s))
    return opts


def auth_options(s: NatsSettings) -> dict:
    opts: dict = {}
    if s.user:
        opts["user"] = s.user
        opts["password"] = s.password
    if s.token:
        opts["token"] = s.token
    if s.creds_file:
        opts["user_credentials"] = s.creds_file
    if s.nkey_seed_file:
        opts["nkeys_seed"] = s.nkey_seed_file
    ctx = tls_context(s)
    if ctx is not None:
        opts["tls"] = ctx
        if s.tls_hostname:
            opts["tls_hostname"] = s.tls_hostname
    return opts


async def connect(
    s: NatsSettings,
    urls: tuple[str, ...],
    *,
    name: str = "orchd",
    on_state: Callable[[bool], Awaitable[None] | None] | None = None,
) -> Client:
    """Connect (first attempt must succeed within connect_timeout_s x a few tries), reconnect forever."""

    async def error_cb(e: Exception) -> None:
        log.warning("nats_error", error=repr(e))

    async def disconnected_cb() -> None:
        log.warning("nats_disconnected")
        if on_state is not None:
            r = on_state(False)
            if r is not None:
                await r

    async def reconnected_cb() -> None:
        log.info("nats_reconnected", server=str(nc.connected_url.netloc if nc.connected_url else ""))
        if on_state is not None:
            r = on_state(True)
            if r is not None:
                await r

    nc = await nats.connect(
        **connect_options(s, urls, name=name),
        error_cb=error_cb,
        disconnected_cb=disconnected_cb,
        reconnected_cb=reconnected_cb,
    )
    return nc


@dataclass
class Topology:
    nc: Client
    js: JetStreamContext
    state_kv: KeyValue
    outbox_kv: KeyValue


async def _ensure_stream(js: JetStreamContext, name: str, cfg: StreamConfig) -> None:
    try:
        await js.stream_info(name)
    except NotFoundError:
        await js.add_stream(cfg)
        return
    try:
        await js.update_stream(cfg)
    except BadRequestError as e:  # e.g. a change the server refuses (storage type): keep the old one
        log.warning("stream_update_refused", stream=name, error=str(e))


def _stream_config(name: str, subjects: list[str], max_age_s: float, replicas: int) -> StreamConfig:
    """A file stream limited by age and 1 GiB, de-duplicating on ``Nats-Msg-Id`` (``DUPLICATE_WINDOW_S``)."""
    return StreamConfig(name=name, subjects=subjects, retention=RetentionPolicy.LIMITS, storage=StorageType.FILE,
                        num_replicas=replicas, duplicate_window=DUPLICATE_WINDOW_S, discard=DiscardPolicy.OLD,
                        max_age=max_age_s, max_bytes=1 << 30)


async def _ensure_kv(js: JetStreamContext, bucket: str, replicas: int, history: int = 1) -> KeyValue:
    try:
        return await js.key_value(bucket)
    except Exception:  # nats.js.errors.BucketNotFoundError and friends
        return await js.create_key_value(bucket=bucket, history=history, replicas=replicas)


async def ensure_topology(nc: Client, replicas: int = 1) -> Topology:
    """Create (or update) streams, consumers and KV buckets; return the handles."""
    js = nc.jetstream(timeout=5.0)
    for name, subjects, max_age_s in (
        (STREAM_EVENTS, list(SUBJECTS_EVENTS), 7 * 86400.0),
        (STREAM_MARKET, list(SUBJECTS_MARKET), 86400.0),
        (STREAM_AUDIT, [f"{SUBJECT_AUDIT_PREFIX}.>"], 30 * 86400.0),
    ):
        await _ensure_stream(js, name, _stream_config(name, subjects, max_age_s, replicas))
    dead = _stream_config(STREAM_DEAD, [f"{SUBJECT_DEAD_PREFIX}.>"], DEAD_MAX_AGE_S, replicas)
    dead.max_bytes = DEAD_MAX_BYTES  # bounded: a flood of poison cannot fill the disk, the oldest go
    await _ensure_stream(js, STREAM_DEAD, dead)
    # agents publish their logs with no $JS.API rights; an older stream gets today's per-subject limits
    await ensure_logs_stream(nc, replicas=replicas, update=True)
    state_kv = await _ensure_kv(js, KV_STATE, replicas)
    outbox_kv = await _ensure_kv(js, KV_OUTBOX, replicas)
    return Topology(nc=nc, js=js, state_kv=state_kv, outbox_kv=outbox_kv)


CONSUMERS: tuple[tuple[str, str, str], ...] = (
    ("events", STREAM_EVENTS, CONSUMER_EVENTS),
    ("market", STREAM_MARKET, CONSUMER_MARKET),
)
"""(kind, stream, durable consumer) of the daemon's ingestion."""


def consumer_config(durable: str, subjects: tuple[str, ...], ack_wait: float = ACK_WAIT_S) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=durable,
        name=durable,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=ack_wait,
        max_deliver=MAX_DELIVER,
        max_ack_pending=MAX_ACK_PENDING,
        max_waiting=64,
        filter_subjects=list(subjects),
    )


async def ensure_consumers(js: JetStreamContext, timeout_s: float | None = None,
                           ack_wait: float = ACK_WAIT_S) -> None:
    """Create the durable pull consumers (an existing one is updated to this config).

    ``timeout_s``: per request, shorter than the context's 5 s for a caller that retries (idempotent):
    during a stream leader election the first request goes unanswered, and a short timeout lets the
    retry find the new leader seconds sooner."""
    for _kind, stream, durable in CONSUMERS:
        subjects = SUBJECTS_EVENTS if stream == STREAM_EVENTS else SUBJECTS_MARKET
        await js.add_consumer(stream, consumer_config(durable, subjects, ack_wait), timeout=timeout_s)


def message_kind(subject: str) -> str:
    """A short label of a subject for metrics and logs: notice | node_event | price | heartbeat | other."""
    if subject.startswith("orch.notice."):
        return "notice"
    if subject.startswith("orch.price."):
        return "price"
    if subject.endswith(".hb"):
        return "heartbeat"
    if subject.endswith(".event"):
        return "node_event"
    return "other"


# --- dead letters ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeadLetter:
    """One parked message of ``ORCH_DEAD``: its sequence there, when it was parked, and what it was."""

    seq: int
    ts: float
    subject: str  # the original subject (``replay`` publishes ``data`` there again)
    reason: str
    deliveries: int
    stream_seq: int  # its sequence in the ingestion stream it came from (0: unknown)
    data: bytes


def dead_subject(subject: str) -> str:
    """``orch.dead.<kind>`` of a message that arrived on ``subject`` (``message_kind``)."""
    return f"{SUBJECT_DEAD_PREFIX}.{message_kind(subject)}"


async def park(js: JetStreamContext, subject: str, data: bytes, *, reason: str, deliveries: int,
               stream_seq: int = 0) -> int:
    """Store a message orchd gives up on in ``ORCH_DEAD`` (headers: original subject, reason, delivery
    count); return its sequence there. Raises what ``js.publish`` raises (the caller then does not
    ``term`` the message, so it comes back and is parked again)."""
    headers = {HDR_DEAD_SUBJECT: subject, HDR_DEAD_REASON: reason, HDR_DEAD_DELIVERIES: str(deliveries),
               HDR_DEAD_STREAM_SEQ: str(stream_seq)}
    ack = await js.publish(dead_subject(subject), data, stream=STREAM_DEAD, headers=headers)
    return int(ack.seq)


def num_delivered(msg: Msg) -> int:
    """How often JetStream delivered ``msg`` (1 the first time); 0 for a message without metadata."""
    try:
        return int(msg.metadata.num_delivered or 0)
    except Exception:  # not a JetStream message (no metadata in its reply subject)
        return 0


async def park_msg(msg: Msg, reason: str) -> int:
    """``park`` a message of a pull consumer, on the connection it came in on (``msg._client``)."""
    try:
        stream_seq = int(msg.metadata.sequence.stream or 0)
    except Exception:
        stream_seq = 0
    return await park(msg._client.jetstream(), msg.subject, msg.data, reason=reason,
                      deliveries=num_delivered(msg), stream_seq=stream_seq)


def _int(text: str | None) -> int:
    return int(text) if text and text.isdigit() else 0


async def dead_get(js: JetStreamContext, seq: int) -> DeadLetter:
    """The parked message ``seq``. Raises ``NotFoundError`` (no such sequence, or aged out)."""
    raw = await js.get_msg(STREAM_DEAD, seq)
    hdrs = raw.headers or {}
    return DeadLetter(seq=int(raw.seq or seq), ts=raw.time.timestamp() if raw.time else 0.0,
                      subject=str(hdrs.get(HDR_DEAD_SUBJECT, "")), reason=str(hdrs.get(HDR_DEAD_REASON, "")),
                      deliveries=_int(hdrs.get(HDR_DEAD_DELIVERIES)),
                      stream_seq=_int(hdrs.get(HDR_DEAD_STREAM_SEQ)), data=raw.data or b"")


async def dead_list(js: JetStreamContext, limit: int = 100) -> list[DeadLetter]:
    """The newest ``limit`` parked messages, oldest first."""
    info = await js.stream_info(STREAM_DEAD)
    first, last = info.state.first_seq, info.state.last_seq
    out: list[DeadLetter] = []
    seq = last
    while seq >= max(first, 1) and len(out) < limit:
        with contextlib.suppress(NotFoundError):  # deleted in between (limits)
            out.append(await dead_get(js, seq))
        seq -= 1
    out.reverse()
    return out


async def replay(js: JetStreamContext, seq: int) -> DeadLetter:
    """Publish the parked message ``seq`` to its original subject again (no ``Nats-Msg-Id``: the
    ingestion stream must not drop it as a duplicate of the original); it stays parked. Raises
    ``NotFoundError``, ``ValueError`` (no original subject) or what ``js.publish`` raises."""
    dead = await dead_get(js, seq)
    if not dead.subject or dead.subject.startswith(SUBJECT_DEAD_PREFIX + "."):
        raise ValueError(f"dead letter {seq} has no original subject")
    await js.publish(dead.subject, dead.data)
    return dead
