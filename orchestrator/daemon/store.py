"""Durable state of orchd in JetStream: the core's records, the command outbox, the decision audit.

Role: persistence with the ordering that makes a crash harmless. For each batch the daemon calls
``persist`` once, which writes in two phases:

    1. outbox puts      - the commands decided in this batch, before anything can execute them;
    2. state records    - the union of the batch's dirty keys (``b""`` = deleted), the deletions of
                          outbox entries whose results were decided in this batch, and audit entries.

The daemon executes the new commands once phase 1 is stored (``after_outbox``), and acks the consumed
JetStream messages only after ``persist`` returns. A crash before phase 1 loses nothing (the messages
are redelivered and decided again; ids and tokens are deterministic in the state). A crash after phase
1 leaves commands in the outbox, which the next daemon re-executes with the same ids/tokens (idempotent
at the cloud and at the agent), whether or not they had been executed already. An outbox
entry is deleted only in the batch that decided the command's result, so a result is never lost.

Writes use ``publish_async`` (pipelined: one round trip per phase, not per key) and are retried until
the server stored them; during a NATS outage ``persist`` therefore blocks, which stops intake.

Concurrency contract: one caller at a time (the decide loop); ``load`` runs once at start.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TypeAlias

import anyio
import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from orchestrator import bus
from orchestrator.core.commands import Command
from orchestrator.daemon.records import bad_subject, decode_command, encode_command

log = structlog.get_logger("orchd.store")

_KV_OP = "KV-Operation"
_MARKER = "Nats-Marker-Reason"  # nats-server 2.11+: a server-placed removal (TTL, max age)
LOAD_BARRIER = "load_barrier"  # the key ``_load_bucket`` writes a delete marker to before it reads
_AUDIT_ANY = "_"

BACKGROUND_YIELD_EVERY = 32
"""A background (liveness) write lets the decide loop run after each this many records."""

_Write: TypeAlias = tuple[str, bytes, dict[str, str] | None]
"""One publish of a write round: subject, payload, headers."""


def audit_subject(job_id: str | None) -> str:
    token = job_id if job_id and all(c not in ". *>" for c in job_id) else _AUDIT_ANY
    return f"{bus.SUBJECT_AUDIT_PREFIX}.{token}"


class Store:
    """orchd's persistence. A write is retried until stored while the store is unreachable or answers
    that it cannot now (no reply, 503: an outage, an election); one it can never take (a subject or KV
    key that is not one, a 4xx answer) is a permanent refusal: dropped, logged and given to
    ``on_refused(subject, reason)`` (orchd counts it in ``orchd_messages_rejected_total{kind="store"}``),
    never retried, so it cannot stall the loop."""

    def __init__(self, topo: bus.Topology, *, writer: Client | None = None, write_timeout_s: float = 5.0,
                 on_refused: Callable[[str, str], None] | None = None) -> None:
        self.topo = topo
        self.js = topo.js
        self.write_timeout_s = write_timeout_s
        self.writes = 0
        self.refused = 0
        self.on_refused = on_refused
        self._pipe = _Pipeline(writer or topo.nc)  # writer: a connection of its own (see daemon)

    async def load(self, timeout_s: float = 2.0) -> tuple[dict[str, bytes], dict[str, Command]]:
        """Every live record and every pending outbox command.

        ``timeout_s`` bounds each request and each wait for the next record: a load that meets a
        stream leader election raises ``nats.errors.TimeoutError`` soon, for the caller to retry."""
        js = self.topo.nc.jetstream(timeout=timeout_s)
        records = await _load_bucket(js, bus.KV_STATE, timeout_s)
        raw_outbox = await _load_bucket(js, bus.KV_OUTBOX, timeout_s)
        outbox: dict[str, Command] = {}
        for key, data in raw_outbox.items():
            try:
                outbox[key] = decode_command(data)
            except msgspec.DecodeError as e:  # a command from an incompatible version: drop, loudly
                log.error("outbox_entry_undecodable", key=key, error=str(e))
        return records, outbox

    async def persist(
        self,
        records: Mapping[str, bytes],
        outbox_put: Mapping[str, Command] = {},
        outbox_done: Iterable[str] = (),
        audit: Iterable[tuple[str | None, bytes]] = (),
        *,
        after_outbox: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Phase 1 (the outbox puts), then ``after_outbox`` (the daemon hands the commands out there: once
        they are in the outbox a crash re-executes them with the same ids and tokens, so they need not
        wait for phase 2's round trip), then phase 2 (records, outbox deletions, audit)."""
        state_pre = f"$KV.{bus.KV_STATE}."
        outbox_pre = f"$KV.{bus.KV_OUTBOX}."
        if outbox_put:
            await self._write([(outbox_pre + k, encode_command(c), None) for k, c in outbox_put.items()])
        if after_outbox is not None:
            await after_outbox()
        phase2: list[_Write] = []
        for key, value in records.items():
            if value:
                phase2.append((state_pre + key, value, None))
            else:
                phase2.append((state_pre + key, b"", {_KV_OP: "DEL"}))
        for key in outbox_done:
            phase2.append((outbox_pre + key, b"", {_KV_OP: "DEL"}))
        for job_id, data in audit:
            phase2.append((audit_subject(job_id), data, None))
        if phase2:
            await self._write(phase2)

    async def _write(self, items: list[_Write]) -> None:
        """Publish all items pipelined; retry the ones not acknowledged until every one is stored.

        A retried KV put may be stored twice (the first one was stored but its ack lost): harmless,
        the later revision has the same value."""
        pending = items
        attempt = 0
        while pending:
            failed, refused = await self._pipe.write(pending, self.write_timeout_s)
            self._refused(pending, refused)
            self.writes += len(pending) - len(failed) - len(refused)
            pending = [pending[i] for i in failed]
            if pending:
                attempt += 1
                log.warning("store_write_retry", pending=len(pending), attempt=attempt)
                await anyio.sleep(min(0.1 * 2**attempt, 2.0))

    def _refused(self, items: Sequence[_Write], refused: Mapping[int, str]) -> None:
        for i, reason in refused.items():
            subject = items[i][0]
            self.refused += 1
            log.error("store_write_refused", subject=subject[:200], reason=reason)
            if self.on_refused is not None:
                self.on_refused(subject, reason)

    async def write_records_background(self, keys: set[str],
                                       encode: Callable[[tuple[str, ...]], Mapping[str, bytes]]) -> None:
        """Write state records off the decide loop (liveness flushes): ``encode(keys)`` gives the
        CURRENT value of each key when it is published, and a key not acknowledged is encoded again
        from the then-current state on retry, so a background write never overwrites a newer record
        with an older one. A key that ``encode`` leaves out is not written (the decide loop is writing a
        newer value of it: see ``Daemon._write_liveness``)."""
        state_pre = f"$KV.{bus.KV_STATE}."

        def item(key: str) -> Callable[[], _Write | None]:
            def make() -> _Write | None:
                value = encode((key,)).get(key)
                if value is None:
                    return None
                return (state_pre + key, value, None if value else {_KV_OP: "DEL"})
            return make

        attempt = 0
        while keys:
            order = sorted(keys)
            failed, refused = await self._pipe.write([item(k) for k in order], self.write_timeout_s,
                                                     yield_every=BACKGROUND_YIELD_EVERY)
            self._refused([(state_pre + k, b"", None) for k in order], refused)
            self.writes += len(order) - len(failed) - len(refused)
            keys = {order[i] for i in failed}
            if keys:
                attempt += 1
                await anyio.sleep(min(0.1 * 2**attempt, 2.0))

    async def read_audit(self, job_id: str | None, limit: int = 200) -> list[bytes]:
        """The last ``limit`` audit entries of a job (all jobs' unattributed entries for None)."""
        subject = audit_subject(job_id)
        sub = await self.js.subscribe(subject, ordered_consumer=True, deliver_policy=bus.DeliverPolicy.ALL)
        out: list[bytes] = []
        try:
            info = await self.js.stream_info(bus.STREAM_AUDIT, subjects_filter=subject)
            total = (info.state.subjects or {}).get(subject, 0) if info.state else 0
            while len(out) < total:
                try:
                    msg = await sub.next_msg(timeout=1.0)
                except Exception:
                    break
                out.append(msg.data)
        finally:
            await sub.unsubscribe()
        return out[-limit:]


async def _load_bucket(js: JetStreamContext, bucket: str, idle_timeout_s: float = 5.0) -> dict[str, bytes]:
    """Every live key of a KV bucket: each key stored before the call, at its latest value.

    Not ``kv.watchall()`` / ``kv.keys()`` (nats-py): they end the initial values at a ``None`` marker
    decided from a ``consumer_info`` taken right after the consumer is created, or from one message's
    ``num_pending`` - both can say "nothing more" while values are still on their way (nats.py issues
    842 and 995). On an R3 cluster a new leader loaded 0 records of a bucket that held its job that way.

    Here the end is a fact from the stream: a barrier written first (a delete marker of ``LOAD_BARRIER``,
    never a record), whose acknowledgement comes from a leader a quorum follows, so every record
    committed before it has a lower sequence. ``stream_info`` alone is not enough: just after a partition
    heals, a server that led the stream before the cut can still answer as its leader for a moment, with
    an older last sequence (a new leader once loaded a job without its nodes that way and refused their
    heartbeats). A KV stream never loses its last message (the per-subject limit keeps the newest; a
    delete or purge is itself a marker; our buckets have no max age), so reading a last-per-subject
    consumer up to the barrier delivers every key; a consumer served by a stale leader never reaches it
    and the read stalls. A key rewritten while we read loses its old message before delivery, and its
    new one comes after the target: so once there, the stream is asked again and the read goes on to its
    new last sequence, until nothing was written meanwhile. A stall raises ``nats.errors.TimeoutError``
    (the daemon retries the load)."""
    stream, prefix = f"KV_{bucket}", f"$KV.{bucket}."
    try:
        barrier = await js.publish(prefix + LOAD_BARRIER, b"", stream=stream, headers={_KV_OP: "DEL"})
    except (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError):  # the stream elects a leader
        raise nats.errors.TimeoutError from None
    state = (await js.stream_info(stream)).state
    out: dict[str, bytes] = {}
    target = max(state.last_seq, barrier.seq)
    sub = await js.subscribe(prefix + ">", stream=stream, ordered_consumer=True,
                             deliver_policy=bus.DeliverPolicy.LAST_PER_SUBJECT)
    try:
        seen = 0
        while True:
            while seen < target:
                msg = await sub.next_msg(timeout=idle_timeout_s)
                seen = msg.metadata.sequence.stream
                key = msg.subject[len(prefix):]
                if msg.data and not (msg.headers and (_KV_OP in msg.headers or _MARKER in msg.headers)):
                    out[key] = msg.data
                else:  # a delete or purge marker
                    out.pop(key, None)
            target = (await js.stream_info(stream)).state.last_seq
            if target <= seen:
                return out
    finally:
        await sub.unsubscribe()


class _Round:
    __slots__ = ("pending", "failed", "refused", "done")

    def __init__(self) -> None:
        self.pending: dict[str, int] = {}
        self.failed: set[int] = set()
        self.refused: dict[int, str] = {}  # index -> why the server will never take it
        self.done = asyncio.Event()


class _Pipeline:
    """Pipelined JetStream publishes with one reply subscription (``<inbox>.<round>-<i>``).

    Leaner than ``js.publish_async`` (no task per semaphore wait, no future per message): a batch of
    N writes costs N publishes and N small ack callbacks, one round trip of latency in all. Several
    rounds may be in flight at once (the decide loop's batch and a background liveness flush);
    publishes leave in call order on one connection, so the server applies them in that order."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.prefix = ""
        self.rounds: dict[str, _Round] = {}
        self.seq = 0

    async def _on_ack(self, msg: Msg) -> None:
        token = msg.subject[len(self.prefix):]
        rnd = self.rounds.get(token.split("-", 1)[0])
        if rnd is None:
            return  # a late ack of a finished round
        idx = rnd.pending.pop(token, None)
        if idx is None:
            return
        status = msg.headers.get("Status") if msg.headers else None
        if status and status != "200":
            rnd.failed.add(idx)  # no responders (503), a timeout: the store is not there now
        elif b'"error"' in msg.data[:64]:
            code = _error_code(msg.data)
            if 400 <= code < 500 and code not in (408, 429):
                rnd.refused[idx] = f"server_{code}"
            else:
                rnd.failed.add(idx)
        if not rnd.pending:
            rnd.done.set()

    async def write(self, items: Sequence[_Write | Callable[[], _Write | None]], timeout_s: float,
                    yield_every: int = 0) -> tuple[list[int], dict[int, str]]:
        """Publish every item (a callable one is encoded at its publish, and skipped when it gives None),
        wait up to ``timeout_s`` for the acks: the indices of the items not stored, in order, and those
        refused for good with why (a subject that is not one, never published; a 4xx answer).
        ``yield_every`` > 0: let the event loop run other tasks after each that many items (a background
        write must not hold the decide loop for a whole slice; each item is still encoded and queued with
        no await in between)."""
        if not self.prefix:
            self.prefix = self.nc.new_inbox() + "."
            await self.nc.subscribe(self.prefix + "*", cb=self._on_ack, pending_msgs_limit=1_000_000)
        self.seq += 1
        rid = str(self.seq)
        rnd = self.rounds[rid] = _Round()
        failed_now: set[int] = set()
        try:
            for i, item in enumerate(items):
                if yield_every and i and i % yield_every == 0:
                    await anyio.sleep(0)
                # A callable item is encoded right here, with no await before its publish is queued:
                # the value is the newest at the moment it enters the connection's ordered stream.
                made = item() if callable(item) else item
                if made is None:
                    continue
                subject, data, headers = made
                bad = bad_subject(subject)
                if bad is not None:
                    rnd.refused[i] = bad
                    continue
                token = f"{rid}-{i}"
                rnd.pending[token] = i
                try:
                    await self.nc.publish(subject, data, reply=self.prefix + token, headers=headers)
                except Exception as e:  # closed/draining: counted as not stored
                    rnd.pending.pop(token, None)
                    failed_now.add(i)
                    log.debug("store_publish_failed", subject=subject, error=type(e).__name__)
            if rnd.pending:
                with anyio.move_on_after(timeout_s):
                    await rnd.done.wait()
            lost = set(rnd.pending.values()) | rnd.failed | failed_now
        finally:
            del self.rounds[rid]
        return sorted(lost), rnd.refused


def _error_code(data: bytes) -> int:
    """The code of a JetStream error reply (``{"error": {"code": 400, ...}}``), or 0."""
    try:
        err = msgspec.json.decode(data).get("error") or {}
        return int(err.get("code", 0))
    except (msgspec.DecodeError, AttributeError, TypeError, ValueError):
        return 0
