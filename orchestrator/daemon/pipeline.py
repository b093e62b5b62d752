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
    decide     ``Decider.decide(events, ...)``: ``core.decide`` over the events in order, one state
               threaded through -> ``Decided`` (dirty keys, commands, audit, liveness keys, acks)
               ``decide_batch(batch, decider)`` runs decode, screen and decide over a whole batch
    persist    ``persist(store, core, decided)``: records of the dirty keys, outbox, audit (outbox first)
    ack        ``acknowledge(decided)``: ack the decided JetStream messages, ``term`` the rejected ones
    dispatch   ``dispatch(decided, executor, notice_ts)``: answer admin requests, hand commands out

Where the two planned additions plug in:

- **trust gate** (authorize each event against its sender's identity and the state): a function
  ``authorize(event, sender, state) -> Rejected | None`` called by ``Decider.decide`` right before
  ``core.decide`` for each event (it needs the state as of that event, so it cannot run with the
  batched, state-free ``screen``). A refusal goes the way of a failed event today: the index is
  returned with the failed ones (-> ``term``) and counted in ``orchd_messages_rejected_total``. The
  sender's identity travels with the event from ``admit_batch`` (a field of ``Admitted`` beside
  ``published``).
- **priority lane for preemption notices**: ``split_urgent`` is the ordering stage; the lane splits
  the notices out of ``batch.js`` into a pass of their own, processed (decided, persisted, acked,
  dispatched) before the rest of the urgent pass. ``Intake`` would keep them in a buffer of their own
  so that ``take`` can hand them out first.

Concurrency contract: everything here runs on the decide loop's task; only ``persist``, ``acknowledge``
(and the caller's ``anyio.sleep(0)`` after ``dispatch``) await. Admission is pure (no state), which
is why a whole batch can be admitted before the first of its events is decided.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Generic, TypeAlias, TypeVar

import structlog
from nats.aio.msg import Msg

import wire as ev
from orchestrator import bus
from orchestrator.core import Decision, State
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
    are decided, persisted and dispatched before the heartbeats taken with them.

    The priority lane for preemption notices plugs in here (see the module docstring)."""
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
    """Decode and screen one JetStream message: the event for the core, or why it is rejected."""
    try:
        event = decode_js(subject, data)
        screen_js(subject, event)
    except ev.WireError as e:
        return Rejected(bus.message_kind(subject), e.reason, e.detail)
    return event


def admit_heartbeat(subject: str, data: bytes) -> ev.Heartbeat | Rejected:
    """Decode and screen one heartbeat: the event for the core, or why it is rejected."""
    try:
        hb = decode_heartbeat(subject, data)
        screen_heartbeat(subject, hb)
    except ev.WireError as e:
        return Rejected("heartbeat", e.reason, e.detail)
    return hb


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
    decided: int = 0
    notice_ts: dict[str, float] = field(default_factory=dict)  # checkpoint cmd_id -> its notice's publish ts
    to_ack: list[Msg] = field(default_factory=list)
    to_term: list[Msg] = field(default_factory=list)  # rejected, or poison for the core: never redelivered
    replies: list[asyncio.Future[None]] = field(default_factory=list)  # admin requests answered after persist


class Decider:
    """Stage decide: ``core.decide`` over a batch's events, one state threaded through, into ``out``.

    ``on_decision(event, decision)`` is called for each decision with commands or audit (the log and
    ``orchctl events``). An exception from the core is a core bug: logged with its traceback, counted
    (``core_error``), the event skipped, the daemon goes on."""

    def __init__(self, core: CoreApi, state: State, *, metrics: Metrics,
                 on_decision: Callable[[CoreEvent, Decision], None],
                 clock: Callable[[], float] = time.time) -> None:
        self.core = core
        self.metrics = metrics
        self.on_decision = on_decision
        self.clock = clock
        self.out = Decided(state)

    def decide(self, events: Sequence[CoreEvent], published: Sequence[float | None] = (), *,
               clock_every: int = CLOCK_EVERY) -> list[int]:
        """Decide ``events`` in order; return the indices of those the core failed on.

        ``published``: the JetStream publish time of each event (notice-to-command latency), or empty.
        The clock is read once per ``clock_every`` events (the trust gate plugs in before
        ``decide(state, event, now)``: see the module docstring)."""
        out = self.out
        decide = self.core.decide
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
        by_type = Counter(map(type, events))
        for i in failed:
            by_type[type(events[i])] -= 1
        for t, n in by_type.items():
            if n:
                out.counts[t.__name__] += n
        out.decided += len(events) - len(failed)
        return failed

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

    def _count_preemption(self, state: State, event: ev.PreemptionNotice) -> None:
        node = state.nodes.get(event.node_id)
        if node is not None:
            self.metrics.preemptions.labels(node.pool.cloud, node.pool_name, "notice").inc()

    def _core_error(self, event: CoreEvent, e: Exception) -> None:
        self.metrics.rejected.labels(type(event).__name__, "core_error").inc()
        log.exception("decide_failed", event_type=type(event).__name__, error=repr(e))


def decide_batch(batch: Batch, decider: Decider) -> Decided:
    """Decode, screen and decide a whole batch: shell inputs, then JetStream messages, then heartbeats."""
    out, metrics = decider.out, decider.metrics
    events, done = unpack_shell(batch.shell)
    out.done_keys.extend(done)
    out.replies.extend(item.reply for item in batch.shell if item.reply is not None)
    decider.decide(events)
    if batch.js:
        now = decider.clock()
        js: Admitted[JsEvent] = admit_batch((msg for _kind, msg in batch.js), admit_js, jetstream=True)
        count_rejections(metrics, js.rejected, loud=True)
        out.to_term.extend(msg for msg, _ in js.rejected)
        observe_lag(metrics, js.published, now)
        failed = set(decider.decide(js.events, js.published, clock_every=1))
        for i, msg in enumerate(js.messages):
            (out.to_term if i in failed else out.to_ack).append(msg)
    if batch.hb:
        hb = admit_batch(batch.hb, admit_heartbeat)
        count_rejections(metrics, hb.rejected, loud=False)
        decider.decide(hb.events)
    return out


# --- persist, ack, dispatch --------------------------------------------------------------------------


async def persist(store: Store, core: CoreApi, decided: Decided) -> int:
    """Stage persist: outbox puts first, then the records of the dirty keys, the outbox deletions and the
    audit (``Store.persist``; retried until stored). Returns the number of records written."""
    dirty = decided.dirty
    records = core.state_to_records(decided.state, frozenset(dirty)) if dirty else {}
    done = decided.done_keys
    if decided.commands and done:  # a command decided again in this batch keeps its outbox entry
        done = [k for k in done if k not in decided.commands]
    await store.persist(records, decided.commands, done, decided.audit)
    return len(records)


async def acknowledge(decided: Decided) -> None:
    """Stage ack: after persist, ack the decided JetStream messages and ``term`` the rejected ones (so
    they are never redelivered). A failed ack is harmless: redelivered, decided again (idempotent)."""
    for msg in decided.to_ack:
        try:
            await msg.ack()
        except Exception as e:  # disconnected: the message is redelivered and decided again (idempotent)
            log.debug("ack_failed", error=repr(e))
    for msg in decided.to_term:
        try:
            await msg.term()
        except Exception as e:
            log.debug("term_failed", error=repr(e))


def dispatch(decided: Decided, executor: Executor, notice_ts: dict[str, float]) -> None:
    """Stage dispatch: answer the admin requests of the batch, hand the new commands to the executor
    (the caller yields once after, so their tasks send at once)."""
    for reply in decided.replies:
        if not reply.done():
            reply.set_result(None)
    notice_ts.update(decided.notice_ts)
    for key, c in decided.commands.items():
        executor.submit(key, c)
