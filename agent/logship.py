"""Ship the ranks' log lines to NATS (and keep a local copy), so ``orchctl logs JOB`` shows them.

Role: every non-report line a rank prints becomes a ``LogLine`` on ``orch.logs.<job>.<node>``, stored by
the JetStream stream ORCH_LOGS. orchd creates it at start-up and brings an existing one to this config
(``orchestrator.bus.ensure_topology`` calls ``ensure_logs_stream(update=True)``); an agent creates it too,
but only on an open server (``creates_logs_stream``) and never changes one: under its per-node credential
(``agent_permissions``) the agent has no ``$JS.API`` rights and needs none, its plain publishes on its own
subject are stored. Lines are also appended to ``<work_dir>/logs/<job>/gen<G>-rank<R>.log`` so nothing is
lost in an outage.

Bounds, on the server (agents publish straight into the stream, orchd never sees the lines): the stream
keeps at most ``LOGS_PER_SUBJECT`` lines per subject - one node of one job - (the oldest of that subject
go first), refuses a message over ``LOGS_MAX_MSG_BYTES`` and holds ``LOGS_MAX_BYTES`` in all, so one node,
however much it writes, holds at most ``LOGS_PER_SUBJECT * LOGS_MAX_MSG_BYTES`` and cannot push out the
other jobs' lines. The shipper cuts a line to ``LINE_MAX_BYTES`` of UTF-8 and rate-limits itself (token
bucket: ``rate_per_s`` lines a second, bursts of ``burst``); lines over the rate are dropped, counted
(``dropped``) and reported in the stream by one line ``[orch-agent] N log lines dropped (...)`` once the
bucket has room again.

Shipping is best effort: lines go out as plain publishes (the stream stores them; no per-line ack
round trip), from a bounded queue that drops the oldest lines while NATS is down (counted in
``dropped``). Events that matter go through the Outbox, never through here.

Concurrency contract: ``ship`` is synchronous and never blocks; one ``run`` task publishes.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import anyio
import structlog
from nats.aio.client import Client as NATS

from agent.config import AgentConfig
from wire import JobId, LogLine, NodeId, encode, subject_logs

log = structlog.get_logger("agent.logship")

LOGS_STREAM = "ORCH_LOGS"
LOGS_SUBJECTS = ["orch.logs.>"]
LINE_MAX_BYTES = 8192
"""A shipped line's text, in UTF-8 bytes (longer lines are cut; the local file keeps them whole)."""
LOGS_MAX_MSG_BYTES = 12 * 1024
"""The largest message ORCH_LOGS stores: a LogLine of ``LINE_MAX_BYTES`` with its envelope (ids up to
``wire.names.TOKEN_MAX``) fits; anything bigger is refused by the server."""
LOGS_PER_SUBJECT = 5000
"""Lines kept per subject (one node of one job): at most about 60 MiB per node."""
LOGS_MAX_BYTES = 1 << 30
LOGS_MAX_AGE_S = 7 * 86400.0
RATE_PER_S = 200.0
BURST = 2000


def logs_stream_config(replicas: int = 1, max_age_s: float = LOGS_MAX_AGE_S, max_bytes: int = LOGS_MAX_BYTES) -> Any:
    """ORCH_LOGS's config: limits-based, the oldest go first, bounded per subject, per message and in all."""
    from nats.js.api import DiscardPolicy, RetentionPolicy, StreamConfig

    return StreamConfig(name=LOGS_STREAM, subjects=LOGS_SUBJECTS, retention=RetentionPolicy.LIMITS,
                        discard=DiscardPolicy.OLD, max_age=max_age_s, max_bytes=max_bytes,
                        max_msgs_per_subject=LOGS_PER_SUBJECT, max_msg_size=LOGS_MAX_MSG_BYTES,
                        num_replicas=replicas)


async def ensure_logs_stream(nc: NATS, *, replicas: int = 1, update: bool = False) -> None:
    """Create ORCH_LOGS if missing. ``update`` (orchd's start-up): an existing stream - one an older
    release created without the per-subject and message limits - is brought to ``logs_stream_config``;
    without it (an agent) an existing stream is left as is. Raises on timeouts and permission errors
    (orchd retries; the agent logs and goes on)."""
    from nats.js.errors import BadRequestError, NotFoundError

    js = nc.jetstream()
    cfg = logs_stream_config(replicas)
    try:
        info = await js.stream_info(LOGS_STREAM)
    except NotFoundError:
        info = None
    if info is None:
        try:
            await js.add_stream(cfg)
        except BadRequestError as e:  # created concurrently with another config: that one stays
            log.debug("logs_stream_not_created", error=repr(e))
        return
    if not update:
        return
    cfg.storage = info.config.storage  # a stream's storage type cannot change
    cfg.num_replicas = info.config.num_replicas or replicas
    try:
        await js.update_stream(cfg)
    except BadRequestError as e:  # a change the server refuses: said loudly, the old limits stay
        log.warning("logs_stream_update_refused", stream=LOGS_STREAM, error=str(e))


def cut_line(line: str, max_bytes: int = LINE_MAX_BYTES) -> str:
    """``line`` cut to at most ``max_bytes`` of UTF-8 (never inside a character)."""
    data = line.encode("utf-8", "replace")
    if len(data) <= max_bytes:
        return line
    return data[:max_bytes].decode("utf-8", "ignore")


class TokenBucket:
    """``rate_per_s`` tokens a second up to ``burst``; ``take`` spends one when there is one."""

    def __init__(self, rate_per_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        if not (rate_per_s > 0 and burst >= 1):
            raise ValueError(f"token bucket: rate_per_s > 0 and burst >= 1 needed, got {rate_per_s!r}, {burst!r}")
        self.rate, self.burst, self.clock = float(rate_per_s), float(burst), clock
        self.tokens, self.ts = float(burst), clock()

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.ts) * self.rate)
        self.ts = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


def creates_logs_stream(cfg: AgentConfig) -> bool:
    """Whether the agent should create ORCH_LOGS itself: only on an open server (no credential of any
    kind). Under a credential the stream is orchd's, and a ``$JS.API.STREAM.INFO`` request would be a
    permissions violation of the agent role."""
    return not (cfg.enrol_token or cfg.nats_user or cfg.nats_token or cfg.nats_creds_file)


class LogShipper:
    def __init__(self, nc: NATS, node_id: str, work_dir: Path, *, max_queue: int = 5000,
                 rate_per_s: float = RATE_PER_S, burst: int = BURST,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.nc = nc
        self._bucket = TokenBucket(rate_per_s, burst, clock)
        self._unreported = 0  # lines over the rate since the last "dropped" line
        self.rate_dropped = 0
        self.node_id = node_id
        self.work_dir = work_dir
        self._q: collections.deque[LogLine] = collections.deque(maxlen=max_queue)
        self._wake = anyio.Event()
        self._files: dict[tuple[str, int, int], IO[str]] = {}
        self.seq = 0
        self.shipped = 0
        self.dropped = 0

    def ship(self, job_id: str, generation: int, rank: int, stream: str, line: str) -> None:
        f = self._file(job_id, generation, rank)
        f.write(f"[{stream}] {line}\n")
        f.flush()
        if not self._bucket.take():
            self._unreported += 1
            self.rate_dropped += 1
            self.dropped += 1
            return
        if self._unreported:  # the bucket has room again: say what was dropped, in the lines' place
            n, self._unreported = self._unreported, 0
            self._enqueue(job_id, generation, rank, "stderr",
                          f"[orch-agent] {n} log lines dropped (over {self._bucket.rate:g} lines/s, "
                          f"bursts of {self._bucket.burst:g}); the node's file {self.work_dir}/logs/{job_id} has them")
            if not self._bucket.take():
                self._unreported += 1
                self.rate_dropped += 1
                self.dropped += 1
                return
        self._enqueue(job_id, generation, rank, stream, line)

    def _enqueue(self, job_id: str, generation: int, rank: int, stream: str, line: str) -> None:
        self.seq += 1
        rec = LogLine(job_id=JobId(job_id), node_id=NodeId(self.node_id), generation=generation, rank=rank,
                      stream=stream, seq=self.seq, line=cut_line(line), ts=time.time())
        if len(self._q) == self._q.maxlen:
            self.dropped += 1
        self._q.append(rec)
        self._wake.set()

    def _file(self, job_id: str, generation: int, rank: int) -> IO[str]:
        key = (job_id, generation, rank)
        f = self._files.get(key)
        if f is None:
            path = self.work_dir / "logs" / job_id / f"gen{generation}-rank{rank}.log"
            path.parent.mkdir(parents=True, exist_ok=True)
            f = self._files[key] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        return f

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    async def run(self) -> None:
        while True:
            if not self._q:
                self._wake = anyio.Event()
                await self._wake.wait()
                continue
            if not self.nc.is_connected:
                await anyio.sleep(0.2)
                continue
            rec = self._q.popleft()
            try:
                await self.nc.publish(subject_logs(rec.job_id, rec.node_id), encode(rec))
                self.shipped += 1
            except anyio.get_cancelled_exc_class():
                raise
            except Exception as e:  # any failure: best effort, put it back and wait for the connection
                self._q.appendleft(rec)
                log.debug("log_ship_failed", error=repr(e))
                await anyio.sleep(0.2)

    async def flush(self, timeout_s: float) -> None:
        with anyio.move_on_after(timeout_s):
            while self._q and self.nc.is_connected:
                await anyio.sleep(0.05)
            if self.nc.is_connected:  # whole seconds for nats-py; the scope above bounds the wait anyway
                await self.nc.flush(timeout=max(1, math.ceil(timeout_s)))
