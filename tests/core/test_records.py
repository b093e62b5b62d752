"""Persistence records: keys, exact round trip, deletions, dirty keys; heartbeat-only changes."""

from __future__ import annotations

from orchestrator.core import State, decide, state_from_records, state_to_records
from orchestrator.core.inputs import JobSubmitted, LeaseChanged
from orchestrator.core.model import CoreConfig, pool_record_key, safe_token
from tests.core.harness import Driver, pool, price, spec
from wire import AgentState, Heartbeat, PreemptionNotice, subject_command


def test_round_trip_and_keys() -> None:
    drv = Driver(State.empty(CoreConfig(heartbeat_timeout_s=7.0)))
    drv(LeaseChanged(revision=11))
    drv(price(pool(), 10.0))
    d = drv(JobSubmitted(job_id="team/a.b c", spec=spec()))
    recs = state_to_records(d.state)
    assert "meta" in recs and "job.team/a.b c" in recs
    assert pool_record_key(pool().name) in recs and "/" not in pool_record_key(pool().name)[5:]
    back = state_from_records(recs)
    assert back == d.state and back.config.heartbeat_timeout_s == 7.0 and back.meta.fencing_token == 11
    # node ids are NATS subject tokens even when the job id is not
    for nid in d.state.nodes:
        assert subject_command(nid) == f"orch.cmd.{nid}"
        assert nid.startswith(safe_token("team/a.b c"))
    # the decision's dirty keys are exactly the records it wrote
    assert set(d.dirty) <= set(recs)
    assert {"meta", "job.team/a.b c"} <= set(d.dirty)


def test_deleted_record_is_empty_bytes() -> None:
    drv = Driver()
    drv(price(pool(), 10.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_max=1)))
    ids = drv.launched(d)
    drv.register(ids)
    d = drv(PreemptionNotice(id="n", node_id=ids[0], cloud="aws", deadline_ts=drv.now + 1, observed_ts=drv.now))
    from orchestrator.core.inputs import NodeGone

    d = drv(NodeGone(node_id=ids[0], reason="provider_terminated"))
    recs = state_to_records(d.state, d.dirty)
    assert recs[f"node.{ids[0]}"] == b""
    full = state_to_records(d.state)
    assert f"node.{ids[0]}" not in full
    assert state_from_records({**full, f"node.{ids[0]}": b""}) == d.state


def test_restart_continues_with_the_same_ids() -> None:
    """A daemon that persisted state and crashed re-derives the same command ids and tokens."""
    s = State.empty()
    s = decide(s, price(pool(), 10.0), 0.0).state
    d1 = decide(s, JobSubmitted(job_id="j", spec=spec()), 1.0)
    restored = state_from_records(state_to_records(s))
    d2 = decide(restored, JobSubmitted(job_id="j", spec=spec()), 1.0)
    assert d1.commands == d2.commands and d1.state == d2.state


def test_heartbeat_only_changes_are_not_dirty() -> None:
    drv = Driver()
    drv(price(pool(), 10.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_max=1)))
    (nid,) = drv.launched(d)
    drv.register([nid])
    hb = Heartbeat(node_id=nid, seq=1, ts=0, state=AgentState.TRAINING, job_id="j1", generation=1, step=5, loss=2.5)
    d = drv(hb)  # first training heartbeat: the job becomes RUNNING -> dirty
    assert "job.j1" in d.dirty
    d = drv(Heartbeat(node_id=nid, seq=2, ts=1, state=AgentState.TRAINING, job_id="j1", generation=1, step=6), dt=1)
    assert d.dirty == frozenset() and d.state.nodes[nid].step == 6 and d.state.nodes[nid].last_seen == drv.now
    # a restarted agent (seq back to 1) still counts as alive; progress never goes backwards
    d2 = drv(Heartbeat(node_id=nid, seq=1, ts=1, state=AgentState.TRAINING, job_id="j1", generation=1, step=1), dt=1)
    assert d2.state.nodes[nid].step == 6 and d2.state.nodes[nid].last_seen == drv.now
