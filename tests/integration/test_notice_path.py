"""The path of a notice's decision through orchd's shell: nothing older overwrites it, its commands go out
first, and the heartbeat fast path admits exactly what the one-by-one path admits.

- A liveness flush slice (``Daemon._write_liveness``, off the decide loop) runs while a batch is being
  persisted: it must not write the batch's dirty keys from the older state, or the batch's newer record
  (a noticed node's) would be overwritten in KV and lost on a restart. Real nats-server, real ``Store``.
- ``Store.persist`` hands over (``after_outbox``: the daemon dispatches there) once the commands are in
  the outbox, before the records are written.
- A liveness slice's background write lets the event loop run between its records.
- ``pipeline.dispatch`` hands checkpoint commands to the executor before other agent commands and cloud
  calls.
- ``admit.admit_heartbeats`` (the batched hot path) gives the same events and the same rejections as
  ``admit_batch(..., admit_heartbeat)`` over valid, hostile and malformed heartbeats.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
import nats
import pytest
from nats.js.errors import KeyNotFoundError

import wire as ev
from orchestrator import bus
from orchestrator.core.commands import Command, Launch, SendToAgent, Terminate
from orchestrator.core.inputs import Tick
from orchestrator.core.state import Decision, State
from orchestrator.daemon import admit, pipeline, records
from orchestrator.daemon.coreapi import CoreApi
from orchestrator.daemon.executor import Executor
from orchestrator.daemon.loop import Daemon
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.records import Batch, ShellItem, encode_command, outbox_key
from orchestrator.daemon.store import BACKGROUND_YIELD_EVERY, Store
from orchestrator.settings import Settings
from simulations.chaos.fuzz import Generator

POOL = ev.PoolKey(cloud="fake", region="r1", zone="r1a", instance_type="gpu.a", market=ev.Market.SPOT)


def _records_core() -> CoreApi:
    """A stand-in core whose state is a dict of records (the daemon only encodes records here)."""
    return CoreApi(decide=lambda s, e, now: None,  # type: ignore[arg-type,return-value]
                   state_to_records=lambda state, keys: {k: state[k] for k in keys},  # type: ignore[index]
                   state_from_records=dict, empty_state=dict)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_liveness_slice_never_writes_a_key_of_the_batch_being_persisted(nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        topo = await bus.ensure_topology(nc)
        d = Daemon(Settings(), {}, _records_core(), Metrics())
        d.store = Store(topo, writer=nc)
        d.executor = Executor(d.settings, {}, nc, lambda r: None, d.metrics)  # never started: nothing to execute
        d.state = {"node.a": b"a-before-the-notice", "node.b": b"b-liveness"}  # type: ignore[assignment]
        # The notice's batch decided node.a anew and is writing it; meanwhile a slice of a liveness round
        # holding node.a and node.b runs from the state before the batch.
        await topo.state_kv.put("node.a", b"a-noticed")  # the batch's write
        d._persisting = {"node.a"}
        await d._write_liveness({"node.a", "node.b"})
        assert (await topo.state_kv.get("node.a")).value == b"a-noticed"  # not overwritten by the older value
        assert (await topo.state_kv.get("node.b")).value == b"b-liveness"
        # Once the batch is persisted the daemon's state is the batch's: a later slice writes its value.
        d._persisting = frozenset()
        d.state = {"node.a": b"a-noticed-then-heartbeat", "node.b": b"b-liveness"}  # type: ignore[assignment]
        await d._write_liveness({"node.a"})
        assert (await topo.state_kv.get("node.a")).value == b"a-noticed-then-heartbeat"
    finally:
        await nc.close()


@pytest.mark.anyio
async def test_commands_go_out_once_in_the_outbox_before_the_records_are_written(nats_server) -> None:
    """``Store.persist`` runs ``after_outbox`` (where the daemon dispatches) once the outbox puts are stored
    and before the records are written: a notice's checkpoint command does not wait for the records'
    round trip (a crash in between re-executes it from the outbox with the same ids)."""
    nc = await nats.connect(nats_server.url)
    try:
        topo = await bus.ensure_topology(nc)
        store = Store(topo, writer=nc)
        cmd = SendToAgent(command=ev.CheckpointCmd(cmd_id="c-1", node_id=ev.NodeId("n1"), job_id=ev.JobId("j1"),
                                                   generation=1, fencing_token=1, issued_ts=1.0,
                                                   reason="preemption_notice"))
        key = outbox_key(cmd)
        seen: list[tuple[bytes | None, bool]] = []

        async def after_outbox() -> None:
            outbox = (await topo.outbox_kv.get(key)).value
            try:
                await topo.state_kv.get("node.n1")
                record = True
            except KeyNotFoundError:
                record = False
            seen.append((outbox, record))

        await store.persist({"node.n1": b"noticed"}, {key: cmd}, after_outbox=after_outbox)
        assert seen == [(encode_command(cmd), False)]  # the command stored, the record not yet
        assert (await topo.state_kv.get("node.n1")).value == b"noticed"  # and then the record
    finally:
        await nc.close()


@pytest.mark.anyio
async def test_a_liveness_write_lets_the_decide_loop_run_between_its_records(nats_server) -> None:
    """A background write of a liveness slice yields to the event loop every ``BACKGROUND_YIELD_EVERY``
    records: a notice that arrives meanwhile is not held for the whole slice's encodes and publishes."""
    nc = await nats.connect(nats_server.url)
    try:
        store = Store(await bus.ensure_topology(nc), writer=nc)
        ran = 0
        seen: list[int] = []  # how often the other task had run when each record was encoded

        async def other() -> None:
            nonlocal ran
            while True:
                ran += 1
                await anyio.sleep(0)

        def encode(keys: tuple[str, ...]) -> dict[str, bytes]:
            seen.append(ran)
            return {k: b"alive" for k in keys}

        n = 4 * BACKGROUND_YIELD_EVERY
        async with anyio.create_task_group() as tg:
            tg.start_soon(other)
            await anyio.sleep(0)
            await store.write_records_background({f"node.n{i:03d}" for i in range(n)}, encode)
            tg.cancel_scope.cancel()
        assert len(seen) == n
        assert len(set(seen)) >= 4  # the other task ran between the slice's records
    finally:
        await nc.close()


@dataclass
class _Recorder:
    """What an executor is handed, in order (``pipeline.dispatch`` calls only ``submit_all``)."""

    submitted: list[Command] = field(default_factory=list)

    def submit_all(self, commands: list[tuple[str, Command, float | None]]) -> None:
        for key, cmd, notice_ts in commands:
            self.submit(key, cmd, notice_ts=notice_ts)

    def submit(self, key: str, cmd: Command, *, notice_ts: float | None = None) -> None:
        self.submitted.append(cmd)


def test_dispatch_hands_out_checkpoint_commands_first() -> None:
    job, node = ev.JobId("j1"), ev.NodeId("n1")
    launch = Launch(job_id=job, pool=POOL, node_ids=(ev.NodeId("n9"),), token="t1")
    stop = SendToAgent(command=ev.StopCmd(cmd_id="c-stop", node_id=node, job_id=job, generation=1, fencing_token=1,
                                          issued_ts=1.0, reason="test"))
    ckpt = [SendToAgent(command=ev.CheckpointCmd(cmd_id=f"c-{i}", node_id=ev.NodeId(f"n{i}"), job_id=job,
                                                 generation=1, fencing_token=1, issued_ts=1.0,
                                                 reason="preemption_notice"))
            for i in range(3)]
    term = Terminate(node_id=node, instance_id=None, reason="test")
    decided = records.Decided(state=None)  # type: ignore[arg-type]
    for i, c in enumerate([launch, stop, ckpt[0], term, ckpt[1], ckpt[2]]):
        decided.commands[f"k{i}"] = c
    rec = _Recorder()
    assert (early := pipeline.dispatch_checkpoints(decided, rec))  # type: ignore[arg-type]
    assert rec.submitted == ckpt  # in decision order
    pipeline.dispatch(decided, rec, early)  # type: ignore[arg-type]
    assert rec.submitted == [*ckpt, stop, launch, term]  # then the other agent commands, then cloud calls
    assert not pipeline.dispatch_checkpoints(records.Decided(state=None), rec)  # type: ignore[arg-type]


class _OrderedStore(Store):
    """The real store, noting when each pipelined write of a batch begins."""

    def __init__(self, *args: Any, order: list[str], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.order = order

    async def _write(self, items: list[Any]) -> None:
        self.order.append("write outbox" if items[0][0].startswith(f"$KV.{bus.KV_OUTBOX}.") else "write records")
        await super()._write(items)


@dataclass
class _OrderedExecutor:
    order: list[str]

    def submit_all(self, commands: list[tuple[str, Command, float | None]]) -> None:
        for key, cmd, notice_ts in commands:
            self.submit(key, cmd, notice_ts=notice_ts)

    def submit(self, key: str, cmd: Command, *, notice_ts: float | None = None) -> None:
        kind = type(cmd.command).__name__ if isinstance(cmd, SendToAgent) else type(cmd).__name__
        self.order.append(f"submit {kind}")

    def may_act(self) -> bool:
        return True


@pytest.mark.anyio
async def test_a_checkpoint_command_leaves_before_the_outbox_round_trip_and_the_rest_after_it(nats_server) -> None:
    """``Daemon.process``: a batch's checkpoint commands are handed out before its outbox is written; its
    other commands once they are in the outbox, and its records after that."""
    job, node = ev.JobId("j1"), ev.NodeId("n1")
    commands = (Launch(job_id=job, pool=POOL, node_ids=(ev.NodeId("n9"),), token="t1"),
                SendToAgent(command=ev.CheckpointCmd(cmd_id="c-1", node_id=node, job_id=job, generation=1,
                                                     fencing_token=1, issued_ts=1.0, reason="preemption_notice")),
                SendToAgent(command=ev.StopCmd(cmd_id="c-2", node_id=ev.NodeId("n2"), job_id=job, generation=1,
                                               fencing_token=1, issued_ts=1.0, reason="test")))

    def decide(state: Any, event: Any, now: float) -> Decision:
        return Decision(state=state, commands=commands, audit=(), dirty=frozenset({"node.n1"}))

    order: list[str] = []
    nc = await nats.connect(nats_server.url)
    try:
        core = dataclasses.replace(_records_core(), decide=decide,
                                   state_to_records=lambda state, keys: dict.fromkeys(keys, b"noticed"))
        d = Daemon(Settings(), {}, core, Metrics())
        d.store = _OrderedStore(await bus.ensure_topology(nc), writer=nc, order=order)
        d.executor = _OrderedExecutor(order)  # type: ignore[assignment]
        d.state = State.empty()  # the observer reads it after the batch
        await d.process(Batch([], [], [ShellItem(Tick())]), urgent=True)
    finally:
        await nc.close()
    assert order == ["submit CheckpointCmd", "write outbox", "submit StopCmd", "submit Launch", "write records"]


def _hb(node: str, **kw: Any) -> ev.Heartbeat:
    base: dict[str, Any] = dict(node_id=ev.NodeId(node), seq=1, ts=1.0, state=ev.AgentState.TRAINING,
                                job_id=ev.JobId("j1"), generation=1, step=5, loss=2.0, tokens_per_s=1.0,
                                step_time_s=1.0, fencing_token=0)
    base.update(kw)
    return ev.Heartbeat(**base)


@dataclass
class _Msg:
    subject: str
    data: bytes


def test_the_heartbeat_fast_path_admits_exactly_what_the_one_by_one_path_admits() -> None:
    msgs = [_Msg(ev.subject_heartbeat("n1"), ev.encode(_hb("n1"))),
            _Msg(ev.subject_heartbeat("n2"), ev.encode(_hb("n1"))),  # another node's subject
            _Msg(ev.subject_heartbeat("n3"), ev.encode(_hb("n3", step=-1))),
            _Msg(ev.subject_heartbeat("n4"), ev.encode(_hb("n4", step_time_s=float("nan")))),
            _Msg(ev.subject_heartbeat("n5"), b"{not json"),
            _Msg(ev.subject_heartbeat("n6"), b'{"type": "heartbeat"}'),
            _Msg(ev.subject_heartbeat("n7"), b"[" * 5000),
            _Msg(ev.subject_heartbeat("n8"), ev.encode(_hb("n8")).replace(b'"v":1', b'"v":99')),
            _Msg(ev.subject_heartbeat("n9"), b" " * (ev.MAX_MESSAGE_BYTES + 1)),
            _Msg(ev.subject_heartbeat("n10"), ev.encode(_hb("n10", gpus=())))]
    g = Generator(random.Random(5), "j1", ["n1", "n2"])
    while len(msgs) < 3000:  # the chaos drill's hostile heartbeats
        shot = g.next()
        if shot.target == "heartbeat":
            msgs.append(_Msg(shot.subject, shot.data))
    fast = admit.admit_heartbeats(msgs)  # type: ignore[arg-type]
    slow = admit.admit_batch(msgs, admit.admit_heartbeat)  # type: ignore[arg-type]
    assert [msgspec.json.encode(e) for e in fast.events] == [msgspec.json.encode(e) for e in slow.events]
    assert fast.rejected == slow.rejected
    assert len(fast.events) >= 3 and len(fast.rejected) >= 8  # both kinds are exercised
