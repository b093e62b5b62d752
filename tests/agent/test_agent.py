"""The agent on a real nats-server with real rank processes (a contract-following fake trainer) and the
fake metadata service: notices, commands (fencing, dedup), checkpoint relay, heartbeats."""

from __future__ import annotations

import time

import anyio
import msgspec
import nats
import pytest

from agent.main import AgentConfig
from providers.local.metadata import MetadataServer
from tests.agent.helpers import ensure_events_stream, running_agent, send, start_cmd, stream_events, wait_for
from wire import (
    AbandonGenerationCmd,
    CheckpointCmd,
    CheckpointCommitted,
    GenerationStarted,
    Heartbeat,
    NodeId,
    NodeRegistered,
    PreemptionNotice,
    RanksExited,
    TrainerSpec,
    decode,
    subject_heartbeat,
)

pytestmark = pytest.mark.anyio


def _cfg(node: str, url: str, tmp, **kw) -> AgentConfig:
    return AgentConfig(node_id=node, nats_urls=(url,), work_dir=str(tmp / node), heartbeat_s=0.3, **kw)


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
async def test_notice_is_one_event_on_nats_within_a_second(cloud: str, nats_url: str, tmp_path) -> None:
    node = f"n-notice-{cloud}"

    nc = await nats.connect(nats_url)
    await ensure_events_stream(nc)
    seen: list[tuple[PreemptionNotice, float]] = []

    async def on_msg(msg) -> None:
        seen.append((decode(msg.data), time.monotonic()))

    await nc.subscribe(f"orch.notice.*.{node}", cb=on_msg)
    with MetadataServer() as md:
        async with running_agent(_cfg(node, nats_url, tmp_path, metadata=cloud, metadata_endpoint=md.url)):
            await anyio.sleep(0.5)
            if cloud == "aws":  # a rebalance recommendation first: reported, nothing else happens
                md.inject_rebalance()
                await wait_for(lambda: seen, timeout_s=1.0)
                assert seen.pop()[0].kind == "rebalance"
            t0 = time.monotonic()
            deadline = time.time() + 120
            md.inject_terminate(deadline)
            await wait_for(lambda: seen, timeout_s=1.0)
            await anyio.sleep(1.5)  # the watcher keeps polling: still one event
    assert len(seen) == 1
    notice, t = seen[0]
    assert t - t0 < 1.0
    assert notice.node_id == node and notice.cloud == cloud and notice.kind == "terminate"
    if cloud != "gcp":  # GCP's metadata has no deadline: observed + 30 s
        assert abs(notice.deadline_ts - int(deadline)) <= 1
    stored = [e for e in await stream_events(nc, node) if isinstance(e, PreemptionNotice)]
    assert len(stored) == (2 if cloud == "aws" else 1)
    await nc.close()


async def test_commands_fencing_dedup_checkpoint_relay(nats_url: str, tmp_path) -> None:
    nc = await nats.connect(nats_url)
    await ensure_events_stream(nc)
    hbs: list[Heartbeat] = []

    async def on_hb(msg) -> None:
        hbs.append(decode(msg.data))

    await nc.subscribe(subject_heartbeat("n-cmd"), cb=on_hb)
    async with running_agent(_cfg("n-cmd", nats_url, tmp_path)) as agent:
        start = start_cmd("n-cmd", token=5, ckpt=str(tmp_path / "ckpt"), step_time_s=0.05)
        ack1 = await send(nc, start)
        ack2 = await send(nc, start)  # a retry: same cmd_id, same answer, no second generation
        assert ack1.ok and ack2 == ack1
        await wait_for(lambda: agent.group is not None and agent.group.last_step >= 3)
        await wait_for(lambda: any(h.state == "training" and h.step > 0 and h.cpu_pct is not None for h in hbs))
        stale = CheckpointCmd(cmd_id="c-stale", fencing_token=4, node_id=NodeId("n-cmd"), job_id="j1",
                              generation=1, issued_ts=time.time(), reason="preemption_notice")
        ack = await send(nc, stale)
        assert not ack.ok and ack.error == "stale_fencing_token"
        assert agent.group.running and not agent.group.checkpoint_requested
        wrong_gen = AbandonGenerationCmd(cmd_id="a-1", fencing_token=5, node_id=NodeId("n-cmd"), job_id="j1",
                                         generation=7, issued_ts=time.time(), reason="test")
        assert (await send(nc, wrong_gen)).error == "unknown_generation"
        ck = CheckpointCmd(cmd_id="c-1", fencing_token=6, node_id=NodeId("n-cmd"), job_id="j1", generation=1,
                           issued_ts=time.time(), reason="preemption_notice", deadline_ts=time.time() + 30)
        assert (await send(nc, ck)).ok
        await wait_for(lambda: not agent.group.running)
        assert agent.group.result.reason == "emergency_checkpoint"
        await wait_for(lambda: any(h.fencing_token == 6 for h in hbs), timeout_s=3)
        await anyio.sleep(0.5)
    events = await stream_events(nc, "n-cmd")
    kinds = [type(e).__name__ for e in events]
    assert kinds.count("GenerationStarted") == 1
    assert kinds[0] == "NodeRegistered"
    commit = next(e for e in events if isinstance(e, CheckpointCommitted))
    exited = next(e for e in events if isinstance(e, RanksExited))
    assert commit.emergency and 20 < commit.deadline_margin_s <= 30
    assert exited.reason == "emergency_checkpoint" and exited.exit_code == 75 and exited.last_step == commit.step
    assert kinds.index("CheckpointCommitted") < kinds.index("RanksExited")
    await nc.close()


async def test_notice_triggers_local_checkpoint_and_azure_ack_after_commit(nats_url: str, tmp_path) -> None:
    """Azure: the node checkpoints on its own notice (no orchd needed) and acknowledges the event after."""

    nc = await nats.connect(nats_url)
    await ensure_events_stream(nc)
    with MetadataServer() as md:
        async with running_agent(_cfg("n-az", nats_url, tmp_path, metadata="azure", metadata_endpoint=md.url,
                                      metadata_poll_s=0.2)) as agent:
            assert (await send(nc, start_cmd("n-az", ckpt=str(tmp_path / "ck"), step_time_s=0.2))).ok
            await wait_for(lambda: agent.group.last_step >= 2)
            md.inject_terminate(time.time() + 30)
            await wait_for(lambda: not agent.group.running)
            await wait_for(lambda: md.acks, timeout_s=3)
            assert md.acks == [md.azure_event_id]
    events = await stream_events(nc, "n-az")
    kinds = [type(e).__name__ for e in events]
    assert "PreemptionNotice" in kinds and "CheckpointCommitted" in kinds
    assert next(e for e in events if isinstance(e, RanksExited)).reason == "emergency_checkpoint"
    await nc.close()


async def test_new_generation_resumes_and_abandon_kills(nats_url: str, tmp_path) -> None:
    nc = await nats.connect(nats_url)
    await ensure_events_stream(nc)
    ck = str(tmp_path / "ck")
    async with running_agent(_cfg("n-gen", nats_url, tmp_path)) as agent:
        assert (await send(nc, start_cmd("n-gen", ckpt=ck, generation=1, steps=5, step_time_s=0.02))).ok
        await wait_for(lambda: not agent.group.running)
        assert agent.group.result.reason == "completed"
        cmd2 = start_cmd("n-gen", ckpt=ck, generation=2, steps=10_000, resume=f"file://{ck}/step_000000005")
        assert (await send(nc, cmd2)).ok
        await wait_for(lambda: agent.group.last_step >= 7)
        pid = agent.group.ranks[0].proc.pid
        ab = AbandonGenerationCmd(cmd_id="ab-2", fencing_token=1, node_id=NodeId("n-gen"), job_id="j1",
                                  generation=2, issued_ts=time.time(), reason="peer_lost")
        assert (await send(nc, ab)).ok
        await wait_for(lambda: not agent.group.running, timeout_s=5)
        assert agent.group.result.reason == "abandoned"
        import os

        try:
            os.kill(pid, 0)
            alive = True
        except ProcessLookupError:
            alive = False
        assert not alive
    events = await stream_events(nc, "n-gen")
    starts = [e for e in events if isinstance(e, GenerationStarted)]
    assert [(s.generation, s.first_step) for s in starts] == [(1, 1), (2, 6)]
    assert [e.reason for e in events if isinstance(e, RanksExited)] == ["completed", "abandoned"]
    assert sum(isinstance(e, NodeRegistered) for e in events) == 1
    await nc.close()


async def test_rank_logs_are_shipped_and_read_back(nats_url: str, tmp_path) -> None:
    from orchestrator.cli.logs import read_logs

    nc = await nats.connect(nats_url)
    await ensure_events_stream(nc)
    async with running_agent(_cfg("n-logs", nats_url, tmp_path)) as agent:
        assert (await send(nc, start_cmd("n-logs", ckpt=str(tmp_path / "ck"), steps=3, step_time_s=0.01))).ok
        await wait_for(lambda: agent.group.done.is_set())
        await agent.logs.flush(2)
    lines: list[str] = []
    n = await read_logs([nats_url], "j1", node="n-logs", out=lines.append)
    assert n == len(lines) == 3  # two printed lines and the agent's progress line for step 1
    assert any(" g1 r0 | step 1/3 loss " in x for x in lines)
    assert "fake trainer rank 0/1 generation 1" in lines[0] or "fake trainer rank 0/1 generation 1" in lines[1]
    assert any(" r0 ! | a line on stderr" in x for x in lines)
    assert not any('{"orch":' in x for x in lines)  # report lines are parsed, not shipped as logs
    assert await read_logs([nats_url], "j1", node="nobody", out=lines.append) == 0
    # --follow: stored lines, then new ones as they are shipped
    followed: list[str] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: read_logs([nats_url], "j1", node="n-logs", follow=True, out=followed.append))
        await wait_for(lambda: len(followed) == 3)
        async with running_agent(_cfg("n-logs", nats_url, tmp_path)) as agent:
            cmd = start_cmd("n-logs", ckpt=str(tmp_path / "ck"), steps=3, step_time_s=0.01, generation=2)
            assert (await send(nc, cmd)).ok
            await wait_for(lambda: len(followed) == 6)
        tg.cancel_scope.cancel()
    assert any(" g2 r0 | fake trainer rank 0/1 generation 2" in x for x in followed)
    # a trainer that cannot be started is an error in the ack, not a crash of the agent
    async with running_agent(_cfg("n-bad", nats_url, tmp_path)) as agent:
        bad = msgspec.structs.replace(start_cmd("n-bad", ckpt=str(tmp_path / "ck")),
                                      trainer=TrainerSpec(command=("/nonexistent/trainer",)))
        ack = await send(nc, bad)
        assert not ack.ok and ack.error == "spawn_failed:FileNotFoundError"
        assert agent.state == "idle"
    await nc.close()


def test_outbox_bound_keeps_urgent_messages() -> None:
    from agent.outbox import Outbox

    box = Outbox(js=None, max_items=3)  # put() never touches the server
    box.put("s", b"n", "notice-1", urgent=True)
    for i in range(4):
        box.put("s", b"e", f"ev-{i}")
    assert len(box) == 3 and box.dropped == 2
    assert [p.msg_id for p in box._q] == ["notice-1", "ev-2", "ev-3"]


def test_rank_environment_has_no_agent_secrets(tmp_path, monkeypatch) -> None:
    from agent.ranks import RankGroup

    monkeypatch.setenv("ORCH_AGENT_NATS_PASSWORD", "s3cret")
    monkeypatch.setenv("NOTIFY_SOCKET", "@x")
    monkeypatch.setenv("SOME_USER_VAR", "kept")
    g = RankGroup(cmd=start_cmd("n", ckpt=str(tmp_path), extra={"k": 1}), work_dir=tmp_path,
                  on_report=lambda rank, report: None, on_log=lambda rank, stream, line: None)
    from agent.ranks import _Rank

    env = g._env(_Rank(rank=0, local_rank=0))
    assert "ORCH_AGENT_NATS_PASSWORD" not in env and "NOTIFY_SOCKET" not in env
    assert env["SOME_USER_VAR"] == "kept" and env["RANK"] == "0"
    assert env["ORCH_TRAINER_ARGS"] == '{"step_time_s": 0.05, "k": 1}'
