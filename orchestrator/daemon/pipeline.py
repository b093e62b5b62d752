"""The stages of orchd's decide pipeline, as plain functions and two small classes.

Every input of a batch goes through the same stages, in this order (``loop.Daemon.process`` composes
them; heartbeats take the very same functions, batched, with nothing logged per heartbeat):

    order      (``ingest.Intake.take_split``) urgent inputs (JetStream messages, shell inputs) before
               heartbeats
    decode     (``admit.py``) ``decode_js(subject, data)`` / ``decode_heartbeat(subject, data)``: bytes ->
               wire message
    screen     (``admit.py``) ``screen_js`` / ``screen_heartbeat``: what the schema cannot say (the
               subject names the publisher, no impossible values: ``admit.screen``); ``admit_js`` /
               ``admit_heartbeat`` = decode + screen of one message -> event | ``Rejected``,
               ``admit_batch`` / ``admit_heartbeats`` over a batch -> ``Admitted``
    decide     ``Decider.decide(events, ...)``: the trust gate (``core.authorize``), then ``core.decide``,
               over the events in order, one state threaded through, into ``Decided`` (dirty keys,
               commands, audit, liveness keys, acks; ``records.py``), returning an ``Outcome`` (which
               events were refused or failed)
               ``Decider.decide_heartbeats(heartbeats)``: the same for a batch of heartbeats, the runs
               that only refresh liveness folded through the core in one state rebuild
               ``decide_batch(batch, decider)`` runs decode, screen and decide over a whole batch
    dispatch   ``dispatch_checkpoints(decided, executor)`` (``decide_batch`` calls it when given the
               executor; keys in ``Decided.sent``): hand the checkpoint commands out
               at once, before the outbox is written (an agent answers a ``cmd_id`` it has seen with
               the same ack, and a crash before the outbox puts leaves the notice unacked: decided
               again, the same command); one whose node's generation start the batch decided before
               it goes with that start
    persist    ``persist(store, core, decided, after_outbox)``: outbox, then records of the dirty keys,
               audit; ``after_outbox`` runs between the two (the daemon dispatches the rest there)
    dispatch   ``dispatch(decided, executor)``: hand the other commands out once they are in the
               outbox (agent commands, then cloud calls); admin requests are answered once persisted
    ack        ``acknowledge(decided)``: ack the decided JetStream messages, ``term`` the rejected ones,
               park (``bus.park_msg``, stream ``ORCH_DEAD``) and ``term`` those given up on: the core
               raised on it, or delivered ``dead_after`` times already

The trust gate (``orchestrator/core/gate.py``: ``authorize(state, event, now) -> reason | None``)
authorizes each event against its sender's identity and the state; ``Decider.decide`` calls it right
before ``core.decide`` for each event (it needs the state as of that event, so it cannot run with the
batched, state-free ``screen``). The sender's identity is the node the event names: ``screen`` has
already tied it to the subject. A refusal goes the way of a failed event: its index is in the
``Outcome`` with the failed ones (-> ``term``), it is counted in ``orchd_messages_rejected_total{kind=<event type>,
reason}`` and shown (rate-limited) in ``orchctl events``.

Concurrency contract: everything here runs on the decide loop's task; only ``persist``, ``acknowledge``
(and the caller's ``anyio.sleep(0)`` after each dispatch) await. Admission is pure (no state), which
is why a whole batch can be admitted before the first of its events is decided.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Final

import structlog
from nats.aio.msg import Msg

import wire as ev
from orchestrator import bus
from orchestrator.core import Decision, State, authorize
from orchestrator.core.commands import Command, SendToAgent
from orchestrator.core.decide import decide as core_decide
from orchestrator.core.decide import fold_heartbeats
from orchestrator.core.gate import BAD_GENERATION
from orchestrator.core.inputs import CoreEvent
from orchestrator.daemon.admit import admit_heartbeat_batch, admit_js_batch
from orchestrator.daemon.coreapi import CoreApi
from orchestrator.daemon.executor import Executor
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.records import Batch, Decided, Result, ShellItem, bad_kv_key, outbox_key
from orchestrator.daemon.store import Store

log = structlog.get_logger("orchd")

CLOCK_EVERY: Final = 256
"""``Decider.decide`` (and ``decide_heartbeats``) reads the clock once per this many events (heartbeats:
the hot path), and observes the publish-to-decide lag of the heartbeat it reads it for (one in this many)."""


# --- order -------------------------------------------------------------------------------------------


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


@dataclass(frozen=True, slots=True)
class Outcome:
    """What ``Decider.decide`` says of the events it was given, by index: ``failed`` (refused by the trust
    gate or failed in the core), of them ``refused`` (the gate's refusals) and of those ``ahead`` (refused
    as ``bad_generation``: ahead of the state, may be right once it catches up)."""

    failed: list[int] = field(default_factory=list)
    refused: list[int] = field(default_factory=list)
    ahead: list[int] = field(default_factory=list)
    reasons: dict[int, str] = field(default_factory=dict)  # why a failed one failed: core_error, bad_key...


class Decider:
    """Stage decide: the trust gate (``core.authorize``), then ``core.decide``, over a batch's events,
    one state threaded through, into ``out``.

    A refused event never reaches the core: counted (``rejected{kind=<event type>, reason}``), given
    to ``on_reject(event, reason)`` (``orchctl events``), its index in the ``Outcome``'s ``failed`` and
    ``refused``. ``on_decision(event, decision)`` is called for each decision with commands or
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

    def decide(self, events: Sequence[CoreEvent], published: Sequence[float | None] = (), *,
               clock_every: int = CLOCK_EVERY, recounted: Collection[int] = ()) -> Outcome:
        """Gate and decide ``events`` in order; the ``Outcome`` says which the gate refused or the core
        failed on.

        ``published``: the JetStream publish time of each event (notice-to-command latency), or empty.
        The clock is read once per ``clock_every`` events. ``recounted``: the indices of events delivered
        before (a refusal as ahead of the state was counted at the first delivery)."""
        outcome = Outcome()
        state = self.out.state
        failed = outcome.failed
        now = 0.0
        heartbeat = ev.Heartbeat
        lag = self.metrics.event_lag.observe
        one = self._one
        for i, event in enumerate(events):
            if i % clock_every == 0:
                now = self.clock()
                if type(event) is heartbeat:
                    lag(max(0.0, now - event.ts))
            state = one(state, i, event, now, outcome, published[i] if published else None, recounted)
        self._close(events, state, failed)
        return outcome

    def decide_heartbeats(self, events: Sequence[ev.Heartbeat], *, clock_every: int = CLOCK_EVERY) -> Outcome:
        """``decide(events)`` for a batch of heartbeats, with the same results (state, liveness keys,
        refusals and their counts, clock reads and lag samples): the heartbeats that only refresh
        liveness and progress are folded through the gate and the core in one state rebuild per run
        (``core.decide.fold_heartbeats``), one that needs the slow path is decided on its own. Only with
        the real core: with another ``CoreApi.decide`` (a test's) they are decided one by one."""
        if self.core.decide is not core_decide:
            return self.decide(events, clock_every=clock_every)
        outcome = Outcome()
        refused, failed = outcome.refused, outcome.failed
        state = self.out.state
        liveness = self.out.liveness
        lag = self.metrics.event_lag.observe
        for start in range(0, len(events), clock_every):
            now = self.clock()
            lag(max(0.0, now - events[start].ts))
            end = min(start + clock_every, len(events))
            i = start
            while i < end:
                try:
                    fold = fold_heartbeats(state, events, i, end, now)
                except Exception:  # a core bug: the rest of the run one by one, each failure as in ``decide``
                    for j in range(i, end):
                        state = self._one(state, j, events[j], now, outcome, None)
                    break
                for j, reason in fold.refused:
                    self._refuse(events[j], reason)
                    refused.append(j)
                    failed.append(j)
                liveness.update(fold.live)  # liveness only: persisted at a lower rate
                state, i = fold.state, fold.stop
                if i < end:  # the slow path
                    state = self._one(state, i, events[i], now, outcome, None)
                    i += 1
        self._close(events, state, failed)
        return outcome

    def _one(self, state: State, i: int, event: CoreEvent, now: float, outcome: Outcome,
             publish_ts: float | None, recounted: Collection[int] = ()) -> State:
        """Gate and decide ``event`` (index ``i``) from ``state`` into ``outcome``; the state after it."""
        reason = authorize(state, event, now)
        if reason is not None:
            if reason == BAD_GENERATION:
                outcome.ahead.append(i)
            if reason != BAD_GENERATION or i not in recounted:  # a retried message is counted once
                self._refuse(event, reason)
            outcome.refused.append(i)
            outcome.failed.append(i)
            return state
        try:
            d = self.core.decide(state, event, now)
        except Exception as e:  # a core bug must not stop the daemon: skip the event, loudly
            self._core_error(event, e)
            outcome.failed.append(i)
            return state
        if d.dirty and (bad := _unstorable(d.dirty)) is not None:  # a permanent refusal: never retried
            self._refuse_unstorable(event, *bad)
            outcome.failed.append(i)
            outcome.reasons[i] = bad[1]
            return state
        out = self.out
        if d.dirty:
            out.dirty.update(d.dirty)
        elif type(event) is ev.Heartbeat:
            out.liveness.add("node." + event.node_id)  # liveness only: persisted at a lower rate
        if d.commands or d.audit:
            self._take(event, d, publish_ts)
        if type(event) is ev.PreemptionNotice:
            self._count_preemption(d.state, event)
        return d.state

    def _close(self, events: Sequence[CoreEvent], state: State, failed: list[int]) -> None:
        """After ``events`` were decided: the state, the events seen and their counts."""
        out = self.out
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
            elif a.action == "deadline_at_risk":
                out.at_risk[a.reason] += 1

    def _count_preemption(self, state: State, event: ev.PreemptionNotice) -> None:
        node = state.nodes.get(event.node_id)
        if node is not None:
            self.metrics.preemptions.labels(node.pool.cloud, node.pool_name, "notice").inc()

    def _refuse_unstorable(self, event: CoreEvent, key: str, reason: str) -> None:
        self.metrics.rejected.labels(type(event).__name__, reason).inc()
        log.error("decision_unstorable", event_type=type(event).__name__, reason=reason, key=key[:200],
                  hint="a name that is not a token or dotted key reached the core; the event is parked")

    def _core_error(self, event: CoreEvent, e: Exception) -> None:
        self.metrics.rejected.labels(type(event).__name__, "core_error").inc()
        log.exception("decide_failed", event_type=type(event).__name__, error=repr(e))


@dataclass(frozen=True, slots=True)
class Stages:
    """What the decide stage takes besides a batch, its state and the executor: fixed for a daemon's life."""

    core: CoreApi
    metrics: Metrics
    on_decision: Callable[[CoreEvent, Decision], None]
    on_reject: Callable[[CoreEvent, str], None] | None = None
    dead_after: int = bus.DEAD_AFTER_DELIVERIES
    retry_s: float = 5.0  # ``retry_ahead_s`` of the consumers' ack wait


def decide(batch: Batch, state: State, stages: Stages, executor: Executor | None) -> Decided:
    """Stage decide of a batch from ``state`` (a ``Decider`` over it, then ``decide_batch``): the one call
    the decide loop makes into the pipeline before a notice's checkpoint command leaves."""
    decider = Decider(stages.core, state, metrics=stages.metrics, on_decision=stages.on_decision,
                      on_reject=stages.on_reject)
    return decide_batch(batch, decider, dead_after=stages.dead_after, retry_s=stages.retry_s, executor=executor)


def _unstorable(keys: Collection[str]) -> tuple[str, str] | None:
    """(key, reason) of the first record key the store could never write, or None."""
    for key in keys:
        reason = bad_kv_key(key)
        if reason is not None:
            return key, reason
    return None


def decide_batch(batch: Batch, decider: Decider, *, dead_after: int = bus.DEAD_AFTER_DELIVERIES,
                 retry_s: float = 5.0, executor: Executor | None = None) -> Decided:
    """Decode, screen and decide a whole batch: shell inputs, then JetStream messages, then heartbeats;
    with an ``executor``, hand it the batch's checkpoint commands at once (``dispatch_checkpoints``,
    their keys in ``Decided.sent``).

    ``dead_after``: a JetStream message delivered this many times is parked (``dead_letters``).
    ``retry_s``: the base delay of a message refused as ahead of the state (``retry_ahead_s``)."""
    out, metrics = decider.out, decider.metrics
    events, done = unpack_shell(batch.shell)
    out.done_keys.extend(done)
    out.replies.extend(item.reply for item in batch.shell if item.reply is not None)
    decider.decide(events)
    if batch.js:
        _decide_js([msg for _kind, msg in batch.js], decider, dead_after, retry_s)
    if batch.hb:
        decider.decide_heartbeats(admit_heartbeat_batch(batch.hb, metrics).events)
    if executor is not None and out.commands:
        out.sent.extend(dispatch_checkpoints(out, executor))
    return out


def _decide_js(msgs: list[Msg], decider: Decider, dead_after: int, retry_s: float) -> None:
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
    js = admit_js_batch(fresh, metrics, now)
    out.to_term.extend(msg for msg, _ in js.rejected)
    deliveries = [bus.num_delivered(msg) for msg in js.messages]
    outcome = decider.decide(js.events, js.published, clock_every=1,
                             recounted=frozenset(i for i, n in enumerate(deliveries) if n > 1))
    failed = set(outcome.failed)
    refused = set(outcome.refused)  # the trust gate's refusals: termed like the rejected ones
    ahead = set(outcome.ahead)  # ... but one ahead of the state may be right once the state catches up
    for i, msg in enumerate(js.messages):
        if i in ahead and deliveries[i] < dead_after - 1:
            out.to_retry.append((msg, retry_s * deliveries[i]))
        elif i in refused:
            out.to_term.append(msg)
        elif i in failed:
            out.to_park.append((msg, outcome.reasons.get(i, "core_error")))
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


def retry_ahead_s(ack_wait_s: float) -> float:
    """The base delay of a node event refused as ahead of the state (``bad_generation``: a generation
    newer than its node's record): it comes back after this times its deliveries so far - half the
    consumers' ack wait (``bus.ack_wait_s``), so 0.5, 1 and 1.5 ack waits, 3 in all, before its next
    delivery is termed like any refusal (with the default ``dead_after_deliveries`` of 5, the one before
    the delivery that would park it): 5, 10 and 15 s at the default lease TTL. After a crash between a
    batch's outbox and its records, orchd re-executes the outbox's commands from an older state: an agent
    can start the generation they order, and report it, before the message that decided it is
    redelivered (one ack wait after it reached the daemon that crashed) and brings the state there;
    termed, that report was lost and the job waited for it until its start timeout."""
    return ack_wait_s / 2


async def acknowledge(decided: Decided) -> None:
    """Stage ack: after persist, ack the decided JetStream messages, ``term`` the rejected ones (so
    they are never redelivered), park the given-up ones in ``ORCH_DEAD`` and then ``term`` them; ``nak``
    with a delay those refused as ahead of the state (``retry_ahead_s``). A
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
    for msg, delay in decided.to_retry:
        try:
            await msg.nak(delay=delay)
        except Exception as e:  # not naked: it comes back after the ack wait all the same
            log.debug("nak_failed", error=repr(e))


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


def dispatch_checkpoints(decided: Decided, executor: Executor) -> list[str]:
    """Stage dispatch, first part: hand the batch's checkpoint commands to the executor in decision
    order, before the outbox is written (the caller yields once after, so their tasks send at once).
    They need not wait for the outbox's round trip: a crash before the outbox puts leaves the batch's
    messages unacked, so the notice is redelivered and decided again from the same state, into the same
    command (same ``cmd_id``), which the agent answers with the ack it gave the first time. Returns the
    outbox keys handed out (``dispatch`` skips them). A checkpoint of a node whose generation start this
    batch decided before it waits for that start (``dispatch``): sent first, the agent would refuse it as
    an unknown generation, then start the generation."""
    early = _early_checkpoints(decided.commands)
    commands = [decided.commands[key] for key in early]
    executor.submit_all([(key, cmd, decided.notice_ts.get(cmd.command.cmd_id) if isinstance(cmd, SendToAgent)
                          else None) for key, cmd in zip(early, commands, strict=True)])
    return early


def dispatch(decided: Decided, executor: Executor, sent: Collection[str] = ()) -> None:
    """Stage dispatch, the rest: hand the new commands not sent already (``decided.sent`` and ``sent``:
    ``dispatch_checkpoints``) to
    the executor once they are in the outbox (``persist``'s ``after_outbox``): the other agent commands
    (in decision order), then the cloud calls (the caller yields once after, so their tasks send at
    once)."""
    skip = set(decided.sent).union(sent)
    rest = [(key, c) for key, c in decided.commands.items() if key not in skip]
    rest.sort(key=lambda item: not isinstance(item[1], SendToAgent))  # agent commands, then cloud calls
    executor.submit_all([(key, c, None) for key, c in rest])


def _early_checkpoints(commands: dict[str, Command]) -> list[str]:
    """The keys of the checkpoint commands ``dispatch_checkpoints`` hands out, in decision order: those
    of nodes with no generation start earlier in the batch."""
    early: list[str] = []
    starting: set[str] = set()
    for key, c in commands.items():
        if isinstance(c, SendToAgent):
            cmd = c.command
            if isinstance(cmd, ev.StartGenerationCmd):
                starting.add(cmd.node_id)
            elif isinstance(cmd, ev.CheckpointCmd) and cmd.node_id not in starting:
                early.append(key)
    return early
