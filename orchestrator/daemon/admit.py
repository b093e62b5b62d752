"""Stages decode and screen of orchd's decide pipeline (``pipeline`` composes them): bytes -> wire message
-> an event for the core, or why it is rejected.

    decode     ``decode_js(subject, data)`` / ``decode_heartbeat(subject, data)``: bytes -> wire message
    screen     ``screen_js(subject, event)`` / ``screen_heartbeat(subject, hb)``: what the schema cannot
               say (the subject names the publisher, no impossible values: ``screen``, ``screen_hb``)
    admit      ``admit_js`` / ``admit_heartbeat`` = decode + screen of one message -> event | ``Rejected``;
               ``admit_batch`` runs one of them over a batch -> ``Admitted`` (events, their messages,
               rejections); ``admit_heartbeats`` is ``admit_batch(msgs, admit_heartbeat)``, cheaper per
               message; ``count_rejections`` counts (and for JetStream logs) the rejections

Pure apart from the metrics ``count_rejections`` / ``observe_lag`` update and the log: no state, which is
why a whole batch can be admitted before the first of its events is decided.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Generic, TypeAlias, TypeVar

import msgspec
import structlog
from nats.aio.msg import Msg

import wire as ev
from orchestrator import bus
from orchestrator.core.model import CoreConfig
from orchestrator.core.pricing import MAX_DURATION_S
from orchestrator.daemon.metrics import Metrics
from wire.names import is_key, is_token

log = structlog.get_logger("orchd")

JsEvent: TypeAlias = (ev.PriceTick | ev.PreemptionNotice | ev.NodeRegistered | ev.GenerationStarted
                      | ev.CheckpointCommitted | ev.RanksExited | ev.NodeLeaving)
"""What the JetStream consumers may deliver (notices, node events, prices)."""

E = TypeVar("E")


@dataclass(frozen=True, slots=True)
class Rejected:
    """A message that never reaches the core: ``kind`` and ``reason`` label
    ``orchd_messages_rejected_total``; ``detail`` is for the log."""

    kind: str
    reason: str
    detail: str


def decode_js(subject: str, data: bytes) -> JsEvent:
    """Stage decode of a JetStream message: the type its subject's kind (``bus.message_kind``) allows -
    a price tick, a preemption notice or a node event; any other kind: any ``JsEvent``. Raises
    ``ev.WireError``."""
    match bus.message_kind(subject):
        case "price":
            return ev.decode(data, ev.PriceTick)
        case "notice":
            return ev.decode(data, ev.PreemptionNotice)
        case "node_event":
            node_event: ev.NodeEvent = ev.decode(data, ev.NodeEvent)
            return node_event
    event: JsEvent = ev.decode(data, JsEvent)
    return event


def decode_heartbeat(subject: str, data: bytes) -> ev.Heartbeat:
    """Stage decode of a heartbeat (core NATS, ``orch.node.<node>.hb``). Raises ``ev.WireError``."""
    hb: ev.Heartbeat = ev.decode(data, ev.Heartbeat)
    return hb


# --- screening: what a schema cannot say -----------------------------------------------------------

_NODE_EVENT_INTS = ("generation", "first_step", "step", "last_step")
# Bounds before arithmetic (no honest publisher exceeds them; the core re-checks prices against its own
# config, these are the CoreConfig defaults): steps and generations fit a float exactly, durations a week
# (MAX_DURATION_S, the cap the core reads them with).
_PRICE_BOUNDS = CoreConfig()
MAX_PRICE_USD_H = _PRICE_BOUNDS.price_ceiling_usd_h()
MAX_SPOT_OVER_ON_DEMAND = _PRICE_BOUNDS.spot_band()
MIN_PRICE_USD_H = 1e-4  # a price is 0 (free) or at least this: no honest feed quotes 5e-324 $/h
MAX_GPUS_PER_NODE = 64
MAX_STEP = 2**53
MAX_GENERATION = 2**31
MAX_SEQ = 2**62


def _finite(x: float | None, *, lo: float | None = 0.0, hi: float | None = None, optional: bool = False) -> bool:
    if x is None:
        return optional
    if x != x or x in (float("inf"), float("-inf")):
        return False
    return (lo is None or x >= lo) and (hi is None or x <= hi)


def screen(subject: str, msg: ev.PriceTick | ev.PreemptionNotice | ev.NodeEvent) -> str | None:
    """A rejection reason for a decoded JetStream message, or None when it may reach the core.

    Decoding checks the shape; this checks what the shape cannot: the subject names the publisher
    (``orch.node.<node>.event`` / ``orch.notice.<cloud>.<node>`` may only carry that node's events -
    per-node NATS permissions mean nothing otherwise; ``orch.price.<cloud>.<region>`` only that
    cloud/region's pools) -> ``subject_mismatch``; numbers that no honest publisher sends (negative or
    non-finite prices, times, steps, generations; prices above ``MAX_PRICE_USD_H``, spot above
    ``MAX_SPOT_OVER_ON_DEMAND`` x the tick's on-demand price; steps above ``MAX_STEP``, generations above
    ``MAX_GENERATION``, save times beyond ``MAX_DURATION_S``; capacity hints outside 0..1;
    gpus_per_node outside 1..64, a non-zero price below ``MIN_PRICE_USD_H``) and empty ids -> ``bad_value``;
    a name that is not a token (node, job, cloud, region, zone) or a dotted key (an instance type: the
    rules of ``wire.names``, what a subject token and a KV key can hold) -> ``bad_name``.
    A notice is never refused for its timestamps.
    Pure and cheap: called once per message by the decide pipeline
    (``screen_js``)."""
    parts = subject.split(".")
    if not _names_ok(msg):
        return "bad_name"
    if isinstance(msg, ev.PriceTick):
        p = msg.pool
        if len(parts) != 4 or parts[2] != p.cloud or parts[3] != p.region:
            return "subject_mismatch"
        if not (msg.id and p.zone and p.instance_type and msg.gpu_type):
            return "bad_value"
        if not 1 <= msg.gpus_per_node <= MAX_GPUS_PER_NODE:
            return "bad_value"
        if 0 < msg.price_usd_h < MIN_PRICE_USD_H or 0 < (msg.on_demand_usd_h or 0) < MIN_PRICE_USD_H:
            return "bad_value"
        if not (_finite(msg.price_usd_h, hi=MAX_PRICE_USD_H)
                and _finite(msg.on_demand_usd_h, hi=MAX_PRICE_USD_H, optional=True)
                and _finite(msg.capacity_hint, hi=1.0, optional=True) and _finite(msg.ts)):
            return "bad_value"
        od = msg.on_demand_usd_h
        if p.market == ev.Market.SPOT and od and msg.price_usd_h > MAX_SPOT_OVER_ON_DEMAND * od:
            return "bad_value"
        return None
    if isinstance(msg, ev.PreemptionNotice):
        # never refused for its timestamps: a host with a wrong clock must still get its checkpoint (the
        # core clamps the deadline into its node's notice window)
        if len(parts) != 4 or parts[2] != msg.cloud or parts[3] != msg.node_id:
            return "subject_mismatch"
        return None if msg.id else "bad_value"
    # node events: orch.node.<node>.event
    if len(parts) != 4 or parts[1] != "node" or parts[2] != msg.node_id:
        return "subject_mismatch"
    if not msg.id or not _finite(msg.ts):
        return "bad_value"
    for name in _NODE_EVENT_INTS:
        if not 0 <= getattr(msg, name, 0) <= MAX_STEP:
            return "bad_value"
    if getattr(msg, "generation", 0) > MAX_GENERATION:
        return "bad_value"
    if isinstance(msg, ev.RanksExited) and not (
            _replicas_ok(msg.replicas) and (isinstance(msg.detail, msgspec.UnsetType)
                                            or len(msg.detail) <= ev.MAX_EXIT_DETAIL)
            and (isinstance(msg.replica_lag_max, msgspec.UnsetType) or 0 <= msg.replica_lag_max <= MAX_STEP)):
        return "bad_value"
    if isinstance(msg, ev.CheckpointCommitted) and not (
            _finite(msg.save_s, hi=MAX_DURATION_S)
            and _finite(msg.deadline_margin_s, lo=-MAX_DURATION_S, hi=MAX_DURATION_S, optional=True)):
        return "bad_value"
    return None


def _replicas_ok(held: tuple[ev.ReplicaHeld, ...] | msgspec.UnsetType) -> bool:
    """The replicas a RanksExited reports: at most ``MAX_REPLICAS_REPORTED``, each a rank of its world size
    (1..``MAX_STEP``) at a step in 1..``MAX_STEP``."""
    if isinstance(held, msgspec.UnsetType):
        return True
    return len(held) <= ev.MAX_REPLICAS_REPORTED and all(
        1 <= h.world_size <= MAX_STEP and 0 <= h.rank < h.world_size and 1 <= h.step <= MAX_STEP for h in held)


def _names_ok(msg: ev.PriceTick | ev.PreemptionNotice | ev.NodeEvent) -> bool:
    """Every name of ``msg`` that can become a subject token or a KV key is one (``wire.names``)."""
    pool = getattr(msg, "pool", None)
    if pool is not None and not (is_token(pool.cloud) and is_token(pool.region) and is_token(pool.zone)
                                 and is_key(pool.instance_type)):
        return False
    if isinstance(msg, ev.PriceTick):
        return True
    if not is_token(msg.node_id) or (isinstance(msg, ev.PreemptionNotice) and not is_token(msg.cloud)):
        return False
    job_id = getattr(msg, "job_id", None)
    return job_id is None or is_token(job_id)


def screen_hb(subject: str, hb: ev.Heartbeat) -> str | None:
    """``screen`` for a heartbeat (the hot path: two comparisons): its subject must name its node."""
    if subject[10:-3] != hb.node_id:  # "orch.node." + node + ".hb"
        return "subject_mismatch"
    if not (0 <= hb.seq <= MAX_SEQ and 0 <= hb.step <= MAX_STEP and 0 <= hb.generation <= MAX_GENERATION):
        return "bad_value"
    st = hb.step_time_s
    if st is not None and not 0.0 <= st <= MAX_DURATION_S:  # nan fails both comparisons
        return "bad_value"
    return None


def screen_js(subject: str, event: JsEvent) -> None:
    """Stage screen of a decoded JetStream message (``screen``). Raises ``ev.WireError``."""
    reason = screen(subject, event)
    if reason is not None:
        raise ev.WireError(reason, f"{type(event).__name__} on {subject}")


def screen_heartbeat(subject: str, hb: ev.Heartbeat) -> None:
    """Stage screen of a decoded heartbeat (``screen_hb``). Raises ``ev.WireError``."""
    reason = screen_hb(subject, hb)
    if reason is not None:
        raise ev.WireError(reason, subject)


def admit_js(subject: str, data: bytes) -> JsEvent | Rejected:
    """Decode and screen one JetStream message: the event for the core, or why it is rejected.

    Never raises, whatever the bytes: a ``WireError`` is rejected with its reason, any other exception
    (a ``RecursionError``, a screen bug...) as ``undecodable`` / ``unscreenable``."""
    return _admit_one(subject, data, decode_js, screen_js, None)


def admit_heartbeat(subject: str, data: bytes) -> ev.Heartbeat | Rejected:
    """Decode and screen one heartbeat: the event for the core, or why it is rejected. Never raises
    (as ``admit_js``)."""
    return _admit_one(subject, data, decode_heartbeat, screen_heartbeat, "heartbeat")


def _admit_one(subject: str, data: bytes, decode: Callable[[str, bytes], E], screen: Callable[[str, E], None],
               kind: str | None) -> E | Rejected:
    """``decode`` then ``screen``; a rejection's kind is ``kind``, else the subject's."""
    stage = "undecodable"
    try:
        event = decode(subject, data)
        stage = "unscreenable"
        screen(subject, event)
    except ev.WireError as e:
        return Rejected(kind or bus.message_kind(subject), e.reason, e.detail)
    except Exception as e:
        return Rejected(kind or bus.message_kind(subject), stage, f"{type(e).__name__}: {e}"[:200])
    return event


_HB_DECODER: Final = msgspec.json.Decoder(ev.Heartbeat)


def admit_heartbeats(msgs: Iterable[Msg]) -> Admitted[ev.Heartbeat]:
    """``admit_batch(msgs, admit_heartbeat)``, cheaper per message; a failed check takes ``admit_heartbeat``."""
    out: Admitted[ev.Heartbeat] = Admitted()
    events, rejected = out.events, out.rejected
    decode, check = _HB_DECODER.decode, screen_hb
    for msg in msgs:
        subject, data = msg.subject, msg.data
        if len(data) <= ev.MAX_MESSAGE_BYTES:
            try:
                hb = decode(data)
                if hb.v in ev.SUPPORTED_VERSIONS and check(subject, hb) is None:
                    events.append(hb)
                    continue
            except Exception:  # the slow path below says why
                pass
        r = admit_heartbeat(subject, data)
        if isinstance(r, Rejected):
            rejected.append((msg, r))
        else:  # cannot happen (the same checks passed there): kept so that nothing is ever lost
            events.append(r)
    return out


@dataclass(slots=True)
class Admitted(Generic[E]):
    """The messages of a batch that passed decode and screen, in order, and the rejected ones."""

    events: list[E] = field(default_factory=list)
    rejected: list[tuple[Msg, Rejected]] = field(default_factory=list)
    # JetStream only (heartbeats are neither acked nor timed one by one):
    messages: list[Msg] = field(default_factory=list)  # the message of each event (for its ack)
    published: list[float | None] = field(default_factory=list)  # the publish time of each event


def admit_batch(msgs: Iterable[Msg], admit: Callable[[str, bytes], E | Rejected], *,
                jetstream: bool = False) -> Admitted[E]:
    """``admit`` over every message. ``jetstream``: keep each event's message and publish time."""
    out: Admitted[E] = Admitted()
    events, rejected = out.events, out.rejected
    for msg in msgs:
        r = admit(msg.subject, msg.data)
        if isinstance(r, Rejected):
            rejected.append((msg, r))
            continue
        events.append(r)
        if jetstream:
            out.messages.append(msg)
            out.published.append(_publish_ts(msg))
    return out


def _publish_ts(msg: Msg) -> float | None:
    try:
        return msg.metadata.timestamp.timestamp()
    except Exception:  # not a JetStream message (no metadata in its reply subject): no lag measured
        return None


def admit_js_batch(msgs: Iterable[Msg], metrics: Metrics, now: float) -> Admitted[JsEvent]:
    """Stage admit of a batch's JetStream messages: ``admit_batch(msgs, admit_js, jetstream=True)``, its
    rejections counted and logged (``count_rejections``), the publish-to-decide lag observed at ``now``."""
    js: Admitted[JsEvent] = admit_batch(msgs, admit_js, jetstream=True)
    count_rejections(metrics, js.rejected, loud=True)
    observe_lag(metrics, js.published, now)
    return js


def admit_heartbeat_batch(msgs: Iterable[Msg], metrics: Metrics) -> Admitted[ev.Heartbeat]:
    """Stage admit of a batch's heartbeats: ``admit_heartbeats``, its rejections counted (not logged)."""
    hb = admit_heartbeats(msgs)
    count_rejections(metrics, hb.rejected, loud=False)
    return hb


def count_rejections(metrics: Metrics, rejected: Sequence[tuple[Msg, Rejected]], *, loud: bool) -> None:
    """``orchd_messages_rejected_total`` for each rejection; ``loud``: also log each (JetStream; never
    for heartbeats, whose rejections can come by the thousand)."""
    for msg, r in rejected:
        metrics.rejected.labels(r.kind, r.reason).inc()
        if loud:
            log.warning("message_rejected", subject=msg.subject, reason=r.reason, detail=r.detail[:200])


def observe_lag(metrics: Metrics, published: Iterable[float | None], now: float) -> None:
    """``orchd_event_lag_seconds`` of JetStream messages (heartbeats: sampled by ``Decider.decide``)."""
    observe = metrics.event_lag.observe
    for ts in published:
        if ts is not None:
            observe(max(0.0, now - ts))

