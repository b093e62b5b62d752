"""Scenario tables through decide: capacity failure, vanish without notice, price hysteresis, deadline,
budget, idempotent redelivery, unknown ids."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.core import CoreConfig, JobPhase, NodePhase, State, job_cost_usd
from orchestrator.core.commands import CheckInstance, Launch, Terminate
from orchestrator.core.inputs import (
    AgentDisconnected,
    BusState,
    JobCancelled,
    JobSubmitted,
    LaunchFailed,
    NodeGone,
    NodeLaunched,
    Tick,
)
from tests.core.harness import (
    AgentState,
    CheckpointCommitted,
    Driver,
    GenerationStarted,
    Heartbeat,
    RanksExited,
    cmds,
    pool,
    price,
    spec,
)
from wire import (
    AbandonGenerationCmd,
    CheckpointCmd,
    FailureReason,
    Market,
    MarketPolicy,
    PreemptionNotice,
    PricePolicy,
    StartGenerationCmd,
)

AT_ONCE = CoreConfig(price_confirm_s=0.0)  # no price confirmation (tests/core/test_price_confirm.py has it)
A = pool("p4d.24xlarge", "us-east-1a")
B = pool("p4de.24xlarge", "us-east-1a")
C = pool("p4d.24xlarge", "us-east-1b")


def running(drv: Driver, prices: dict | None = None, **kw: Any) -> list[str]:
    for pk, usd in (prices or {A: 10.0, B: 12.0, C: 11.0}).items():
        drv(price(pk, usd))
    d = drv(JobSubmitted(job_id="j1", spec=spec(**kw)))
    ids = drv.launched(d)
    drv.register(ids)
    drv(GenerationStarted(id="g", node_id=ids[0], job_id="j1", generation=1, first_step=1, ts=drv.now), dt=1)
    assert drv.job().phase == JobPhase.RUNNING
    return ids


def beat(drv: Driver, ids: list[str], n: int = 1, dt: float = 1.0, step0: int = 0) -> None:
    for i in range(n):
        for nid in ids:
            node = drv.state.nodes.get(nid)
            if node is None:
                continue
            drv(Heartbeat(node_id=nid, seq=node.hb_seq + 1, ts=drv.now, state=AgentState.TRAINING, job_id="j1",
                          generation=node.generation, step=step0 + i + 1, step_time_s=1.0))
        drv(Tick(), dt=dt)


def test_capacity_failure_tries_next_pool_and_backs_off() -> None:
    drv = Driver()
    for pk, usd in {A: 10.0, B: 12.0, C: 11.0}.items():
        drv(price(pk, usd))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=2, nodes_min=2, market=MarketPolicy.SPOT)))
    (la,) = cmds(d, Launch)
    assert la.pool == A
    d = drv(LaunchFailed(node_ids=la.node_ids, job_id="j1", pool=A, token=la.token, reason=FailureReason.CAPACITY))
    (lb,) = cmds(d, Launch)
    assert lb.pool == C and lb.token != la.token  # next cheapest, never the failed pool
    assert drv.state.pools[A.name].backoff_until > drv.now
    # Redelivered failure: no second launch.
    d = drv(LaunchFailed(node_ids=la.node_ids, job_id="j1", pool=A, token=la.token, reason=FailureReason.CAPACITY))
    assert not d.commands
    # Partial fulfilment: one node of C launched, the other failed -> the rest in the SAME zone (none left
    # there (spot only) -> nodes_min=2 forces a whole move to zone a, where B is the only pool not in
    # backoff).
    drv(NodeLaunched(node_id=lb.node_ids[0], job_id="j1", instance_id="i-1", pool=C, token=lb.token))
    d = drv(LaunchFailed(node_ids=lb.node_ids[1:], job_id="j1", pool=C, token=lb.token, reason=FailureReason.CAPACITY))
    (lc,) = cmds(d, Launch)
    assert lc.pool == B and len(lc.node_ids) == 2
    assert [t.node_id for t in cmds(d, Terminate)] == [lb.node_ids[0]]  # left behind in the old zone


def test_partial_fulfilment_stays_in_zone() -> None:
    drv = Driver()
    for pk, usd in {A: 10.0, B: 12.0, C: 11.0}.items():
        drv(price(pk, usd))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=2, nodes_min=1)))
    (la,) = cmds(d, Launch)
    drv(NodeLaunched(node_id=la.node_ids[0], job_id="j1", instance_id="i-1", pool=A, token=la.token))
    d = drv(LaunchFailed(node_ids=la.node_ids[1:], job_id="j1", pool=A, token=la.token, reason=FailureReason.CAPACITY))
    (lb,) = cmds(d, Launch)
    assert lb.pool == B and len(lb.node_ids) == 1  # same zone, another instance type


def test_partial_fulfilment_falls_back_to_on_demand_in_zone() -> None:
    drv = Driver()
    for pk, usd in {A: 10.0, C: 11.0}.items():
        drv(price(pk, usd))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=2, nodes_min=1)))
    (la,) = cmds(d, Launch)
    drv(NodeLaunched(node_id=la.node_ids[0], job_id="j1", instance_id="i-1", pool=A, token=la.token))
    d = drv(LaunchFailed(node_ids=la.node_ids[1:], job_id="j1", pool=A, token=la.token, reason=FailureReason.CAPACITY))
    (lb,) = cmds(d, Launch)
    assert lb.pool.zone == A.zone and lb.pool.market == Market.ON_DEMAND


def test_vanish_without_notice_check_then_confirm() -> None:
    drv = Driver()
    ids = running(drv)
    beat(drv, ids, 3)
    # ids[1] goes silent.
    d = None
    suspects = []
    for _ in range(15):
        beat(drv, ids[:1], 1)
        d = drv.decisions[-1]
        suspects += cmds(d, CheckInstance)
    assert [s.node_id for s in suspects] == [ids[1]]
    assert drv.job().phase == JobPhase.RUNNING  # one signal is not enough
    d = drv(NodeGone(node_id=ids[1], reason="provider_missing"))
    ab = cmds(d, AbandonGenerationCmd)
    assert [a.node_id for a in ab] == [ids[0]]
    (repl,) = cmds(d, Launch)
    assert repl.pool == B
    assert drv.job().phase == JobPhase.RECOVERING
    d = drv(RanksExited(id="x", node_id=ids[0], job_id="j1", generation=1, exit_code=77, reason="abandoned",
                        last_step=5, ts=drv.now))
    (start,) = cmds(d, StartGenerationCmd)
    assert start.node_id == ids[0] and start.resume_from is None and start.generation == 2


def test_a_suspect_whose_instance_still_ran_is_checked_again_each_heartbeat_timeout() -> None:
    """The provider said the silent node's instance was running; it dies later. Without another check
    nothing would give the node up: it is asked again every heartbeat timeout while the node is silent,
    and the next answer (gone) replaces it."""
    drv = Driver()
    ids = running(drv)
    beat(drv, ids, 3)
    checks = []
    for _ in range(40):  # 40 s of silence, heartbeat timeout 10 s: the first check, then one per timeout
        beat(drv, ids[:1], 1)
        checks += [(drv.now, c.node_id) for c in cmds(drv.decisions[-1], CheckInstance)]
    assert [nid for _, nid in checks] == [ids[1]] * len(checks) and len(checks) >= 3
    gaps = [b[0] - a[0] for a, b in zip(checks, checks[1:], strict=False)]
    assert all(g > drv.state.config.heartbeat_timeout_s for g in gaps), gaps
    assert drv.job().phase == JobPhase.RUNNING  # each "still running" answer keeps it
    d = drv(NodeGone(node_id=ids[1], reason="provider_terminated"))  # the later check finds it gone
    assert cmds(d, Launch) and ids[1] not in drv.state.nodes


def test_agent_disconnect_then_timeout_confirms() -> None:
    drv = Driver()
    ids = running(drv)
    beat(drv, ids, 2)
    d = drv(AgentDisconnected(node_id=ids[1]))
    assert not d.commands and drv.state.nodes[ids[1]].disconnected
    for _ in range(15):
        beat(drv, ids[:1], 1)
    assert ids[1] not in drv.state.nodes
    assert drv.job().phase in (JobPhase.RECOVERING, JobPhase.RESIZING, JobPhase.STARTING)


def test_heartbeat_clears_suspect() -> None:
    drv = Driver()
    ids = running(drv)
    for _ in range(12):
        beat(drv, ids[:1], 1)
    assert drv.state.nodes[ids[1]].suspect_since is not None
    d = drv(Heartbeat(node_id=ids[1], seq=99, ts=drv.now, state=AgentState.TRAINING, job_id="j1", generation=1))
    assert drv.state.nodes[ids[1]].suspect_since is None and f"node.{ids[1]}" in d.dirty
    d = drv(AgentDisconnected(node_id=ids[1]))
    assert ids[1] in drv.state.nodes  # not suspect any more: a disconnect alone is one signal


def test_bus_outage_pauses_failure_detection() -> None:
    drv = Driver()
    ids = running(drv)
    beat(drv, ids, 2)
    drv(BusState(connected=False))
    for _ in range(60):
        d = drv(Tick(), dt=1)
        assert not cmds(d, CheckInstance)
    drv(BusState(connected=True))
    for _ in range(5):
        d = drv(Tick(), dt=1)
        assert not cmds(d, CheckInstance)  # grace of one heartbeat timeout after reconnect
    beat(drv, ids, 3)
    assert all(drv.state.nodes[n].suspect_since is None for n in ids)
    for _ in range(12):
        drv(Tick(), dt=1)
    assert all(drv.state.nodes[n].suspect_since is not None for n in ids)  # detection is back


@pytest.mark.parametrize(
    "ratios,expect",
    [
        ((0.5, 0.9, 0.94), JobPhase.RUNNING),  # below the pause ratio
        ((0.5, 0.96), JobPhase.CHECKPOINTING),  # above -> pause
    ],
)
def test_price_pause(ratios: tuple, expect: JobPhase) -> None:
    drv = Driver(State.empty(AT_ONCE))  # the price policy itself: prices act at once
    ids = running(drv, prices={A: 10.0}, nodes=1, nodes_max=1)
    for r in ratios:
        drv(price(A, 30.0 * r))
        beat(drv, ids, 1)
    assert drv.job().phase == expect


def test_price_pause_resume_hysteresis() -> None:
    drv = Driver(State.empty(AT_ONCE))  # the price policy itself: prices act at once
    ids = running(drv, prices={A: 10.0}, nodes=1, nodes_max=1)
    d = drv(price(A, 29.0))
    assert not d.commands  # a price tick only updates the pool; the reaction comes with the next Tick
    d = drv(Tick(), dt=1)
    assert cmds(d, CheckpointCmd)[0].reason == "price_pause"
    drv(CheckpointCommitted(id="c", node_id=ids[0], job_id="j1", generation=1, step=50, checkpoint_id="s50",
                            url="u50", save_s=5.0, ts=drv.now))
    d = drv(RanksExited(id="x", node_id=ids[0], job_id="j1", generation=1, exit_code=75,
                        reason="emergency_checkpoint", last_step=50, ts=drv.now))
    assert drv.job().phase == JobPhase.PAUSED and cmds(d, Terminate) and not drv.state.nodes
    for usd in (28.0, 27.0, 26.0):  # 0.93 .. 0.87: between the ratios -> stays paused (no flapping)
        drv(price(A, usd))
        d = drv(Tick(), dt=5)
        assert drv.job().phase == JobPhase.PAUSED and not d.commands
    drv(price(A, 25.0))  # 0.83 < 0.85
    d = drv(Tick(), dt=5)
    assert drv.job().phase == JobPhase.PLACING and cmds(d, Launch)
    ids2 = drv.launched(d)
    d = drv.register(ids2)
    assert cmds(d, StartGenerationCmd)[0].resume_from == "u50"


def test_pause_prefers_a_cheap_spot_pool_elsewhere() -> None:
    drv = Driver(State.empty(AT_ONCE))  # the price policy itself: prices act at once
    ids = running(drv, prices={A: 10.0, C: 12.0}, nodes=1, nodes_max=1)
    drv(price(A, 29.0))
    d = drv(Tick(), dt=1)
    (la,) = cmds(d, Launch)
    assert la.pool == C and drv.job().phase == JobPhase.RUNNING  # make before break
    new = drv.launched(d)
    d = drv.register(new)
    assert cmds(d, CheckpointCmd)[0].reason == "migrate"
    d = drv(RanksExited(id="x", node_id=ids[0], job_id="j1", generation=1, exit_code=75,
                        reason="emergency_checkpoint", last_step=50, ts=drv.now))
    assert [s.node_id for s in cmds(d, StartGenerationCmd)] == new
    assert [t.node_id for t in cmds(d, Terminate)] == ids


def test_deadline_falls_back_to_on_demand() -> None:
    drv = Driver()
    ids = running(drv, nodes=1, nodes_max=1, total_steps=10_000, deadline_ts=1000 + 20_000.0)
    assert drv.job().phase == JobPhase.RUNNING
    od = []
    for _ in range(6000):
        drv(Heartbeat(node_id=ids[0], seq=drv.state.nodes[ids[0]].hb_seq + 1, ts=drv.now,
                      state=AgentState.TRAINING, job_id="j1", generation=1,
                      step=drv.state.nodes[ids[0]].step + 1, step_time_s=2.0))
        d = drv(Tick(), dt=1)
        od += [c for c in cmds(d, Launch) if c.pool.market == Market.ON_DEMAND]
        if od:
            break
    assert od and drv.job().force_on_demand
    assert od[0].pool.zone == A.zone  # same zone: the checkpoint stays local
    assert any(a.action == "on_demand_fallback" for d in drv.decisions for a in d.audit)
    new = drv.launched(drv.decisions[-1])
    d = drv.register(new)
    assert cmds(d, CheckpointCmd)[0].reason == "migrate"


def test_budget_stop_with_final_checkpoint() -> None:
    drv = Driver()
    # 1 node at $10/h; budget $5 -> about 30 minutes.
    ids = running(drv, prices={A: 10.0}, nodes=1, nodes_max=1, budget_usd=5.0)
    seen_ck = None
    for i in range(4000):
        beat(drv, ids, 1, dt=1.0, step0=i)
        for d in drv.decisions[-2:]:
            for c in cmds(d, CheckpointCmd):
                seen_ck = c
        if seen_ck:
            break
    assert seen_ck is not None and seen_ck.reason == "budget"
    drv(CheckpointCommitted(id="c", node_id=ids[0], job_id="j1", generation=1, step=300, checkpoint_id="s",
                            url="u", save_s=15.0, ts=drv.now), dt=10)
    d = drv(RanksExited(id="x", node_id=ids[0], job_id="j1", generation=1, exit_code=75,
                        reason="emergency_checkpoint", last_step=300, ts=drv.now), dt=5)
    assert drv.job().phase == JobPhase.STOPPED and cmds(d, Terminate)
    # stopped close to, but under, the cap (the termination tail is reserved at the on-demand price)
    assert 0.85 * 5.0 < drv.job().cost_usd <= 5.0
    assert job_cost_usd(drv.state, "j1", drv.now + 3600) == drv.job().cost_usd  # nothing accrues after


def test_budget_hard_stop_when_checkpoint_hangs() -> None:
    drv = Driver()
    ids = running(drv, prices={A: 10.0}, nodes=1, nodes_max=1, budget_usd=2.0)
    for _ in range(2000):
        drv(Tick(), dt=5.0)
        if drv.job().phase == JobPhase.STOPPED:
            break
    assert drv.job().phase == JobPhase.STOPPED and not drv.state.nodes
    assert drv.job().cost_usd <= 2.0
    assert any(a.reason == "budget_hard_stop" for d in drv.decisions for a in d.audit) and ids


def test_launch_refused_when_budget_cannot_cover_boot_and_stop() -> None:
    drv = Driver()
    drv(price(A, 10.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_max=1, budget_usd=0.5)))
    assert not cmds(d, Launch)
    assert [a.action for a in d.audit][-2:] == ["launch_refused", "stop"]
    assert drv.job().phase == JobPhase.STOPPED  # cannot even start: stop instead of waiting forever


def test_cancel_checkpoints_then_terminates() -> None:
    drv = Driver()
    ids = running(drv)
    d = drv(JobCancelled(job_id="j1"))
    assert {c.node_id for c in cmds(d, CheckpointCmd)} == set(ids)
    for nid in ids:
        d = drv(RanksExited(id=f"x{nid}", node_id=nid, job_id="j1", generation=1, exit_code=75,
                            reason="emergency_checkpoint", last_step=9, ts=drv.now))
    assert drv.job().phase == JobPhase.CANCELLED and len(cmds(d, Terminate)) == 2


def test_idempotent_redelivery() -> None:
    drv = Driver()
    ids = running(drv)
    n = PreemptionNotice(id="n1", node_id=ids[1], cloud="aws", deadline_ts=drv.now + 120, observed_ts=drv.now)
    d1 = drv(n)
    assert cmds(d1, Launch)
    d2 = drv(n)
    assert not d2.commands and d2.state is d1.state
    cc = CheckpointCommitted(id="c", node_id=ids[0], job_id="j1", generation=1, step=10, checkpoint_id="s",
                             url="u10", save_s=5.0, ts=drv.now)
    drv(cc)
    d = drv(cc)
    assert d.state is drv.decisions[-2].state and not d.dirty
    (la,) = cmds(d1, Launch)
    ev = NodeLaunched(node_id=la.node_ids[0], job_id="j1", instance_id="i-9", pool=la.pool, token=la.token)
    drv(ev)
    d = drv(ev)
    assert not d.commands and not d.dirty
    assert drv(JobSubmitted(job_id="j1", spec=spec())).state is d.state


def test_unknown_ids_are_ignored() -> None:
    drv = Driver()
    s0 = drv.state
    for ev in [
        Heartbeat(node_id="nope", seq=1, ts=0, state=AgentState.IDLE),
        NodeGone(node_id="nope", reason="provider_missing"),
        AgentDisconnected(node_id="nope"),
        RanksExited(id="x", node_id="nope", job_id="nojob", generation=1, exit_code=0, reason="completed", ts=0),
        JobCancelled(job_id="nojob"),
        PreemptionNotice(id="n", node_id="nope", cloud="aws", deadline_ts=5.0, observed_ts=0.0),
    ]:
        d = drv(ev)
        assert d.state == s0 and not d.commands


def test_market_policy_on_demand_only() -> None:
    drv = Driver()
    drv(price(A, 10.0, od=30.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(market=MarketPolicy.ON_DEMAND)))
    (la,) = cmds(d, Launch)
    assert la.pool.market == Market.ON_DEMAND


def test_spot_at_on_demand_price_means_no_capacity() -> None:
    drv = Driver()
    drv(price(A, 30.0, od=30.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(market=MarketPolicy.SPOT)))
    assert not cmds(d, Launch) and drv.job().phase == JobPhase.PENDING


def test_scale_up_when_cheap() -> None:
    drv = Driver()
    ids = running(drv, prices={A: 10.0}, nodes=1, nodes_max=2, nodes_min=1)
    d = drv(Tick(), dt=1)
    (la,) = cmds(d, Launch)
    assert len(la.node_ids) == 1 and drv.job().target_nodes == 2
    d = drv.register(drv.launched(d))
    assert cmds(d, CheckpointCmd)[0].reason == "resize"
    assert ids


def test_price_policy_fields_used() -> None:
    drv = Driver(State.empty(AT_ONCE))  # the price policy itself: prices act at once
    ids = running(drv, prices={A: 10.0}, nodes=1, nodes_max=1,
                  price=PricePolicy(pause_above_ratio=0.5, resume_below_ratio=0.4))
    drv(price(A, 16.0))
    d = drv(Tick(), dt=1)
    assert cmds(d, CheckpointCmd) and ids
    assert drv.state.nodes[ids[0]].phase == NodePhase.RUNNING


def test_notice_without_capacity_in_zone_moves_the_whole_job() -> None:
    drv = Driver()
    ids = running(drv, prices={A: 10.0, C: 11.0}, nodes=2, nodes_min=2, nodes_max=2, market=MarketPolicy.SPOT)
    d = drv(PreemptionNotice(id="n", node_id=ids[1], cloud="aws", deadline_ts=drv.now + 120, observed_ts=drv.now))
    assert {c.node_id for c in cmds(d, CheckpointCmd)} == set(ids)
    (la,) = cmds(d, Launch)
    assert la.pool == C and len(la.node_ids) == 2  # the whole job moves (zone a has no other pool)
    drv(CheckpointCommitted(id="c", node_id=ids[0], job_id="j1", generation=1, step=70, checkpoint_id="s70",
                            url="u70", save_s=9.0, emergency=True, ts=drv.now), dt=10)
    for nid in ids:
        d = drv(RanksExited(id=f"x{nid}", node_id=nid, job_id="j1", generation=1, exit_code=75,
                            reason="emergency_checkpoint", last_step=70, ts=drv.now))
    assert drv.job().phase == JobPhase.RESIZING
    assert {t.node_id for t in cmds(d, Terminate)} == set(ids)  # old zone: nothing to keep
    new = drv.launched(drv.decisions[[i for i, x in enumerate(drv.decisions) if la in x.commands][0]])
    d = drv.register(new)
    starts = cmds(d, StartGenerationCmd)
    assert {s.node_id for s in starts} == set(new) and {s.resume_from for s in starts} == {"u70"}
    assert {drv.state.nodes[s.node_id].pool.zone for s in starts} == {C.zone}


def test_registration_before_node_launched() -> None:
    drv = Driver()
    drv(price(A, 10.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_max=1)))
    (la,) = cmds(d, Launch)
    nid = la.node_ids[0]
    from wire import NodeRegistered

    d = drv(NodeRegistered(id="r", node_id=nid, instance_id="i-1", host="h1", ts=drv.now))
    (start,) = cmds(d, StartGenerationCmd)
    assert start.master_addr == "h1" and start.checkpoint_interval_s and start.checkpoint_interval_s >= 120
    d = drv(NodeLaunched(node_id=nid, job_id="j1", instance_id="i-1", pool=A, token=la.token))
    assert not d.commands and drv.state.nodes[nid].phase == NodePhase.RUNNING


def test_move_prefers_the_region_of_the_checkpoint() -> None:
    """A whole-job move counts the checkpoint transfer: same region beats a slightly cheaper far region."""
    from orchestrator.core import State
    from orchestrator.core.model import CoreConfig

    far = pool("p4d.24xlarge", "us-west-2a", region="us-west-2")
    near = pool("p4d.24xlarge", "us-east-1b")
    drv = Driver(State.empty(CoreConfig(checkpoint_gb_estimate=2000.0)))
    ids = running(drv, prices={A: 10.0, near: 12.0, far: 11.9}, nodes=1, nodes_max=1, market=MarketPolicy.SPOT,
                  total_steps=2000)
    drv(CheckpointCommitted(id="c", node_id=ids[0], job_id="j1", generation=1, step=10, checkpoint_id="s10",
                            url="u10", save_s=5.0, ts=drv.now))
    d = drv(PreemptionNotice(id="n", node_id=ids[0], cloud="aws", deadline_ts=drv.now + 120, observed_ts=drv.now))
    (la,) = cmds(d, Launch)
    assert la.pool == near
    move = [a for a in d.audit if a.action == "move_zone"][0]
    assert move.alternatives[0][0] == near.name and move.alternatives[1][0] == far.name
