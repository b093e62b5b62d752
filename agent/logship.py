"""Ship the ranks' log lines to NATS (and keep a local copy), so ``orchctl logs JOB`` shows them.

Role: every non-report line a rank prints becomes a ``LogLine`` on ``orch.logs.<job>.<node>``, stored by
the JetStream stream ORCH_LOGS (limits-based, bounded in age and bytes). orchd creates it at start-up
(``orchestrator.bus.ensure_topology`` calls ``ensure_logs_stream``); an agent does too, but only on an
open server (``creates_logs_stream``): under its per-node credential (``agent_permissions``) the agent
has no ``$JS.API`` rights and needs none, its plain publishes on its own job's subject are stored. Lines
are also appended to ``<work_dir>/logs/<job>/gen<G>-rank<R>.log`` so nothing is lost in an outage.

Shipping is best effort: lines go out as plain publishes (the stream stores them; no per-line ack
round trip), from a bounded queue that drops the oldest lines while NATS is down (counted in
``dropped``). Events that matter go through the Outbox, never through here.

Concurrency contract: ``ship`` is synchronous and never blocks; one ``run`` task publishes.
"""

from __future__ import annotations

import collections
import math
import time
from pathlib import Path
from typing import IO

import anyio
import structlog
from nats.aio.client import Client as NATS

from agent.config import AgentConfig
from wire import JobId, LogLine, NodeId, encode, subject_logs

log = structlog.get_logger("agent.logship")

LOGS_STREAM = "ORCH_LOGS"
LOGS_SUBJECTS = ["orch.logs.>"]


async def ensure_logs_stream(nc: NATS, *, replicas: int = 1, max_age_s: float = 7 * 86400,
                             max_bytes: int = 256 * 2**20) -> None:
    """Create ORCH_LOGS if missing; an existing stream (maybe configured by an operator) is left as is.
    Raises on timeouts and permission errors (orchd retries; the agent logs and goes on)."""
    from nats.js.api import StreamConfig
    from nats.js.errors import BadRequestError, NotFoundError

    js = nc.jetstream()
    try:
        await js.stream_info(LOGS_STREAM)
        return
    except NotFoundError:
        pass
    try:
        await js.add_stream(StreamConfig(name=LOGS_STREAM, subjects=LOGS_SUBJECTS, max_age=max_age_s,
                                         max_bytes=max_bytes, num_replicas=replicas))
    except BadRequestError as e:  # created concurrently with another config: that one stays
        log.debug("logs_stream_not_created", error=repr(e))


def creates_logs_stream(cfg: AgentConfig) -> bool:
    """Whether the agent should create ORCH_LOGS itself: only on an open server (no credential of any
    kind). Under a credential the stream is orchd's, and a ``$JS.API.STREAM.INFO`` request would be a
    permissions violation of the agent role."""
    return not (cfg.enrol_token or cfg.nats_user or cfg.nats_token or cfg.nats_creds_file)


class LogShipper:
    def __init__(self, nc: NATS, node_id: str, work_dir: Path, *, max_queue: int = 5000) -> None:
        self.nc = nc
        self.node_id = node_id
        self.work_dir = work_dir
        self._q: collections.deque[LogLine] = collections.deque(maxlen=max_queue)
        self._wake = anyio.Event()
        self._files: dict[tuple[str, int, int], IO[str]] = {}
        self.seq = 0
        self.shipped = 0
        self.dropped = 0

    def ship(self, job_id: str, generation: int, rank: int, stream: str, line: str) -> None:
        self.seq += 1
        rec = LogLine(job_id=JobId(job_id), node_id=NodeId(self.node_id), generation=generation, rank=rank,
                      stream=stream, seq=self.seq, line=line[:8192], ts=time.time())
        f = self._file(job_id, generation, rank)
        f.write(f"[{stream}] {line}\n")
        f.flush()
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
