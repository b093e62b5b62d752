"""Stages decode and screen of orchd's decide pipeline (``pipeline`` composes them): bytes -> wire message
-> an event for the core, or why it is rejected.

    decode     ``decode_js(subject, data)`` / ``decode_heartbeat(subject, data)``: bytes -> wire message
    screen     ``screen_js(subject, event)`` / ``screen_heartbeat(subject, hb)``: what the schema cannot
               say (the subject names the publisher, no impossible values; ``ingest.screen``)
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
from orchestrator.daemon import ingest
from orchestrator.daemon.metrics import Metrics

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


def screen_js(subject: str, event: JsEvent) -> None:
    """Stage screen of a decoded JetStream message (``ingest.screen``). Raises ``ev.WireError``."""
    reason = ingest.screen(subject, event)
    if reason is not None:
        raise ev.WireError(reason, f"{type(event).__name__} on {subject}")


def screen_heartbeat(subject: str, hb: ev.Heartbeat) -> None:
    """Stage screen of a decoded heartbeat (``ingest.screen_heartbeat``). Raises ``ev.WireError``."""
    reason = ingest.screen_heartbeat(subject, hb)
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
    decode, screen = _HB_DECODER.decode, ingest.screen_heartbeat
    for msg in msgs:
        subject, data = msg.subject, msg.data
        if len(data) <= ev.MAX_MESSAGE_BYTES:
            try:
                hb = decode(data)
                if hb.v in ev.SUPPORTED_VERSIONS and screen(subject, hb) is None:
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

