"""Simulated agents: NATS clients that behave like orch-agent at the wire, without trainer processes.

Role: for every live instance in the fake cloud's file a simulated node boots (``NodeRegistered``),
heartbeats every ``hb_s``, and answers ``orch.cmd.<node>`` like orch-agent does: de-duplicates by
``cmd_id`` (a retry gets the first answer), refuses stale fencing tokens, and

    start_generation    trains from the resumed step at ``step_s`` per step (``GenerationStarted``);
                        at ``total_steps``: ``RanksExited(completed)``
    checkpoint / stop   the generation's members agree on one step (max of theirs + 1), each reports
                        ``CheckpointCommitted`` then ``RanksExited(emergency_checkpoint|stopped)``
    abandon_generation  ``RanksExited(abandoned)``
    drain               ``NodeLeaving``, heartbeats stop

An instance that is terminated in the cloud (the file) stops heartbeating: the VM is gone. Events are
published in order through one queue with ``Nats-Msg-Id`` = event id, retried with the same id until the
stream acknowledges them (so a NATS outage loses nothing and duplicates nothing). ``garbage_replies``
makes the first N answers to each command hostile (the fuzzer's "command replies" subject).

Concurrency contract: everything on the caller's asyncio loop (nats-py); ``run`` until cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec

import wire as ev
from agent.commands import AckCache
from simulations.fakecloud import read_fake_file
from trainer import contract

GARBAGE_REPLIES = (b"", b"{", b"null", b'{"type":"command_ack","v":9,"cmd_id":"x","node_id":"n","ok":true,"ts":1}',
                   b'{"type":"command_ack","v":1,"cmd_id":7,"node_id":"n","ok":"yes","ts":1}',
                   b'{"type":"surprise","v":1}')
"""Hostile answers to a command; the last kind (a well-formed ack for another cmd_id) is built per command."""


@dataclass
class SimNode:
    node_id: str
    instance_id: str
    pool: ev.PoolKey
    seq: int = 0
    fencing: int = 0
    job_id: str | None = None
    generation: int = 0
    first_step: int = 0
    t0: float = 0.0
    total_steps: int = 0
    checkpoint_url: str = ""
    training: bool = False
    alive: bool = True
    acks: AckCache = field(default_factory=AckCache)  # orch-agent's
    garbage_sent: dict[str, int] = field(default_factory=dict)

    def step(self, now: float, step_s: float) -> int:
        if not self.training:
            return self.first_step
        return min(self.total_steps, self.first_step + int((now - self.t0) / step_s))


class SimFleet:
    def __init__(self, nc: Any, fake_file: Path, *, step_s: float = 0.05, hb_s: float = 0.5,
                 garbage_replies: int = 0, sampler: Any = None, only: frozenset[str] | None = None) -> None:
        self.nc = nc
        self.only = only  # these instance ids only (one simulated host per process: partitions.py)
        self.sampler = sampler  # an agent.heartbeat.SystemSampler: its GPU readings go in every heartbeat
        self.js = nc.jetstream(timeout=2.0)
        self.fake_file = fake_file
        self.step_s = step_s
        self.hb_s = hb_s
        self.garbage_replies = garbage_replies
        self.nodes: dict[str, SimNode] = {}
        self.commands: list[tuple[float, Any]] = []  # (arrival, command) of first deliveries
        self.events: list[Any] = []  # every event handed to the publisher
        self.garbage_total = 0
        self.cmd_id_reused = 0  # a known cmd_id naming another command: executed as new, as orch-agent does
        self._agreed: dict[tuple[str, int], int] = {}  # (job, generation) -> checkpoint step
        self._queue: asyncio.Queue = asyncio.Queue()
        self._published = 0
        self._ids = itertools.count(1)

    # --- observations for the drills -----------------------------------------------------------

    def of_kind(self, cls: type, since: float = 0.0) -> list[Any]:
        return [c for t, c in self.commands if isinstance(c, cls) and t >= since]

    def events_of(self, cls: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, cls)]

    def idle(self) -> bool:
        """Every event handed over has been stored by the stream."""
        return self._queue.empty() and self._published == len(self.events)

    # --- running ---------------------------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        sub = await self.nc.subscribe("orch.cmd.>", cb=self._on_cmd)
        await self.nc.flush()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._publisher)
                tg.start_soon(self._watch_cloud)
                tg.start_soon(self._heartbeats)
                task_status.started()
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await sub.unsubscribe()

    def _emit(self, event: Any) -> None:
        self.events.append(event)
        self._queue.put_nowait(event)

    async def _publisher(self) -> None:
        while True:
            event = await self._queue.get()
            subject = (ev.subject_notice("fake", event.node_id) if isinstance(event, ev.PreemptionNotice)
                       else ev.subject_node_event(event.node_id))
            data = ev.encode(event)
            while True:  # same Nats-Msg-Id on every try: stored exactly once
                try:
                    await self.js.publish(subject, data, headers={"Nats-Msg-Id": event.id})
                    break
                except Exception:
                    await anyio.sleep(0.1)
            self._published += 1

    def publish_notice(self, node_id: str, deadline_s: float = 120.0) -> ev.PreemptionNotice:
        now = time.time()
        n = ev.PreemptionNotice(id=f"notice-{node_id}-{next(self._ids)}", node_id=ev.NodeId(node_id), cloud="fake",
                                deadline_ts=now + deadline_s, observed_ts=now)
        self._emit(n)
        return n

    async def _watch_cloud(self) -> None:
        while True:
            try:
                insts = read_fake_file(self.fake_file)
            except (OSError, ValueError):
                insts = []
            for inst in insts:
                if self.only is not None and inst.instance_id not in self.only:
                    continue
                node = self.nodes.get(str(inst.node_id))
                if inst.alive and node is None and inst.node_id:
                    node = self.nodes[str(inst.node_id)] = SimNode(str(inst.node_id), inst.instance_id, inst.pool)
                    self._emit(ev.NodeRegistered(id=f"reg-{inst.node_id}-{inst.instance_id}", node_id=inst.node_id,
                                                 instance_id=inst.instance_id, pool=inst.pool, agent_version="sim",
                                                 host="127.0.0.1", ts=time.time()))
                elif node is not None and not inst.alive and node.instance_id == inst.instance_id:
                    node.alive = False  # the VM is gone: no more heartbeats
            await anyio.sleep(0.1)

    async def _heartbeats(self) -> None:
        while True:
            now = time.time()
            for node in list(self.nodes.values()):
                if not node.alive:
                    continue
                step = node.step(now, self.step_s)
                if node.training and step >= node.total_steps:
                    self._exit(node, "completed", 0, step)
                node.seq += 1
                hb = ev.Heartbeat(node_id=ev.NodeId(node.node_id), seq=node.seq, ts=now,
                                  state=ev.AgentState.TRAINING if node.training else ev.AgentState.IDLE,
                                  job_id=ev.JobId(node.job_id) if node.job_id else None, generation=node.generation,
                                  step=step, loss=self._loss(node, step) if node.training else None,
                                  fencing_token=node.fencing,
                                  gpus=self.sampler.gpus() if self.sampler is not None else ())
                with contextlib.suppress(Exception):  # disconnected: a lost heartbeat only delays liveness
                    await self.nc.publish(ev.subject_heartbeat(node.node_id), ev.encode(hb))
            await anyio.sleep(self.hb_s)

    # --- commands --------------------------------------------------------------------------------

    async def _on_cmd(self, msg: Any) -> None:
        try:
            cmd = ev.decode(msg.data, ev.AgentCommand)
        except ev.WireError:
            return
        node = self.nodes.get(cmd.node_id)
        if node is None or not node.alive or not msg.reply:
            return  # no such VM (any more): no answer, like a dead host
        sent = node.garbage_sent.get(cmd.cmd_id, 0)
        if sent < self.garbage_replies:
            node.garbage_sent[cmd.cmd_id] = sent + 1
            self.garbage_total += 1
            choice = (len(node.garbage_sent) + sent) % (len(GARBAGE_REPLIES) + 1)
            other = ev.CommandAck(cmd_id=cmd.cmd_id + "-other", node_id=cmd.node_id, ok=True, ts=time.time())
            data = GARBAGE_REPLIES[choice] if choice < len(GARBAGE_REPLIES) else ev.encode(other)
            await msg.respond(data)
            return
        cached = node.acks.get(cmd)
        if cached is not None:
            node.fencing = max(node.fencing, cmd.fencing_token)
        else:
            self.cmd_id_reused += bool(node.acks.named(cmd.cmd_id))
            self.commands.append((time.time(), cmd))
            if cmd.fencing_token < node.fencing:
                error: str | None = "stale_fencing_token"
            else:
                node.fencing = cmd.fencing_token
                error = self._execute(node, cmd)
            cached = ev.CommandAck(cmd_id=cmd.cmd_id, node_id=cmd.node_id, ok=error is None, error=error,
                                   ts=time.time())
            node.acks.put(cmd, cached)
        with contextlib.suppress(Exception):
            await msg.respond(ev.encode(cached))

    def _execute(self, node: SimNode, cmd: Any) -> str | None:
        now = time.time()
        match cmd:
            case ev.StartGenerationCmd():
                if node.job_id == cmd.job_id and node.generation == cmd.generation and node.training:
                    return None
                if node.training:
                    self._exit(node, "abandoned", -9, node.step(now, self.step_s))
                first = 0
                if cmd.resume_from:
                    name = cmd.resume_from.rstrip("/").rsplit("/", 1)[-1]
                    first = int(name[5:]) + 1 if name.startswith("step_") and name[5:].isdigit() else 0
                node.job_id, node.generation, node.first_step, node.t0 = cmd.job_id, cmd.generation, first, now
                node.total_steps, node.checkpoint_url, node.training = cmd.total_steps, cmd.checkpoint_url, True
                self._emit(ev.GenerationStarted(id=f"gen-{cmd.job_id}-{cmd.generation}-{node.node_id}",
                                                node_id=ev.NodeId(node.node_id), job_id=ev.JobId(str(cmd.job_id)),
                                                generation=cmd.generation, first_step=first, ts=now))
                return None
            case ev.CheckpointCmd() | ev.StopCmd():
                if not node.training or (cmd.job_id and cmd.job_id != node.job_id) or (
                        cmd.generation and cmd.generation != node.generation):
                    return "unknown_generation" if isinstance(cmd, ev.CheckpointCmd) else None
                if isinstance(cmd, ev.StopCmd) and not cmd.checkpoint_first:
                    self._exit(node, "stopped", contract.EXIT_PREEMPTED, node.step(now, self.step_s))
                    return None
                key = (str(node.job_id), node.generation)
                if key not in self._agreed:  # the ranks' MAX all-reduce: everyone stops at one step
                    members = [n for n in self.nodes.values() if n.training and (n.job_id, n.generation) == key]
                    self._agreed[key] = min(node.total_steps, max(n.step(now, self.step_s) for n in members) + 1)
                step = self._agreed[key]
                cid = f"step_{step:09d}"
                deadline = getattr(cmd, "deadline_ts", None)  # a CheckpointCmd's; a StopCmd has none
                self._emit(ev.CheckpointCommitted(
                    id=f"ckpt-{node.job_id}-{node.generation}-{cid}-{node.node_id}", node_id=ev.NodeId(node.node_id),
                    job_id=ev.JobId(str(node.job_id)), generation=node.generation, step=step, checkpoint_id=cid,
                    url=f"{node.checkpoint_url.rstrip('/')}/{cid}", save_s=0.2,
                    deadline_margin_s=(deadline - now - 0.2) if deadline else None,
                    emergency=getattr(cmd, "reason", "") == "preemption_notice", ts=now))
                self._exit(node, "stopped" if isinstance(cmd, ev.StopCmd) else "emergency_checkpoint",
                           contract.EXIT_PREEMPTED, step)
                return None
            case ev.AbandonGenerationCmd():
                if node.training and (not cmd.generation or cmd.generation == node.generation):
                    self._exit(node, "abandoned", -9, node.step(now, self.step_s))
                return None
            case ev.DrainCmd():
                self._emit(ev.NodeLeaving(id=f"leave-{node.node_id}", node_id=ev.NodeId(node.node_id),
                                          reason=f"drain:{cmd.reason}", ts=now))
                node.alive = False
                return None
        return "unknown_command"

    def _loss(self, node: SimNode, step: int) -> float | None:
        """The loss a node reports at ``step`` (heartbeats, exits): none here; a subclass may model one."""
        return None

    def _exit(self, node: SimNode, reason: str, code: int, last_step: int) -> None:
        node.training = False
        node.first_step = last_step
        loss = self._loss(node, last_step)
        self._emit(ev.RanksExited(id=f"exit-{node.job_id}-{node.generation}-{node.node_id}",
                                  node_id=ev.NodeId(node.node_id), job_id=ev.JobId(str(node.job_id)),
                                  generation=node.generation, exit_code=code, reason=reason, last_step=last_step,
                                  ts=time.time(), last_loss=msgspec.UNSET if loss is None else loss))


