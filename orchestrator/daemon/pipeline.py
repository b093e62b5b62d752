"""The stages of orchd's decide pipeline, as plain functions and two small classes.

Every input of a batch goes through the same stages, in this order (``loop.Daemon.process`` composes
them; heartbeats take the very same functions, batched, with nothing logged per heartbeat):

    order      ``split_urgent(batch)``: urgent inputs (JetStream messages, shell inputs) before heartbeats
    decode     ``decode_js(subject, data)`` / ``decode_heartbeat(subject, data)``: bytes -> wire message
    screen     ``screen_js(subject, event)`` / ``screen_heartbeat(subject, hb)``: what the schema cannot
               say (the subject names the publisher, no impossible values; ``ingest.screen``)
               ``admit_js`` / ``admit_heartbeat`` = decode + screen of one message -> event | ``Rejected``;
               ``admit_batch`` runs one of them over a batch -> ``Admitted`` (events, their messages,
               rejections); ``count_rejections`` counts (and for JetStream logs) the rejections
    decide     ``Decider.decide(events, ...)``: the trust gate (``core.authorize``), then ``core.decide``,
               over the events in order, one state threaded through -> ``Decided`` (dirty keys,
               commands, audit, liveness keys, acks)
               ``decide_batch(batch, decider)`` runs decode, screen and decide over a whole batch
    persist    ``persist(store, core, decided, after_outbox)``: outbox, then records of the dirty keys,
               audit; ``after_outbox`` runs between the two (the daemon dispatches there)
    dispatch   ``dispatch(decided, executor, notice_ts)``: hand commands out (checkpoint commands
               first) once they are in the outbox; admin requests are answered once persisted
    ack        ``acknowledge(decided)``: ack the decided JetStream messages, ``term`` the rejected ones,
               park (``bus.park_msg``, stream ``ORCH_DEAD``) and ``term`` those given up on: the core
               raised on it, or delivered ``dead_after`` times already

The trust gate (``orchestrator/core/gate.py``: ``authorize(state, event, now) -> reason | None``)
authorizes each event against its sender's identity and the state; ``Decider.decide`` calls it right
before ``core.decide`` for each event (it needs the state as of that event, so it cannot run with the
batched, state-free ``screen``). The sender's identity is the node the event names: ``screen`` has
already tied it to the subject. A refusal goes the way of a failed event: the index is returned with
the failed ones (-> ``term``), it is counted in ``orchd_messages_rejected_total{kind=<event type>,
reason}`` and shown (rate-limited) in ``orchctl events``.

Concurrency contract: everything here runs on the decide loop's task; only ``persist``, ``acknowledge``
(and the caller's ``anyio.sleep(0)`` after ``dispatch``) await. Admission is pure (no state), which
is why a whole batch can be admitted before the first of its events is decided.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Generic, TypeAlias, TypeVar

import msgspec
import structlog
from nats.aio.msg import Msg

import wire as ev
from orchestrator import bus
from orchestrator.core import Decision, State, authorize
from orchestrator.core.commands import Command, SendToAgent
from orchestrator.core.inputs import CoreEvent
from orchestrator.daemon import ingest
from orchestrator.daemon.executor import Executor, Result
from orchestrator.daemon.ingest import Batch, ShellItem
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.state import CoreApi
from orchestrator.daemon.store import Store, outbox_key

log = structlog.get_logger("orchd")

JsEvent: TypeAlias = (ev.PriceTick | ev.PreemptionNotice | ev.NodeRegistered | ev.GenerationStarted
                      | ev.CheckpointCommitted | ev.RanksExited | ev.NodeLeaving)
"""What the JetStream consumers may deliver (notices, node events, prices)."""

CLOCK_EVERY: Final = 256
"""``Decider.decide`` reads the clock once per this many events (heartbeats: the hot path), and observes
the publish-to-decide lag of the heartbeat it reads it for (one in this many)."""

E = TypeVar("E")


# --- order -------------------------------------------------------------------------------------------


def split_urgent(batch: Batch) -> tuple[Batch, Batch]:
    """(urgent part, heartbeat part) of a batch: notices, node events, executor results and admin intents
    are decided, persisted and dispatched before the heartbeats taken with them (``Daemon.decide_loop``
    also takes the urgent inputs that arrive meanwhile before each bulk stage: ``Intake.take_urgent``)."""
    return Batch(batch.js, [], batch.shell), Batch([], batch.hb, [])


# --- decode and screen -------------------------------------------------------------------------------


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
    stage = "undecodable"
    try:
        event = decode_js(subject, data)
        stage = "unscreenable"
        screen_js(subject, event)
    except ev.WireError as e:
        return Rejected(bus.message_kind(subject), e.reason, e.detail)
    except Exception as e:
        return Rejected(bus.message_kind(subject), stage, f"{type(e).__name__}: {e}"[:200])
    return event


def admit_heartbeat(subject: str, data: bytes) -> ev.Heartbeat | Rejected:
    """Decode and screen one heartbeat: the event for the core, or why it is rejected. Never raises
    (as ``admit_js``)."""
    stage = "undecodable"
    try:
        hb = decode_heartbeat(subject, data)
        stage = "unscreenable"
        screen_heartbeat(subject, hb)
    except ev.WireError as e:
        return Rejected("heartbeat", e.reason, e.detail)
    except Exception as e:
        return Rejected("heartbeat", stage, f"{type(e).__name__}: {e}"[:200])
    return hb


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


def unpack_shell(items: Sequence[ShellItem]) -> tuple[list[CoreEvent], list[str]]:
    """The core events of the shell's inputs (an executor result gives its events) and the outbox keys
    whose results they carry (deleted with this batch)."""
    events: list[CoreEvent] = []
    done: list[str] = []
    for item in items:
        if isinstance(item.event, Result):
            done.append(item.event.outbox_key)
            events.extend(item.event.events)
        else:
            events.append(item.event)
    return events, done


# --- decide ------------------------------------------------------------------------------------------


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
    decided: int = 0
    notice_ts: dict[str, float] = field(default_factory=dict)  # checkpoint cmd_id -> its notice's publish ts
    to_ack: list[Msg] = field(default_factory=list)
    to_term: list[Msg] = field(default_factory=list)  # rejected, or poison for the core: never redelivered
    to_park: list[tuple[Msg, str]] = field(default_factory=list)  # (message, reason): dead-lettered, then termed
    replies: list[asyncio.Future[None]] = field(default_factory=list)  # admin requests answered after persist
    seen: list[CoreEvent] = field(default_factory=list)  # the events decided (not refused, not failed): metrics


class Decider:
    """Stage decide: the trust gate (``core.authorize``), then ``core.decide``, over a batch's events,
    one state threaded through, into ``out``.

    A refused event never reaches the core: counted (``rejected{kind=<event type>, reason}``), given
    to ``on_reject(event, reason)`` (``orchctl events``), its index returned with the failed ones and
    kept in ``refused``. ``on_decision(event, decision)`` is called for each decision with commands or
    audit (the log and ``orchctl events``). An exception from the core is a core bug: logged with its
    traceback, counted (``core_error``), the event skipped, the daemon goes on."""

    def __init__(self, core: CoreApi, state: State, *, metrics: Metrics,
                 on_decision: Callable[[CoreEvent, Decision], None],
                 on_reject: Callable[[CoreEvent, str], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.core = core
        self.metrics = metrics
        self.on_decision = on_decision
        self.on_reject = on_reject
        self.clock = clock
        self.out = Decided(state)
        self.refused: list[int] = []  # the indices the gate refused in the last ``decide`` call

    def decide(self, events: Sequence[CoreEvent], published: Sequence[float | None] = (), *,
               clock_every: int = CLOCK_EVERY) -> list[int]:
        """Gate and decide ``events`` in order; return the indices of those the gate refused or the
        core failed on.

        ``published``: the JetStream publish time of each event (notice-to-command latency), or empty.
        The clock is read once per ``clock_every`` events."""
        out = self.out
        decide = self.core.decide
        gate = authorize
        refused: list[int] = []
        self.refused = refused
        dirty, liveness = out.dirty, out.liveness
        state = out.state
        failed: list[int] = []
        now = 0.0
        heartbeat, notice = ev.Heartbeat, ev.PreemptionNotice
        lag = self.metrics.event_lag.observe
        for i, event in enumerate(events):
            if i % clock_every == 0:
                now = self.clock()
                if type(event) is heartbeat:
                    lag(max(0.0, now - event.ts))
            reason = gate(state, event, now)
            if reason is not None:
                self._refuse(event, reason)
                refused.append(i)
                failed.append(i)
                continue
            try:
                d = decide(state, event, now)
            except Exception as e:  # a core bug must not stop the daemon: skip the event, loudly
                self._core_error(event, e)
                failed.append(i)
                continue
            state = d.state
            if d.dirty:
                dirty.update(d.dirty)
            elif type(event) is heartbeat:
                liveness.add("node." + event.node_id)  # liveness only: persisted at a lower rate
            if d.commands or d.audit:
                self._take(event, d, published[i] if published else None)
            if type(event) is notice:
                self._count_preemption(state, event)
        out.state = state
        skip = set(failed)
        out.seen.extend([e for i, e in enumerate(events) if i not in skip] if skip else events)
        by_type = Counter(map(type, events))
        for i in failed:
            by_type[type(events[i])] -= 1
        for t, n in by_type.items():
            if n:
                out.counts[t.__name__] += n
        out.decided += len(events) - len(failed)
        return failed

    def _refuse(self, event: CoreEvent, reason: str) -> None:
        self.metrics.rejected.labels(type(event).__name__, reason).inc()
        if self.on_reject is not None:
            self.on_reject(event, reason)

    def _take(self, event: CoreEvent, d: Decision, publish_ts: float | None) -> None:
        out = self.out
        self.on_decision(event, d)
        for c in d.commands:
            out.commands[outbox_key(c)] = c
            if (publish_ts is not None and type(event) is ev.PreemptionNotice and isinstance(c, SendToAgent)
                    and isinstance(c.command, ev.CheckpointCmd)):
                out.notice_ts[c.command.cmd_id] = publish_ts
        encode = self.core.encode_audit
        for a in d.audit:
            out.audit.append((a.job_id, encode(a)))
            if a.action == "hold":
                out.holds[a.reason] += 1

    def _count_preemption(self, state: State, event: ev.PreemptionNotice) -> None:
        node = state.nodes.get(event.node_id)
        if node is not None:
            self.metrics.preemptions.labels(node.pool.cloud, node.pool_name, "notice").inc()

    def _core_error(self, event: CoreEvent, e: Exception) -> None:
        self.metrics.rejected.labels(type(event).__name__, "core_error").inc()
        log.exception("decide_failed", event_type=type(event).__name__, error=repr(e))


def decide_batch(batch: Batch, decider: Decider, *,
                 dead_after: int = bus.DEAD_AFTER_DELIVERIES) -> Decided:
    """Decode, screen and decide a whole batch: shell inputs, then JetStream messages, then heartbeats.

    ``dead_after``: a JetStream message delivered this many times is parked (``dead_letters``)."""
    out, metrics = decider.out, decider.metrics
    events, done = unpack_shell(batch.shell)
    out.done_keys.extend(done)
    out.replies.extend(item.reply for item in batch.shell if item.reply is not None)
    decider.decide(events)
    if batch.js:
        _decide_js([msg for _kind, msg in batch.js], decider, dead_after)
    if batch.hb:
        hb = admit_heartbeats(batch.hb)
        count_rejections(metrics, hb.rejected, loud=False)
        decider.decide(hb.events)
    return out


def _decide_js(msgs: list[Msg], decider: Decider, dead_after: int) -> None:
    """The JetStream part of ``decide_batch``: a message delivered ``dead_after`` times already failed
    (orchd died or hung on it, or could not persist it) and is parked unread (``max_deliveries``);
    the rejected ones are termed; one the core raised on is parked (``core_error``: the core is
    deterministic, a retry would fail the same way; ``orchctl dead replay`` once it is fixed)."""
    out, metrics = decider.out, decider.metrics
    now = decider.clock()
    fresh: list[Msg] = []
    for msg in msgs:
        if bus.num_delivered(msg) >= dead_after:
            metrics.rejected.labels(bus.message_kind(msg.subject), "max_deliveries").inc()
            log.warning("message_dead_lettered", subject=msg.subject, reason="max_deliveries",
                        deliveries=bus.num_delivered(msg))
            out.to_park.append((msg, "max_deliveries"))
        else:
            fresh.append(msg)
    js: Admitted[JsEvent] = admit_batch(fresh, admit_js, jetstream=True)
    count_rejections(metrics, js.rejected, loud=True)
    out.to_term.extend(msg for msg, _ in js.rejected)
    observe_lag(metrics, js.published, now)
    failed = set(decider.decide(js.events, js.published, clock_every=1))
    refused = set(decider.refused)  # the trust gate's refusals: termed like the rejected ones
    for i, msg in enumerate(js.messages):
        if i in refused:
            out.to_term.append(msg)
        elif i in failed:
            out.to_park.append((msg, "core_error"))
        else:
            out.to_ack.append(msg)


# --- persist, ack, dispatch --------------------------------------------------------------------------


async def persist(store: Store, core: CoreApi, decided: Decided,
                  after_outbox: Callable[[], Awaitable[None]] | None = None) -> int:
    """Stage persist: outbox puts, ``after_outbox`` (the daemon dispatches there), then the records of the
    dirty keys, outbox deletions and audit (``Store.persist``; retried until stored). Returns the records written."""
    dirty = decided.dirty
    records = core.state_to_records(decided.state, frozenset(dirty)) if dirty else {}
    done = decided.done_keys
    if decided.commands and done:  # a command decided again in this batch keeps its outbox entry
        done = [k for k in done if k not in decided.commands]
    await store.persist(records, decided.commands, done, decided.audit, after_outbox=after_outbox)
    return len(records)


async def acknowledge(decided: Decided) -> None:
    """Stage ack: after persist, ack the decided JetStream messages, ``term`` the rejected ones (so
    they are never redelivered), park the given-up ones in ``ORCH_DEAD`` and then ``term`` them. A
    failed ack is harmless: redelivered, decided again (idempotent); a failed park leaves the message
    unacked: it comes back after the consumers' ack wait (``bus.ack_wait_s``) and is parked then."""
    for msg in decided.to_ack:
        try:
            await msg.ack()
        except Exception as e:  # disconnected: the message is redelivered and decided again (idempotent)
            log.debug("ack_failed", error=repr(e))
    for msg, reason in decided.to_park:
        if await _park(msg, reason):
            decided.to_term.append(msg)
    for msg in decided.to_term:
        try:
            await msg.term()
        except Exception as e:
            log.debug("term_failed", error=repr(e))


async def _park(msg: Msg, reason: str) -> bool:
    """Copy ``msg`` into the dead-letter stream (on the connection it came in on); True if stored."""
    try:
        seq = await bus.park_msg(msg, reason)
    except Exception as e:  # disconnected, or no ORCH_DEAD: not termed, so it comes back
        log.warning("park_failed", subject=msg.subject, reason=reason, error=repr(e))
        return False
    log.warning("message_parked", subject=msg.subject, reason=reason, dead_seq=seq,
                deliveries=bus.num_delivered(msg))
    return True


def dispatch(decided: Decided, executor: Executor, notice_ts: dict[str, float]) -> None:
    """Stage dispatch: hand the new commands to the executor, checkpoint commands first, then the other
    agent commands, then the cloud calls (the caller yields once after, so their tasks send at once).
    Called once the commands are in the outbox (``persist``'s ``after_outbox``)."""
    notice_ts.update(decided.notice_ts)
    for key, c in sorted(decided.commands.items(), key=_dispatch_rank):
        executor.submit(key, c)


def _dispatch_rank(item: tuple[str, Command]) -> int:
    """0: a checkpoint command, 1: another agent command, 2: a cloud call."""
    return 2 if not isinstance(c := item[1], SendToAgent) else 0 if isinstance(c.command, ev.CheckpointCmd) else 1
