"""Decision matrices (kopf-style): one event against a node/job in each relevant situation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from orchestrator.core import JobPhase, NodePhase
from orchestrator.core.commands import Launch, Terminate
from orchestrator.core.inputs import AgentDisconnected, JobSubmitted, NodeDrainRequested, NodeGone
from tests.core.harness import Driver, GenerationStarted, RanksExited, cmds, pool, price, spec
from wire import CheckpointCmd, NodeLeaving, PreemptionNotice, StartGenerationCmd

A = pool("p4d.24xlarge", "us-east-1a")
B = pool("p4de.24xlarge", "us-east-1a")


def setup(kind: str) -> tuple[Driver, str]:
    """A 2-node job; returns the driver and the node the event is about, in the situation ``kind``."""
    drv = Driver()
    drv(price(A, 10.0))
    drv(price(B, 12.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=2, nodes_min=1, nodes_max=2)))
    ids = drv.launched(d) if kind != "requested" else list(cmds(d, Launch)[0].node_ids)
    if kind in ("requested", "booting"):
        return drv, ids[0]
    drv.register(ids[:1])
    if kind == "registered_idle":
        return drv, ids[0]
    drv.register(ids[1:])
    drv(GenerationStarted(id="g", node_id=ids[0], job_id="j1", generation=1, first_step=1, ts=drv.now))
    if kind == "member_running":
        return drv, ids[1]
    drv(PreemptionNotice(id="n0", node_id=ids[1], cloud="aws", deadline_ts=drv.now + 120, observed_ts=drv.now))
    if kind == "noticed":
        return drv, ids[1]
    if kind == "member_checkpointing":
        return drv, ids[0]
    raise AssertionError(kind)


def notice(nid: str, drv: Driver) -> Any:
    return PreemptionNotice(id="n1", node_id=nid, cloud="aws", deadline_ts=drv.now + 120, observed_ts=drv.now)


def gone(nid: str, drv: Driver) -> Any:
    return NodeGone(node_id=nid, reason="provider_terminated")


def drain(nid: str, drv: Driver) -> Any:
    return NodeDrainRequested(node_id=nid)


def leaving(nid: str, drv: Driver) -> Any:
    return NodeLeaving(id="l", node_id=nid, reason="sigterm", ts=drv.now)


def disconnect(nid: str, drv: Driver) -> Any:
    return AgentDisconnected(node_id=nid)


E = Callable[[str, Driver], Any]

# (situation, event, expected job phase, #CheckpointCmd, #Launch, node terminated now?, node still known?)
MATRIX: list[tuple[str, E, JobPhase, int, int, bool, bool]] = [
    ("member_running", notice, JobPhase.CHECKPOINTING, 2, 1, False, True),
    ("registered_idle", notice, JobPhase.PLACING, 0, 1, True, False),
    ("booting", notice, JobPhase.PLACING, 0, 1, True, False),
    ("noticed", notice, JobPhase.CHECKPOINTING, 0, 0, False, True),  # redelivered: nothing new
    # a second notice during the checkpoint: no second CheckpointCmd, but its own replacement (bursts)
    ("member_checkpointing", notice, JobPhase.CHECKPOINTING, 0, 1, False, True),
    ("member_running", gone, JobPhase.RECOVERING, 0, 1, False, False),
    ("booting", gone, JobPhase.PLACING, 0, 1, False, False),
    ("requested", gone, JobPhase.PLACING, 0, 1, False, False),
    ("noticed", gone, JobPhase.CHECKPOINTING, 0, 0, False, False),  # its replacement is already launched
    ("member_running", drain, JobPhase.CHECKPOINTING, 2, 1, False, True),
    ("registered_idle", drain, JobPhase.PLACING, 0, 1, True, False),
    ("member_running", leaving, JobPhase.RECOVERING, 0, 1, True, False),
    ("noticed", leaving, JobPhase.CHECKPOINTING, 0, 0, False, True),  # expected: it leaves at its deadline
    ("member_running", disconnect, JobPhase.RUNNING, 0, 0, False, True),  # one signal: never act
]


@pytest.mark.parametrize("situation,event,phase,n_ckpt,n_launch,terminated,known", MATRIX,
                         ids=[f"{m[0]}-{m[1].__name__}" for m in MATRIX])
def test_node_event_matrix(situation: str, event: E, phase: JobPhase, n_ckpt: int, n_launch: int,
                           terminated: bool, known: bool) -> None:
    drv, nid = setup(situation)
    d = drv(event(nid, drv))
    assert drv.job().phase == phase
    assert len(cmds(d, CheckpointCmd)) == n_ckpt
    assert sum(len(la.node_ids) for la in cmds(d, Launch)) == n_launch
    assert (nid in [t.node_id for t in cmds(d, Terminate)]) == terminated
    assert (nid in drv.state.nodes) == known
    for la in cmds(d, Launch):
        if event is notice:
            assert la.pool != drv.decisions[0].state.pools[A.name].pool or situation == "noticed"


# RanksExited(reason) of one member of a running 2-node generation -> what happens. "held": the next
# generation waits for the restart backoff (test_checkpoint_exit_reasons.py has the hold's rules).
EXITS = [
    ("completed", 1000, JobPhase.SUCCEEDED, 2, False),  # last_step >= total_steps: done, terminate both
    ("completed", 10, JobPhase.RECOVERING, 0, True),  # "completed" early is not success: a counted exit
    ("failed", 10, JobPhase.RECOVERING, 0, True),  # trainer error: abandon the rest, restart from the commit
    ("peer_lost", 10, JobPhase.RECOVERING, 0, False),
    ("emergency_checkpoint", 10, JobPhase.RECOVERING, 0, False),  # unasked: treat as a broken generation
]


@pytest.mark.parametrize("reason,last_step,phase,n_term,held", EXITS)
def test_ranks_exited_matrix(reason: str, last_step: int, phase: JobPhase, n_term: int, held: bool) -> None:
    drv, nid = setup("member_running")
    d = drv(RanksExited(id="x", node_id=nid, job_id="j1", generation=1, exit_code=1, reason=reason,
                        last_step=last_step, ts=drv.now))
    assert drv.job().phase == phase
    assert len(cmds(d, Terminate)) == n_term
    if phase == JobPhase.RECOVERING:
        other = [n for n in drv.job().gen_nodes if n != nid][0]
        d = drv(RanksExited(id="y", node_id=other, job_id="j1", generation=1, exit_code=77, reason="abandoned",
                            last_step=last_step, ts=drv.now))
        starts = cmds(d, StartGenerationCmd)
        assert drv.job().held(drv.now) == held
        if held:
            assert not starts and drv.job().phase == JobPhase.RESIZING
            return
        assert len(starts) == 2 and {s.generation for s in starts} == {2}  # restarted on both nodes
        assert drv.state.nodes[nid].phase == NodePhase.RUNNING
