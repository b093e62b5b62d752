"""Logs are bounded per node on the server: one node that floods its log subject cannot erase another
job's lines (a real nats-server, the ORCH_LOGS stream as an older release created it, brought to today's
limits by orchd's start-up ``bus.ensure_topology``); the agent's shipper rate-limits itself and says how
many lines it dropped."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import nats
import pytest

import wire as ev
from agent.logship import (
    LINE_MAX_BYTES,
    LOGS_MAX_MSG_BYTES,
    LOGS_PER_SUBJECT,
    LOGS_STREAM,
    LOGS_SUBJECTS,
    LogShipper,
    TokenBucket,
    cut_line,
)
from orchestrator import bus
from orchestrator.cli.logs import read_logs
from orchestrator.natsserver import NatsServer

pytestmark = pytest.mark.anyio


async def _old_stream(nc: nats.NATS) -> None:
    """ORCH_LOGS exactly as the previous release created it: 256 MiB for all jobs, no per-subject limit."""
    from nats.js.api import StreamConfig

    await nc.jetstream().add_stream(StreamConfig(name=LOGS_STREAM, subjects=LOGS_SUBJECTS, max_age=7 * 86400,
                                                 max_bytes=256 * 2**20, num_replicas=1))


async def _lines(url: str, job: str) -> list[str]:
    out: list[str] = []
    await read_logs([url], job, out=out.append, idle_s=0.5, fmt="json")
    return out


async def test_one_node_flooding_its_subject_leaves_other_jobs_lines(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "nats").start()
    try:
        nc = await nats.connect(server.url)
        await _old_stream(nc)
        await bus.ensure_topology(nc)  # orchd's start-up: the existing stream gets today's limits
        info = await nc.jetstream().stream_info(LOGS_STREAM)
        assert (info.config.max_msgs_per_subject, info.config.max_msg_size) == (LOGS_PER_SUBJECT, LOGS_MAX_MSG_BYTES)

        quiet = LogShipper(nc, "quiet-job-n1", tmp_path / "quiet")
        async with anyio.create_task_group() as tg:
            tg.start_soon(quiet.run)
            for i in range(50):
                quiet.ship("quiet-job", 1, 0, "stdout", f"quiet line {i}")
            await quiet.flush(5.0)
            tg.cancel_scope.cancel()
        assert len(await _lines(server.url, "quiet-job")) == 50

        # a hostile node writes straight into the stream (no shipper): 300 MiB in 1000 KiB lines, then
        # 3 x the per-subject limit of full-size lines, all on its own subject
        subject = ev.subject_logs("flood-job", "flood-job-n1")
        big = ev.encode(ev.LogLine(job_id="flood-job", node_id="flood-job-n1", generation=1, rank=0, seq=0,
                                   line="x" * (1000 * 1024), ts=time.time()))
        for _ in range(300):
            await nc.publish(subject, big)
        full = ev.encode(ev.LogLine(job_id="flood-job", node_id="flood-job-n1", generation=1, rank=0, seq=1,
                                    line="y" * LINE_MAX_BYTES, ts=time.time()))
        for i in range(3 * LOGS_PER_SUBJECT):
            await nc.publish(subject, full)
            if i % 1000 == 0:
                await nc.flush()
        await nc.flush()
        state = (await nc.jetstream().stream_info(LOGS_STREAM, subjects_filter=subject)).state
        assert (state.subjects or {}).get(subject) == LOGS_PER_SUBJECT  # its newest lines, no more
        got = await _lines(server.url, "quiet-job")
        assert len(got) == 50 and all("quiet line" in line for line in got)
        await nc.close()
    finally:
        server.stop()


async def test_the_shipper_rate_limits_itself_and_says_what_it_dropped(nats_url: str, tmp_path: Path) -> None:
    nc = await nats.connect(nats_url)
    await bus.ensure_topology(nc)
    now = [100.0]
    shipper = LogShipper(nc, "chatty-job-n1", tmp_path, rate_per_s=10.0, burst=20, clock=lambda: now[0])
    async with anyio.create_task_group() as tg:
        tg.start_soon(shipper.run)
        for i in range(1000):  # one instant: the burst goes out, the rest is dropped
            shipper.ship("chatty-job", 1, 0, "stdout", f"line {i}")
        now[0] += 1.0  # a second later: room for 10 lines, the first is the report
        for i in range(5):
            shipper.ship("chatty-job", 1, 0, "stdout", f"later {i}")
        await shipper.flush(5.0)
        tg.cancel_scope.cancel()
    await nc.close()
    got = await _lines(nats_url, "chatty-job")
    assert len(got) == 20 + 1 + 5
    assert any("[orch-agent] 980 log lines dropped" in line for line in got)
    assert shipper.rate_dropped == 980
    assert (tmp_path / "logs" / "chatty-job" / "gen1-rank0.log").read_text().count("\n") == 1005  # all kept locally


def test_cut_line_and_bucket_refuse_nonsense() -> None:
    assert len(cut_line("é" * 10_000).encode()) <= LINE_MAX_BYTES
    assert cut_line("short") == "short"
    for rate, burst in ((0, 1), (-1, 5), (float("nan"), 5), (1.0, 0)):
        with pytest.raises(ValueError, match="token bucket"):
            TokenBucket(rate, burst)
