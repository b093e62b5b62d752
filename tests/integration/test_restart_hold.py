"""The restart hold on a real orchd (in-process, the real core) over a real nats-server and the fake cloud.

A node's agent reports each generation ending with a storage error (a full checkpoint disk, exit 76
"storage_error"): orchd holds the job with backoff between generations, shows the hold in
``orchctl jobs show``, and never counts it against ``max_restarts`` (the job is still alive after more
generations than the limit). A trainer that exits 0 before ``total_steps`` is counted: the job fails
after ``max_restarts``, with the same backoff between its generations.
"""

from __future__ import annotations

import json
import time

import anyio
import nats
import pytest

import wire as ev
from orchestrator.core import JobPhase
from orchestrator.daemon.run import run_daemon
from orchestrator.settings import load_settings
from simulations.fakecloud import FakeCloud
from tests.integration import helpers as h
from tests.integration.helpers import ctl
from tests.integration.test_trust_gate import submit

pytestmark = pytest.mark.anyio

BASE_S, MAX_S = 0.5, 1.0


def _settings(tmp_path, url: str):
    cfg = h.write_config(tmp_path, url)
    cfg.write_text(cfg.read_text().replace(
        "[daemon]\n", f"[daemon]\nrestart_backoff_base_s = {BASE_S}\nrestart_backoff_max_s = {MAX_S}\n"))
    return load_settings(cfg, env={})


async def _run_generations(tmp_path, server, reason: str, code: int, rounds: int):
    """Each generation's ranks exit with (reason, code); returns the job's states, the gaps between a
    RanksExited and the next StartGenerationCmd, and what ``orchctl jobs show`` printed while held."""
    url = server.url
    cloud = FakeCloud()
    nc = await nats.connect(url)
    js = nc.jetstream()
    agent = await h.SimAgent(nc).start()
    gaps, shown = [], []
    async with anyio.create_task_group() as tg:
        d = await tg.start(lambda task_status: run_daemon(_settings(tmp_path, url), {"fake": cloud},
                                                          task_status=task_status))
        await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL, 1.0, 3.0))
        await h.wait_for(lambda: h.POOL.name in d.state.pools)
        job_id = await submit(url, tmp_path, "held", f"file://{tmp_path}/ckpt")
        (inst,) = await h.wait_for(lambda: cloud.all_instances())
        await h.publish_js(js, ev.subject_node_event(inst.node_id), ev.NodeRegistered(
            id="reg", node_id=inst.node_id, instance_id=inst.instance_id, pool=inst.pool, host="127.0.0.1",
            ts=time.time()))
        beat, exited_at = 0, 0.0

        async def heartbeats() -> None:  # the idle agent keeps beating between generations
            nonlocal beat
            while True:
                beat += 1
                await nc.publish(ev.subject_heartbeat(inst.node_id), ev.encode(ev.Heartbeat(
                    node_id=inst.node_id, seq=beat, ts=time.time(), state=ev.AgentState.IDLE)))
                await anyio.sleep(0.3)

        tg.start_soon(heartbeats)
        for gen in range(1, rounds + 1):
            start = await h.wait_for(lambda g=gen: [c for c in agent.of_kind(ev.StartGenerationCmd)
                                                    if c.generation == g], timeout=20)
            if gen > 1:
                gaps.append(time.monotonic() - exited_at)
            await h.publish_js(js, ev.subject_node_event(inst.node_id), ev.RanksExited(
                id=f"x{gen}", node_id=inst.node_id, job_id=job_id, generation=start[0].generation,
                exit_code=code, reason=reason, last_step=3, ts=time.time()))
            exited_at = time.monotonic()
            await h.wait_for(lambda g=gen: d.state.jobs[job_id].generation == g
                             and d.state.jobs[job_id].phase not in (JobPhase.STARTING, JobPhase.RUNNING))
            if d.state.jobs[job_id].phase == JobPhase.FAILED:
                break
            rc, out, err = await anyio.to_thread.run_sync(lambda: ctl(url, "jobs", "show", job_id, "-o", "json"))
            assert rc == 0, err
            shown.append(json.loads(out)["summary"])
        job = d.state.jobs[job_id]
        d.request_stop()
        tg.cancel_scope.cancel()
    await nc.close()
    return job, gaps, shown


async def test_storage_errors_hold_the_job_with_backoff_and_never_fail_it(server, tmp_path):
    rounds = 6  # more than max_restarts (3) + 1
    job, gaps, shown = await _run_generations(tmp_path, server, "storage_error", 76, rounds)
    assert job.phase != JobPhase.FAILED and job.failures == 0 and job.generation == rounds
    assert all(s["hold"]["reason"] == "storage_error" and s["hold"]["until"] > 0 for s in shown), shown
    assert [s["hold"]["holds"] for s in shown] == list(range(1, rounds + 1))
    assert len(gaps) == rounds - 1 and min(gaps) >= BASE_S  # never restarted before its backoff


async def test_an_early_exit_0_counts_and_fails_the_job_after_max_restarts(server, tmp_path):
    job, gaps, shown = await _run_generations(tmp_path, server, "completed", 0, 10)
    assert job.phase == JobPhase.FAILED and job.reason == "exited_early" and job.generation == 4
    assert [s["hold"]["reason"] for s in shown] == ["exited_early"] * 3 and min(gaps) >= BASE_S
