"""The trust gate (orchestrator/core/gate.py): every rule refuses what it must, and the legitimate
traffic of a job's whole life - registration, training, a notice, the emergency checkpoint, the exits,
the next generation, redeliveries, completion - passes it unchanged."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.core import JobPhase, authorize
from orchestrator.core.commands import Launch, Terminate
from orchestrator.core.gate import REASONS, under_root
from orchestrator.core.inputs import (
    BusState,
    CommandFailed,
    JobCancelled,
    JobSubmitted,
    LaunchFailed,
    NodeDrainRequested,
    NodeGone,
    NodeLaunched,
    Tick,
)
from tests.core.harness import Driver, cmds, pool, price, spec
from wire import (
    AgentState,
    CheckpointCmd,
    CheckpointCommitted,
    CheckpointPolicy,
    CommandAck,
    FailureReason,
    GenerationStarted,
    Heartbeat,
    NodeLeaving,
    NodeRegistered,
    PreemptionNotice,
    RanksExited,
    StartGenerationCmd,
)

A = pool("p4d.24xlarge", "us-east-1a")
B = pool("p4d.24xlarge", "us-east-1b")


class Gated(Driver):
    """A Driver whose events go through the gate first; ``legit`` asserts the gate passes them."""

    def __call__(self, event: Any, dt: float = 0.0) -> Any:
        reason = authorize(self.state, event, self.now + dt)
        assert reason is None, (type(event).__name__, reason)
        return super().__call__(event, dt)

    def refused(self, event: Any) -> str | None:
        return authorize(self.state, event, self.now)


def two_jobs() -> tuple[Gated, list[str], list[str]]:
    """j1 (2 nodes, root file:///ckpt/j1) and j2 (1 node, root s3://bucket/ckpt/j2), both training."""
    drv = Gated()
    drv(price(A, 10.0))
    drv(price(B, 11.0))
    ids: dict[str, list[str]] = {}
    for job, n, url in (("j1", 2, "file:///ckpt/j1"), ("j2", 1, "s3://bucket/ckpt/j2")):
        d = drv(JobSubmitted(job_id=job, spec=spec(nodes=n, nodes_min=n, nodes_max=n,
                                                   checkpoint=CheckpointPolicy(url=url))))
        ids[job] = drv.launched(d)
        drv.register(ids[job])
        drv(GenerationStarted(id=f"g-{job}", node_id=ids[job][0], job_id=job, generation=1, first_step=1,
                              ts=drv.now), dt=1)
        assert drv.job(job).phase == JobPhase.RUNNING
    return drv, ids["j1"], ids["j2"]


def hb(drv: Driver, nid: str, step: int, **kw: Any) -> Heartbeat:
    node = drv.state.nodes[nid]
    base: dict[str, Any] = dict(node_id=nid, seq=node.hb_seq + 1, ts=drv.now, state=AgentState.TRAINING,
                                job_id=node.job_id, generation=node.generation, step=step, step_time_s=1.0)
    base.update(kw)
    return Heartbeat(**base)


def commit(nid: str, job: str, gen: int, step: int, url: str, cid: str = "c") -> CheckpointCommitted:
    return CheckpointCommitted(id=cid, node_id=nid, job_id=job, generation=gen, step=step, checkpoint_id=f"s{step}",
                               url=url, save_s=3.0, ts=0.0)


def exited(nid: str, job: str, gen: int, step: int, reason: str = "emergency_checkpoint") -> RanksExited:
    return RanksExited(id=f"x-{nid}-{gen}", node_id=nid, job_id=job, generation=gen, exit_code=0, reason=reason,
                       last_step=step, ts=0.0)


# --- legitimate traffic -------------------------------------------------------------------------------


def test_a_whole_job_life_passes_the_gate() -> None:
    drv, j1, _j2 = two_jobs()
    for s in range(1, 6):
        for nid in j1:
            drv(hb(drv, nid, s))
        drv(Tick(), dt=1)
    # notice on one node: emergency checkpoint, exits, a replacement, the next generation
    k = len(drv.decisions)
    d = drv(PreemptionNotice(id="n1", node_id=j1[1], cloud="aws", deadline_ts=drv.now + 120, observed_ts=drv.now))
    assert cmds(d, CheckpointCmd)
    url = "file:///ckpt/j1/step-00000005"
    c = commit(j1[0], "j1", 1, 5, url)
    drv(c)
    drv(c)  # redelivered: passes, the core ignores it
    drv(hb(drv, j1[1], 5, state=AgentState.CHECKPOINTING))
    d = None
    for nid in j1:
        d = drv(exited(nid, "j1", 1, 5))
    drv(exited(j1[0], "j1", 1, 5))  # redelivered exit of the current generation: passes
    assert drv.job("j1").committed_url == url
    # the noticed node was removed at the end of the generation: what its agent still sends is refused
    # (unknown_node) - and the core would have ignored it anyway
    leaving = NodeLeaving(id="l1", node_id=j1[1], reason="preempted", ts=drv.now)
    assert j1[1] not in drv.state.nodes and drv.refused(leaving) == "unknown_node"
    assert Driver.__call__(drv, leaving).state == drv.state and not drv.decisions[-1].commands
    launched = [c for dd in drv.decisions[k:] for c in dd.commands if isinstance(c, Launch)]
    assert launched
    new: list[str] = []
    for la in launched:
        for nid in la.node_ids:
            drv(NodeLaunched(node_id=nid, job_id="j1", instance_id=f"i-{nid}", pool=la.pool, token=la.token))
            new.append(nid)
    for nid in new:  # the agent reports its instance id: the one orchd launched
        d = drv(NodeRegistered(id=f"r-{nid}", node_id=nid, instance_id=f"i-{nid}", host="10.1.0.9", ts=drv.now))
    drv(NodeGone(node_id=j1[1], reason="provider_terminated"))  # orchd's own: trusted
    assert d is not None
    job = drv.job("j1")
    starts = [c for dd in drv.decisions[k:] for c in cmds(dd, StartGenerationCmd)]
    assert job.generation == 2 and starts and {s.resume_from for s in starts} == {url}
    for nid in job.gen_nodes:
        drv(GenerationStarted(id=f"g2-{nid}", node_id=nid, job_id="j1", generation=2, first_step=6, ts=drv.now))
        drv(hb(drv, nid, 1000))
    drv(commit(job.gen_nodes[0], "j1", 2, 1000, "file:///ckpt/j1/step-00001000/", cid="c2"))
    first, *rest = job.gen_nodes
    drv(exited(first, "j1", 2, 1000, reason="completed"))
    assert drv.job("j1").phase == JobPhase.SUCCEEDED
    for nid in rest:  # the job ended: its nodes are gone, their late exits refused (the core ignores them)
        assert drv.refused(exited(nid, "j1", 2, 1000, reason="completed")) == "unknown_node"


def test_heartbeats_of_an_older_generation_and_without_a_job_pass() -> None:
    drv, j1, _ = two_jobs()
    assert drv.refused(hb(drv, j1[0], 3, generation=0, state=AgentState.IDLE)) is None
    assert drv.refused(hb(drv, j1[0], 0, job_id=None, state=AgentState.IDLE)) is None


def test_orchds_own_events_are_trusted() -> None:
    drv, j1, j2 = two_jobs()
    trusted = [Tick(), BusState(connected=True), JobCancelled(job_id="nope"), NodeDrainRequested(node_id="ghost"),
               NodeLaunched(node_id="ghost", job_id="j9", instance_id="i-x", pool=A, token="t"),
               LaunchFailed(node_ids=("ghost",), job_id="j9", pool=A, token="t", reason=FailureReason.CAPACITY),
               NodeGone(node_id="ghost", reason="provider_missing"),
               CommandFailed(node_id="ghost", cmd_id="c", kind="checkpoint"), price(A, 12.0)]
    for e in trusted:
        assert drv.refused(e) is None


# --- the rules ----------------------------------------------------------------------------------------


def test_attack_4_a_node_commits_a_checkpoint_for_another_job() -> None:
    drv, j1, j2 = two_jobs()
    before = drv.job("j2")
    evil = commit(j1[0], "j2", 1, 999_999, "file:///tmp/evil")
    assert drv.refused(evil) == "wrong_job"
    # even with its own job id, a url outside its root and an impossible step are refused
    assert drv.refused(commit(j1[0], "j1", 1, 10, "file:///tmp/evil")) == "foreign_checkpoint"
    assert drv.refused(commit(j1[0], "j1", 1, 10, "s3://bucket/ckpt/j2/step-10")) == "foreign_checkpoint"
    assert drv.refused(commit(j1[0], "j1", 1, 10, "file:///ckpt/j1/../j2/step-10")) == "foreign_checkpoint"
    assert drv.refused(commit(j1[0], "j1", 1, 10, "file:///ckpt/j1")) == "foreign_checkpoint"
    assert drv.refused(commit(j1[0], "j1", 1, 999_999, "file:///ckpt/j1/step-999999")) == "bad_step"
    assert drv.refused(commit(j1[0], "j1", 1, 0, "file:///ckpt/j1/step-0")) == "bad_step"
    assert drv.job("j2") == before


def test_attack_5_a_node_registers_with_another_jobs_instance() -> None:
    drv, j1, j2 = two_jobs()
    victim = drv.state.nodes[j2[0]].instance_id
    assert victim is not None
    evil = NodeRegistered(id="r-evil", node_id=j1[0], instance_id=victim, host="h", ts=drv.now)
    assert drv.refused(evil) == "wrong_instance"
    # without the gate the core would terminate the named instance (what orchd did before)
    d = Driver.__call__(drv, evil)
    assert [t.instance_id for t in d.commands if isinstance(t, Terminate)] == [victim]


def test_the_core_never_adopts_an_agents_instance_id() -> None:
    # registration before NodeLaunched: the gate cannot compare yet, so the core must not take the id
    drv = Gated()
    drv(price(A, 10.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_min=1, nodes_max=1)))
    (la,) = [c for c in d.commands if isinstance(c, Launch)]
    nid = la.node_ids[0]
    drv(NodeRegistered(id="r", node_id=nid, instance_id="i-victim", host="h", ts=drv.now))
    assert drv.state.nodes[nid].instance_id is None
    d = drv(NodeLaunched(node_id=nid, job_id="j1", instance_id="i-own", pool=A, token=la.token))
    assert drv.state.nodes[nid].instance_id == "i-own"
    assert not [c for c in d.commands if isinstance(c, Terminate)]  # its own instance is kept
    assert drv.refused(NodeRegistered(id="r3", node_id=nid, instance_id="i-own", ts=drv.now)) is None


def test_another_nodes_instance_is_refused_an_orphan_is_left_to_the_core() -> None:
    drv, j1, j2 = two_jobs()
    victim = drv.state.nodes[j2[0]].instance_id
    assert victim is not None
    for sender in (j1[0], "ghost-n9"):  # a known node, or one orchd never launched
        assert drv.refused(NodeRegistered(id="r", node_id=sender, instance_id=victim, ts=drv.now)) == "wrong_instance"
    # a second instance of a known node, or an unknown node's instance, that no node owns: an orphan of a
    # launch; the core terminates it (the provider terminates only this cluster's instances)
    d = drv(NodeRegistered(id="r2", node_id=j1[0], instance_id="i-orphan", ts=drv.now))
    assert [c.instance_id for c in d.commands if isinstance(c, Terminate)] == ["i-orphan"]
    d = drv(NodeRegistered(id="r3", node_id="ghost-n9", instance_id="i-orphan-2", ts=drv.now))
    assert [c.instance_id for c in d.commands if isinstance(c, Terminate)] == ["i-orphan-2"]


@pytest.mark.parametrize("make", [
    lambda n: Heartbeat(node_id=n, seq=1, ts=0.0, state=AgentState.IDLE),
    lambda n: NodeRegistered(id="r", node_id=n, ts=0.0),
    lambda n: PreemptionNotice(id="n", node_id=n, cloud="aws", deadline_ts=None, observed_ts=0.0),
    lambda n: NodeLeaving(id="l", node_id=n, reason="x", ts=0.0),
    lambda n: CommandAck(cmd_id="c", node_id=n, ok=True, ts=0.0),
    lambda n: GenerationStarted(id="g", node_id=n, job_id="j1", generation=1, first_step=1, ts=0.0),
    lambda n: commit(n, "j1", 1, 1, "file:///ckpt/j1/s1"),
    lambda n: exited(n, "j1", 1, 1),
])
def test_unknown_sender(make: Any) -> None:
    drv, _j1, _j2 = two_jobs()
    assert drv.refused(make("ghost-n9")) == "unknown_node"


def test_wrong_job_on_every_event_that_names_one() -> None:
    drv, j1, _ = two_jobs()
    n = j1[0]
    for e in (hb(drv, n, 1, job_id="j2"), commit(n, "j2", 1, 1, "s3://bucket/ckpt/j2/s1"), exited(n, "j2", 1, 1),
              GenerationStarted(id="g", node_id=n, job_id="j2", generation=1, first_step=1, ts=0.0)):
        assert drv.refused(e) == "wrong_job", e


def test_generations() -> None:
    drv, j1, _ = two_jobs()
    n = j1[0]
    assert drv.state.nodes[n].generation == 1
    assert drv.refused(exited(n, "j1", 2, 1)) == "bad_generation"
    assert drv.refused(commit(n, "j1", 7, 5, "file:///ckpt/j1/s5")) == "bad_generation"
    assert drv.refused(exited(n, "j1", 0, 1)) == "stale_generation"
    assert drv.refused(commit(n, "j1", 0, 5, "file:///ckpt/j1/s5")) == "stale_generation"
    assert drv.refused(GenerationStarted(id="g", node_id=n, job_id="j1", generation=0, first_step=1,
                                         ts=0.0)) == "stale_generation"


def test_steps() -> None:
    drv, j1, _ = two_jobs()
    total = drv.job("j1").spec.total_steps
    assert drv.refused(hb(drv, j1[0], total + 1)) == "bad_step"
    assert drv.refused(hb(drv, j1[0], total)) is None
    assert drv.refused(exited(j1[0], "j1", 1, total + 1, reason="completed")) == "bad_step"
    assert drv.refused(commit(j1[0], "j1", 1, total, f"file:///ckpt/j1/step-{total}")) is None


def test_reasons_are_short_labels() -> None:
    assert all(r.isidentifier() and r.islower() for r in REASONS)


@pytest.mark.parametrize(("url", "root", "ok"), [
    ("file:///ckpt/j1/step-00000001", "file:///ckpt/j1", True),
    ("file:///ckpt/j1/step-1/", "file:///ckpt/j1/", True),
    ("file:///ckpt//j1/step-1", "file:///ckpt/j1", True),
    ("S3://b/x/step-1", "s3://b/x", True),
    ("u/s1", "u", True),
    ("file:///ckpt/j1", "file:///ckpt/j1", False),  # the root itself
    ("file:///ckpt/j1/", "file:///ckpt/j1", False),
    ("file:///ckpt/j10/step-1", "file:///ckpt/j1", False),  # a sibling sharing the prefix
    ("file:///ckpt/j1/../j2/step-1", "file:///ckpt/j1", False),
    ("file:///ckpt/j1/./step-1", "file:///ckpt/j1", False),
    ("file://ckpt/j1/step-1", "file:///ckpt/j1", False),  # a host, not the absolute path
    ("gs://b/x/step-1", "s3://b/x", False),
    ("/ckpt/j1/step-1", "file:///ckpt/j1", False),
    ("file:///ckpt/j1/a%2e%2e", "file:///ckpt/j1", False),
    ("file:///ckpt/j1/a?x=1", "file:///ckpt/j1", False),
    ("file:///ckpt/j1/a\\..\\b", "file:///ckpt/j1", False),
    ("file:///tmp/evil", "file:///ckpt", False),
])
def test_under_root(url: str, root: str, ok: bool) -> None:
    assert under_root(url, root) is ok


def test_terminating_an_unowned_second_instance_keeps_the_node() -> None:
    """The core terminates an instance a node registers that no node owns; the executor's NodeGone for
    that instance names the node, which must stay (found by the adversarial fuzzer: it was lost)."""
    drv, j1, _j2 = two_jobs()
    own = drv.state.nodes[j1[0]].instance_id
    d = drv(NodeRegistered(id="r2", node_id=j1[0], instance_id="i-orphan", ts=drv.now))
    (term,) = [c for c in d.commands if isinstance(c, Terminate)]
    drv(NodeGone(node_id=term.node_id, instance_id=term.instance_id, reason="terminated_by_us"))
    assert j1[0] in drv.state.nodes and drv.state.nodes[j1[0]].instance_id == own
    assert drv.job("j1").phase == JobPhase.RUNNING
