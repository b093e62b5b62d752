"""The agent across a NATS outage (the real server stopped and restarted on the same port and store):
training goes on, a notice during the outage still checkpoints the ranks, and every buffered event
reaches the stream exactly once after reconnecting. And ``orch-agent`` as a process: SIGTERM ->
checkpoint, NodeLeaving, exit 0."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import anyio
import nats
import pytest

from agent.main import AgentConfig
from orchestrator.natsserver import NatsServer
from providers.local.metadata import MetadataServer
from tests.agent.helpers import ensure_events_stream, running_agent, send, start_cmd, stream_events, wait_for
from wire import (
    CheckpointCommitted,
    RanksExited,
)

pytestmark = pytest.mark.anyio


async def test_outage_buffers_events_and_training_continues(nats_server: NatsServer, tmp_path) -> None:
    nc = await nats.connect(nats_server.url)
    await ensure_events_stream(nc)
    await nc.close()
    with MetadataServer() as md:
        cfg = AgentConfig(node_id="n-out", nats_urls=(nats_server.url,), work_dir=str(tmp_path / "n-out"),
                          heartbeat_s=0.3, metadata="aws", metadata_endpoint=md.url)
        async with running_agent(cfg) as agent:
            nc = await nats.connect(nats_server.url)
            assert (await send(nc, start_cmd("n-out", ckpt=str(tmp_path / "ck"), step_time_s=0.05))).ok
            await nc.close()
            await wait_for(lambda: agent.group.last_step >= 3)
            nats_server.stop()
            t_down = time.time()
            await wait_for(lambda: not agent.nc.is_connected, timeout_s=5)
            step_at_outage = agent.group.last_step
            await anyio.sleep(0.5)
            md.inject_terminate(time.time() + 60)  # the cloud's notice arrives while NATS is down
            await wait_for(lambda: not agent.group.running, timeout_s=10)
            assert agent.group.last_step > step_at_outage  # kept training while disconnected
            assert agent.group.result.reason == "emergency_checkpoint"
            assert len(agent.outbox) >= 3  # notice, generation started (maybe), commit, exited
            t_up = time.time()
            nats_server.restart()
            await wait_for(lambda: agent.nc.is_connected, timeout_s=10)
            assert await agent.outbox.flush(10)
    nc = await nats.connect(nats_server.url)
    events = await stream_events(nc, "n-out")
    await nc.close()
    by_kind: dict[str, list] = {}
    for e in events:
        by_kind.setdefault(type(e).__name__, []).append(e)
    assert len(by_kind["PreemptionNotice"]) == 1
    assert len(by_kind["GenerationStarted"]) == 1
    assert len(by_kind["CheckpointCommitted"]) == 1
    assert len(by_kind["RanksExited"]) == 1
    commit = by_kind["CheckpointCommitted"][0]
    assert t_down < commit.ts < t_up and commit.emergency
    assert by_kind["RanksExited"][0].reason == "emergency_checkpoint"


async def test_orch_agent_process_exits_cleanly_on_sigterm_after_checkpoint(nats_server: NatsServer, tmp_path) -> None:
    nc = await nats.connect(nats_server.url)
    await ensure_events_stream(nc)
    registered = anyio.Event()

    async def on_event(msg) -> None:
        if b"node_registered" in msg.data:
            registered.set()

    await nc.subscribe("orch.node.n-term.event", cb=on_event)
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.main", "--node-id", "n-term", "--nats-url", nats_server.url,
         "--work-dir", str(tmp_path / "w"), "--heartbeat-s", "0.5", "--sigterm-grace-s", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with anyio.fail_after(20):
            await registered.wait()
        assert (await send(nc, start_cmd("n-term", ckpt=str(tmp_path / "ck"), step_time_s=0.05))).ok
        steps_file = tmp_path / "w" / "steps" / "j1.jsonl"
        await wait_for(lambda: steps_file.exists() and len(steps_file.read_text().splitlines()) >= 3)
        proc.send_signal(signal.SIGTERM)
        code = await anyio.to_thread.run_sync(proc.wait, 20)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read()
    assert code == 0, out
    events = await stream_events(nc, "n-term")
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "NodeRegistered" and kinds[-1] == "NodeLeaving", kinds
    commit = next(e for e in events if isinstance(e, CheckpointCommitted))
    assert commit.emergency
    exited = next(e for e in events if isinstance(e, RanksExited))
    assert exited.exit_code == 75
    # the step log ends at the committed step: nothing ran after the checkpoint
    last = json.loads(steps_file.read_text().splitlines()[-1])
    assert last["step"] == commit.step
    # the log lines were kept locally as well
    assert (tmp_path / "w" / "logs" / "j1" / "gen1-rank0.log").read_text().count("fake trainer") == 1
    await nc.close()



async def test_no_goodbye_after_the_job_completed_here(nats_server: NatsServer, tmp_path) -> None:
    """orchd releases a node once its job completed and forgets it: a NodeLeaving then would only be
    refused as unknown_node (a line in `orchctl events` after every normal completion). A node that leaves
    before completion still says so."""
    nc = await nats.connect(nats_server.url)
    await ensure_events_stream(nc)
    cfg = AgentConfig(node_id="n-done", nats_urls=(nats_server.url,), work_dir=str(tmp_path / "n-done"),
                      heartbeat_s=0.3)
    async with running_agent(cfg) as agent:
        assert (await send(nc, start_cmd("n-done", ckpt=str(tmp_path / "ck"), steps=3, step_time_s=0.02))).ok
        await wait_for(lambda: agent.generations.job_completed, timeout_s=20)
    events = await stream_events(nc, "n-done")
    kinds = [type(e).__name__ for e in events]
    assert "NodeLeaving" not in kinds, kinds
    assert next(e for e in events if isinstance(e, RanksExited)).reason == "completed"
    cfg = AgentConfig(node_id="n-mid", nats_urls=(nats_server.url,), work_dir=str(tmp_path / "n-mid"), heartbeat_s=0.3)
    async with running_agent(cfg) as agent:
        assert (await send(nc, start_cmd("n-mid", ckpt=str(tmp_path / "ck2"), step_time_s=0.05))).ok
        await wait_for(lambda: agent.group is not None and agent.group.last_step >= 2, timeout_s=20)
    kinds = [type(e).__name__ for e in await stream_events(nc, "n-mid")]
    assert kinds[-1] == "NodeLeaving", kinds
    await nc.close()
