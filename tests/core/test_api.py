"""The core's typed surface: the event and command unions the shell is typed with, and the one way an
agent command is built (``Tx.header`` + ``Tx.send``: deterministic cmd ids, the fencing token)."""

from __future__ import annotations

import inspect
import typing

import msgspec
import pytest

import wire
from orchestrator import core
from orchestrator.core import inputs
from orchestrator.core.commands import CheckInstance, CreateTrackingRun, Launch, SendToAgent, Terminate
from orchestrator.core.inputs import JobSubmitted, LeaseChanged
from orchestrator.core.transitions import IllegalTransition
from orchestrator.core.tx import Tx
from tests.core.harness import Driver, pool, price, spec


def test_core_event_is_every_internal_event_and_every_wire_message_but_agent_commands() -> None:
    internal = {c for _, c in inspect.getmembers(inputs, inspect.isclass) if issubclass(c, inputs._Internal)}
    internal.discard(inputs._Internal)
    received = set(wire.WIRE_TYPES) - set(typing.get_args(wire.AgentCommand))
    assert set(typing.get_args(core.CoreEvent)) == internal | received
    assert core.CoreEvent is inputs.CoreEvent and "CoreEvent" in core.__all__


def test_command_union_and_decision_commands_round_trip() -> None:
    assert set(typing.get_args(core.Command)) == {Launch, Terminate, SendToAgent, CheckInstance, CreateTrackingRun}
    drv = Driver()
    drv(price(pool(), 10.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec()))
    assert [type(c) for c in d.commands] == [Launch]
    data = msgspec.json.encode(d.commands)
    assert msgspec.json.decode(data, type=tuple[core.Command, ...]) == d.commands


def _launched_node(drv: Driver) -> core.Node:
    drv(LeaseChanged(revision=7))
    drv(price(pool(), 10.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_min=1, nodes_max=1)))
    (nid,) = drv.launched(d)
    return drv.state.nodes[nid]


def test_send_numbers_commands_per_node_and_carries_the_fencing_token() -> None:
    drv = Driver()
    node = _launched_node(drv)
    tx = Tx(drv.state, "test", drv.now)
    first = wire.DrainCmd(**tx.header(node), reason="a")
    node = tx.send(node, first)
    second = wire.DrainCmd(**tx.header(node), reason="b")
    tx.send(node, second)
    assert (first.cmd_id, second.cmd_id) == (f"{node.node_id}-c1", f"{node.node_id}-c2")
    assert first.fencing_token == second.fencing_token == 7 and first.job_id == "j1"
    assert [c.command for c in tx.decision().commands if isinstance(c, SendToAgent)] == [first, second]
    assert tx.decision().state.nodes[node.node_id].cmd_seq == 2


def test_send_refuses_a_command_not_built_on_the_nodes_next_header() -> None:
    drv = Driver()
    node = _launched_node(drv)
    tx = Tx(drv.state, "test", drv.now)
    stale = wire.DrainCmd(**tx.header(node), reason="a")
    node = tx.send(node, stale)
    with pytest.raises(IllegalTransition):
        tx.send(node, stale)  # a second send of the same command would reuse its cmd id
    assert len(tx.decision().commands) == 1
