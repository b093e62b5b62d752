"""The vertical slice: submit -> place -> launch -> register -> start -> notice -> checkpoint +
replacement launch in the same decision -> shrink -> grow -> complete."""

from __future__ import annotations

from orchestrator.core import JobPhase, NodePhase
from orchestrator.core.inputs import JobSubmitted, LeaseChanged
from tests.core.harness import (
    AgentState,
    CheckpointCmd,
    CheckpointCommitted,
    Driver,
    GenerationStarted,
    Heartbeat,
    Launch,
    RanksExited,
    StartGenerationCmd,
    Terminate,
    cmds,
    pool,
    price,
    spec,
    state_from_records,
    state_to_records,
)
from wire import PreemptionNotice


def test_full_slice() -> None:
    drv = Driver()
    a = pool("p4d.24xlarge", "us-east-1a")
    b = pool("p4de.24xlarge", "us-east-1a")
    c = pool("p4d.24xlarge", "us-east-1b")
    drv(LeaseChanged(revision=7))
    drv(price(a, 10.0))
    drv(price(b, 12.0))
    drv(price(c, 11.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=2, nodes_min=1, nodes_max=2)))
    (launch,) = cmds(d, Launch)
    assert launch.pool == a and len(launch.node_ids) == 2
    assert drv.job().phase == JobPhase.PLACING
    assert d.audit[-1].alternatives[0][0] == a.name and len(d.audit[-1].alternatives) >= 2
    ids = drv.launched(d)
    d = drv.register(ids[:1])
    assert not cmds(d, StartGenerationCmd)  # waits for the second node
    d = drv.register(ids[1:])
    starts = cmds(d, StartGenerationCmd)
    assert [s.node_rank for s in starts] == [0, 1]
    assert {s.nnodes for s in starts} == {2} and {s.world_size for s in starts} == {16}
    assert {s.fencing_token for s in starts} == {7}
    assert starts[0].resume_from is None and starts[0].master_addr == starts[1].master_addr
    assert drv.job().phase == JobPhase.STARTING
    drv(GenerationStarted(id="g1", node_id=ids[0], job_id="j1", generation=1, first_step=1, ts=drv.now), dt=30)
    assert drv.job().phase == JobPhase.RUNNING
    for i in range(3):
        for nid in ids:
            drv(Heartbeat(node_id=nid, seq=i + 1, ts=drv.now, state=AgentState.TRAINING, job_id="j1",
                          generation=1, step=100 * (i + 1), step_time_s=1.0), dt=1)
    # Notice on rank 1: checkpoint to every node AND a replacement launch in the same decision.
    d = drv(PreemptionNotice(id="n1", node_id=ids[1], cloud="aws", deadline_ts=drv.now + 120, observed_ts=drv.now))
    ck = cmds(d, CheckpointCmd)
    assert {c.node_id for c in ck} == set(ids) and all(c.deadline_ts == drv.now + 120 for c in ck)
    (repl,) = cmds(d, Launch)
    assert repl.pool == b  # same zone, another capacity pool, never the preempted one
    assert drv.job().phase == JobPhase.CHECKPOINTING
    drv(CheckpointCommitted(id="c1", node_id=ids[0], job_id="j1", generation=1, step=305, checkpoint_id="s305",
                            url="file:///ckpt/j1/s305", save_s=12.0, emergency=True, ts=drv.now), dt=10)
    drv(RanksExited(id="x0", node_id=ids[0], job_id="j1", generation=1, exit_code=75,
                    reason="emergency_checkpoint", last_step=305, ts=drv.now))
    d = drv(RanksExited(id="x1", node_id=ids[1], job_id="j1", generation=1, exit_code=75,
                        reason="emergency_checkpoint", last_step=305, ts=drv.now))
    # Shrink: generation 2 on the survivor; the noticed node is terminated after the commit.
    (start,) = cmds(d, StartGenerationCmd)
    assert start.node_id == ids[0] and start.nnodes == 1 and start.generation == 2
    assert start.resume_from == "file:///ckpt/j1/s305"
    assert [t.node_id for t in cmds(d, Terminate)] == [ids[1]]
    assert ids[1] not in drv.state.nodes
    assert not cmds(d, Launch)  # the replacement is already on its way
    drv(GenerationStarted(id="g2", node_id=ids[0], job_id="j1", generation=2, first_step=306, ts=drv.now), dt=5)
    # The replacement registers: checkpoint and grow back.
    rids = drv.launched(_decision_with(drv, repl))
    d = drv.register(rids)
    (ck,) = cmds(d, CheckpointCmd)
    assert ck.reason == "resize" and drv.job().phase == JobPhase.CHECKPOINTING
    drv(CheckpointCommitted(id="c2", node_id=ids[0], job_id="j1", generation=2, step=400, checkpoint_id="s400",
                            url="file:///ckpt/j1/s400", save_s=10.0, ts=drv.now), dt=10)
    d = drv(RanksExited(id="x2", node_id=ids[0], job_id="j1", generation=2, exit_code=75,
                        reason="emergency_checkpoint", last_step=400, ts=drv.now))
    starts = cmds(d, StartGenerationCmd)
    assert [s.node_id for s in starts] == [ids[0], rids[0]] and {s.nnodes for s in starts} == {2}
    assert {s.resume_from for s in starts} == {"file:///ckpt/j1/s400"}
    assert drv.job().phase == JobPhase.STARTING
    drv(GenerationStarted(id="g3", node_id=ids[0], job_id="j1", generation=3, first_step=401, ts=drv.now))
    assert drv.job().phase == JobPhase.RUNNING
    # Completion.
    d = drv(RanksExited(id="x3", node_id=ids[0], job_id="j1", generation=3, exit_code=0, reason="completed",
                        last_step=1000, ts=drv.now), dt=600)
    assert drv.job().phase == JobPhase.SUCCEEDED
    assert {t.node_id for t in cmds(d, Terminate)} == {ids[0], rids[0]}
    assert not drv.state.nodes
    assert state_from_records(state_to_records(drv.state)) == drv.state


def _decision_with(drv: Driver, launch: Launch):
    for d in drv.decisions:
        if launch in d.commands:
            return d
    raise AssertionError("launch not found")


def test_node_phase_after_register() -> None:
    drv = Driver()
    drv(price(pool(), 10.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_max=1)))
    (nid,) = drv.launched(d)
    assert drv.state.nodes[nid].phase == NodePhase.BOOTING
    drv.register([nid])
    assert drv.state.nodes[nid].phase == NodePhase.RUNNING
