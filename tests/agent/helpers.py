"""Helpers for agent tests: streams as orchd creates them, an in-process agent, commands, collectors."""

from __future__ import annotations

import contextlib
import sys
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import nats
from nats.js.api import StreamConfig

from agent.main import Agent, AgentConfig
from wire import (
    CommandAck,
    NodeId,
    StartGenerationCmd,
    TrainerSpec,
    decode,
    encode,
    subject_command,
)

FAKE_TRAINER = str(Path(__file__).with_name("fake_trainer.py"))
EVENTS_STREAM = "ORCH_EVENTS_TEST"


async def ensure_events_stream(nc: nats.NATS) -> None:
    js = nc.jetstream()
    with contextlib.suppress(Exception):  # any failure: the stream exists already (module-scoped server)
        await js.add_stream(StreamConfig(name=EVENTS_STREAM, subjects=["orch.node.*.event", "orch.notice.>"],
                                         duplicate_window=120))


async def stream_events(nc: nats.NATS, node: str) -> list:
    """Every event stored in the stream for this node (notices and node events), decoded, in order."""
    js = nc.jetstream()
    out = []
    for subj in (f"orch.node.{node}.event", f"orch.notice.*.{node}"):
        sub = await js.subscribe(subj, ordered_consumer=True)
        while True:
            try:
                msg = await sub.next_msg(timeout=0.3)
            except nats.errors.TimeoutError:
                break
            out.append(decode(msg.data))
        await sub.unsubscribe()
    return sorted(out, key=lambda e: getattr(e, "ts", getattr(e, "observed_ts", 0.0)))


def start_cmd(node: str, *, cmd_id: str | None = None, token: int = 1, generation: int = 1, steps: int = 10_000,
              step_time_s: float = 0.05, ckpt: str, resume: str | None = None, gpus: int = 1, extra: dict | None = None
              ) -> StartGenerationCmd:
    return StartGenerationCmd(
        cmd_id=cmd_id or uuid.uuid4().hex, fencing_token=token, node_id=NodeId(node), job_id="j1",
        generation=generation, issued_ts=time.time(), node_rank=0, nnodes=1, gpus_per_node=gpus, world_size=gpus,
        master_addr="127.0.0.1", master_port=29500, resume_from=resume, checkpoint_url=f"file://{ckpt}",
        total_steps=steps,
        trainer=TrainerSpec(command=(sys.executable, FAKE_TRAINER), args={"step_time_s": step_time_s, **(extra or {})}))


async def send(nc: nats.NATS, cmd) -> CommandAck:
    """Request/reply like orchd's executor: a NoResponders answer is retried (same cmd_id) briefly."""
    for attempt in range(10):
        try:
            resp = await nc.request(subject_command(cmd.node_id), encode(cmd), timeout=5)
            return decode(resp.data, CommandAck)
        except nats.errors.NoRespondersError:
            if attempt == 9:
                raise
            await anyio.sleep(0.2)
    raise AssertionError("unreachable")


@asynccontextmanager
async def running_agent(cfg: AgentConfig):
    agent = Agent(cfg)
    async with anyio.create_task_group() as tg:
        await tg.start(agent.run)
        try:
            yield agent
        finally:
            agent.request_shutdown("test_end")
            with anyio.move_on_after(15):
                await agent.stopped.wait()
            tg.cancel_scope.cancel()


async def wait_for(pred, timeout_s: float = 10.0, every_s: float = 0.05):
    with anyio.fail_after(timeout_s):
        while True:
            v = pred()
            if v:
                return v
            await anyio.sleep(every_s)
