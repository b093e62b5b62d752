"""Launch policy found by the trace replays (docs/simulations.md): on-demand only behind the
uniform-progress line, no relaunch into a pool that just sent a terminate notice."""

from __future__ import annotations

from typing import Any

import msgspec

from orchestrator.core import CoreConfig, JobPhase, State
from orchestrator.core.commands import Launch
from orchestrator.core.inputs import JobSubmitted, Tick
from orchestrator.core.placement import ahead_of_line, launch_markets_for, line_step, ranked
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
from wire import Market, MarketPolicy, PreemptionNotice

A = pool("p4d.24xlarge", "us-east-1a")
A_OD = pool("p4d.24xlarge", "us-east-1a", market=Market.ON_DEMAND)
B = pool("p4de.24xlarge", "us-east-1a")
T0 = 1000.0


# The line's share of slack and 3 restarts of margin, the defaults these cases were written for (now a
# tuning: the default waits by the job's pace, tests/core/test_pace.py, and adds no margin to the net).
LINE = CoreConfig(deadline_margin_restarts=3.0, line_slack_share=0.5, progress_prior_h=1e9)

def one_node(drv: Driver, prices: dict | None = None, **kw: Any) -> str:
    """A 1-node job on spot A, 1000 steps of 1 s, deadline 3000 s after submission; trained to step 90
    at T0 + 100 (well ahead of the line, which is at 33 then)."""
    for pk, usd in (prices or {A: 10.0}).items():
        drv(price(pk, usd, od=30.0))
    base = dict(nodes=1, nodes_min=1, nodes_max=1, total_steps=1000, deadline_ts=T0 + 3000.0)
    base.update(kw)
    d = drv(JobSubmitted(job_id="j1", spec=spec(**base)))
    (la,) = cmds(d, Launch)
    assert la.pool == A
    (nid,) = drv.launched(d)
    drv.register([nid])
    drv(GenerationStarted(id="g", node_id=nid, job_id="j1", generation=1, first_step=1, ts=drv.now))
    drv.now = T0 + 100.0
    drv(Heartbeat(node_id=nid, seq=1, ts=drv.now, state=AgentState.TRAINING, job_id="j1", generation=1, step=90,
                  step_time_s=1.0))
    assert drv.job().phase == JobPhase.RUNNING
    return nid


def notice_and_commit(drv: Driver, nid: str, step: int = 90) -> list:
    """Terminate notice on ``nid`` (deadline in 120 s), its emergency checkpoint, the ranks' exit."""
    out = [drv(PreemptionNotice(id="n1", node_id=nid, cloud="aws", deadline_ts=drv.now + 120, observed_ts=drv.now))]
    out.append(drv(CheckpointCommitted(id="c1", node_id=nid, job_id="j1", generation=1, step=step, checkpoint_id="s",
                                       url=f"u{step}", save_s=20.0, ts=drv.now), dt=20))
    out.append(drv(RanksExited(id="x1", node_id=nid, job_id="j1", generation=1, exit_code=75,
                               reason="emergency_checkpoint", last_step=step, ts=drv.now)))
    return out


def capacity(drv: Driver, pk, hint: float, usd: float = 10.0) -> None:
    drv(msgspec.structs.replace(price(pk, usd, od=30.0), capacity_hint=hint))


def launches(ds: list) -> list[Launch]:
    return [c for d in ds for c in cmds(d, Launch)]


def test_line_arithmetic() -> None:
    s = State.empty(LINE)
    drv = Driver(s, now=T0)
    drv(price(A, 10.0))
    drv(JobSubmitted(job_id="j1", spec=spec(total_steps=1000, deadline_ts=T0 + 3000.0)))
    job = drv.job()
    assert line_step(job, T0) == 0 and line_step(job, T0 + 1500) == 500 and line_step(job, T0 + 9000) == 1000
    cfg = LINE
    assert ahead_of_line(job, 500, cfg, T0 + 1500) and not ahead_of_line(job, 499, cfg, T0 + 1500)
    # the margin shifts the line later in time: a job must be further ahead
    assert not ahead_of_line(job, 500, CoreConfig(progress_line_margin_s=300.0), T0 + 1500)
    both = frozenset({Market.SPOT, Market.ON_DEMAND})
    # on-demand launches once the spare slack (deadline - now - remaining work - one 380 s restart) is
    # below the reserve (3 restarts = 1140 s + the expected restarts of the rest, ~5 s), not at the line;
    # and whenever the safety net (Δ 5 s + detection 15 s + the work since the last checkpoint + the 3
    # restarts tuning adds) is not covered: with nothing committed, 500 steps are at risk
    at = msgspec.structs.replace
    assert launch_markets_for(at(job, committed_step=500), 500, cfg, T0 + 900) == frozenset({Market.SPOT})  # 1220 s
    assert launch_markets_for(job, 500, cfg, T0 + 900) == frozenset({Market.ON_DEMAND})  # net 1660 s > 1220 s
    assert launch_markets_for(at(job, committed_step=400), 400, cfg, T0 + 900) == frozenset({Market.ON_DEMAND})
    assert launch_markets_for(at(job, committed_step=999), 999, CoreConfig(progress_line=False), T0 + 1000) == both
    # no deadline, spot-only or on-demand-only jobs: unchanged
    nodl = drv.state.jobs["j1"].__class__(**{**{f: getattr(job, f) for f in job.__struct_fields__},
                                              "spec": spec(total_steps=1000)})
    assert launch_markets_for(nodl, 999, cfg, T0 + 1500) == both and ahead_of_line(nodl, 0, cfg, T0) is None
    for market in (MarketPolicy.SPOT, MarketPolicy.ON_DEMAND):
        j = nodl.__class__(**{**{f: getattr(job, f) for f in job.__struct_fields__},
                              "spec": spec(total_steps=1000, deadline_ts=T0 + 3000.0, market=market)})
        assert len(launch_markets_for(j, 0, cfg, T0 + 2000)) == 1


def test_ahead_of_the_line_a_notice_waits_for_spot_then_on_demand_once_behind() -> None:
    drv = Driver(State.empty(LINE), now=T0)
    nid = one_node(drv)
    ds = notice_and_commit(drv, nid)
    capacity(drv, A, 0.0)  # the zone's spot capacity is gone for a while
    # no spot in the zone but the noticed pool; the job is ahead of the line: no on-demand launch
    assert not launches(ds)
    assert drv.job().phase == JobPhase.RESIZING
    assert any(a.action == "wait" for d in ds for a in d.audit)
    # the line reaches step 90 at T0 + 270, but the slack still covers waiting for spot; the spare slack
    # (3000 - t - 910 - 380 s) falls below the safety net (Δ 5 s + detection 15 s + nothing at risk + the
    # 3 restarts = 1140 s tuning adds: 1160 s) at T0 + 550, before the line's reserve (~1145 s, T0 + 565):
    # the first Tick after it launches on-demand
    first_od = None
    while drv.now < T0 + 600:
        d = drv(Tick(), dt=10)
        ls = cmds(d, Launch)
        if ls:
            first_od = (drv.now, ls)
            break
    assert first_od is not None
    ts, (la,) = first_od
    assert la.pool == A_OD
    assert T0 + 550 <= ts < T0 + 565
    assert drv.job().force_on_demand  # the safety net, the same rule at the launch and the Tick


def test_without_the_line_policy_on_demand_replaces_at_once() -> None:
    drv = Driver(State.empty(CoreConfig(progress_line=False)), now=T0)
    nid = one_node(drv)
    ds = notice_and_commit(drv, nid)
    assert [la.pool for la in launches(ds)] == [A_OD]


def test_spot_back_before_the_line_no_on_demand() -> None:
    drv = Driver(now=T0)
    nid = one_node(drv)
    drv(Heartbeat(node_id=nid, seq=2, ts=drv.now, state=AgentState.TRAINING, job_id="j1", generation=1, step=200,
                  step_time_s=1.0))  # the line reaches 200 at T0 + 600
    notice_and_commit(drv, nid, step=200)
    d = drv(Tick(), dt=120)  # noticed pool still skipped (deadline + grace), job ahead: waits
    assert not cmds(d, Launch)
    capacity(drv, A, 0.0)
    d = drv(Tick(), dt=100)
    assert not cmds(d, Launch)
    capacity(drv, A, 1.0)  # capacity of A again (the notice's skip has passed by now)
    d = drv(Tick(), dt=10)
    (la,) = cmds(d, Launch)
    assert la.pool == A
    assert not [c for d in drv.decisions for c in cmds(d, Launch) if c.pool.market == Market.ON_DEMAND]


def test_behind_the_line_on_demand_is_still_used_when_spot_is_missing() -> None:
    drv = Driver(State.empty(LINE), now=T0)
    nid = one_node(drv)
    drv.now = T0 + 1000  # line at 333, the job at 90: behind
    ds = notice_and_commit(drv, nid)
    assert [la.pool for la in launches(ds)] == [A_OD]


def test_no_relaunch_into_the_noticed_pool_until_its_deadline_plus_grace() -> None:
    drv = Driver(now=T0)
    nid = one_node(drv, market=MarketPolicy.SPOT)
    deadline = drv.now + 120
    ds = notice_and_commit(drv, nid)
    # the checkpoint ended the generation; A still advertises capacity but sent the notice
    assert not launches(ds)
    ps = drv.state.pools[A.name]
    assert ps.noticed_until == deadline + CoreConfig().notice_skip_grace_s
    job = drv.job()
    assert ranked(drv.state.pools, job, 1, 90, drv.state.config, drv.now) == []
    assert ranked(drv.state.pools, job, 1, 90, drv.state.config, ps.noticed_until + 1)[0][1] == A.name
    d = drv(Tick(), dt=ps.noticed_until - drv.now - 1)
    assert not cmds(d, Launch)
    d = drv(Tick(), dt=2)
    assert [la.pool for la in cmds(d, Launch)] == [A]


def test_notice_replacement_goes_to_another_pool_of_the_zone_not_the_noticed_one() -> None:
    drv = Driver(now=T0)
    nid = one_node(drv, prices={A: 10.0, B: 12.0}, market=MarketPolicy.SPOT)
    ds = notice_and_commit(drv, nid)
    assert [la.pool for la in launches(ds)] == [B]  # exactly one replacement, never back into A


def test_rebalance_recommendation_does_not_block_the_pool() -> None:
    drv = Driver(now=T0)
    nid = one_node(drv)
    drv(PreemptionNotice(id="r", node_id=nid, cloud="aws", deadline_ts=None, observed_ts=drv.now,
                         kind="rebalance"))
    assert drv.state.pools[A.name].noticed_until == 0.0
