"""Instances the state does not own are terminated, never adopted (simulations finding 5): NodeLaunched /
NodeRegistered for an unknown node - also a node the state knew and already terminated (redelivery
after a daemon restart) -, another launch's token, or a second instance for one node."""

from __future__ import annotations

from orchestrator.core import JobPhase, state_from_records, state_to_records
from orchestrator.core.commands import Launch, Terminate
from orchestrator.core.inputs import JobCancelled, JobSubmitted, NodeLaunched
from tests.core.harness import Driver, cmds, pool, price, spec
from wire import NodeRegistered

A = pool("p4d.24xlarge", "us-east-1a")


def submitted(drv: Driver) -> Launch:
    drv(price(A, 10.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_min=1, nodes_max=1)))
    (la,) = cmds(d, Launch)
    return la


def assert_only_terminate(d, node_id: str, instance_id: str | None, s0) -> None:
    assert [(c.node_id, c.instance_id) for c in d.commands] == [(node_id, instance_id)]
    assert isinstance(d.commands[0], Terminate)
    assert d.state == s0 and not d.dirty
    assert [a.action for a in d.audit] == ["terminate_unowned"]


def test_node_launched_for_an_unknown_node_terminates_the_instance() -> None:
    drv = Driver()
    s0 = drv.state
    ev = NodeLaunched(node_id="ghost-n1", job_id="nojob", instance_id="i-ghost", pool=A, token="ghost-L1")
    d = drv(ev)
    assert_only_terminate(d, "ghost-n1", "i-ghost", s0)
    assert d.commands[0].pool == A
    # redelivered: the same Terminate again, still no state change (idempotent at the cloud)
    assert drv(ev).commands == d.commands


def test_launched_after_the_node_was_terminated_while_requested() -> None:
    # the job is cancelled while the launch is in flight: Terminate(instance_id=None); the instance then
    # appears - it is terminated by id, never adopted
    drv = Driver()
    la = submitted(drv)
    (nid,) = la.node_ids
    d = drv(JobCancelled(job_id="j1"))
    assert [(t.node_id, t.instance_id) for t in cmds(d, Terminate)] == [(nid, None)]
    assert drv.job().phase == JobPhase.CANCELLED and nid not in drv.state.nodes
    s0 = drv.state
    d = drv(NodeLaunched(node_id=nid, job_id="j1", instance_id="i-late", pool=A, token=la.token))
    assert_only_terminate(d, nid, "i-late", s0)


def test_redelivery_after_a_restart_for_a_node_known_as_terminated() -> None:
    drv = Driver()
    la = submitted(drv)
    (nid,) = la.node_ids
    ev = NodeLaunched(node_id=nid, job_id="j1", instance_id="i-1", pool=A, token=la.token)
    drv(ev)
    d = drv(JobCancelled(job_id="j1"))
    assert [(t.node_id, t.instance_id) for t in cmds(d, Terminate)] == [(nid, "i-1")]
    # the daemon restarts from its records; the executor redelivers the old NodeLaunched
    restarted = Driver(state_from_records(state_to_records(drv.state)), now=drv.now)
    s0 = restarted.state
    d = restarted(ev)
    assert_only_terminate(d, nid, "i-1", s0)
    assert nid not in restarted.state.nodes and restarted.job().phase == JobPhase.CANCELLED
    d = restarted(NodeRegistered(id="r", node_id=nid, instance_id="i-1", pool=A, host="h", ts=restarted.now))
    assert_only_terminate(d, nid, "i-1", s0)


def test_node_registered_for_an_unknown_node_terminates_by_tag_when_no_instance_id() -> None:
    drv = Driver()
    s0 = drv.state
    d = drv(NodeRegistered(id="r", node_id="stray-n7", host="h", ts=drv.now))
    assert_only_terminate(d, "stray-n7", None, s0)  # the shell finds the instance by its orch-node tag


def test_other_token_and_second_instance_are_terminated_the_node_keeps_its_own() -> None:
    drv = Driver()
    la = submitted(drv)
    (nid,) = la.node_ids
    s0 = drv.state
    d = drv(NodeLaunched(node_id=nid, job_id="j1", instance_id="i-x", pool=A, token="j1-L999"))
    assert_only_terminate(d, nid, "i-x", s0)
    drv(NodeLaunched(node_id=nid, job_id="j1", instance_id="i-1", pool=A, token=la.token))
    s1 = drv.state
    assert s1.nodes[nid].instance_id == "i-1"
    d = drv(NodeLaunched(node_id=nid, job_id="j1", instance_id="i-2", pool=A, token=la.token))
    assert_only_terminate(d, nid, "i-2", s1)
    d = drv(NodeRegistered(id="r2", node_id=nid, instance_id="i-2", host="h2", ts=drv.now))
    assert_only_terminate(d, nid, "i-2", s1)
    # the real one registers normally; its redelivery is still a no-op
    d = drv(NodeRegistered(id="r1", node_id=nid, instance_id="i-1", host="h1", ts=drv.now))
    assert drv.state.nodes[nid].host == "h1" and not cmds(d, Terminate)
    assert not drv(NodeLaunched(node_id=nid, job_id="j1", instance_id="i-1", pool=A, token=la.token)).commands
