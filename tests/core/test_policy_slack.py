"""Policy fixes found by trace replays: a failed price migration never strands a job (its old nodes are
kept), a zone-wide loss counts once per job in the preemption estimate, the deadline margin is in time
and a job that regains slack goes back to spot, and on-demand waits until the slack no longer covers
waiting for spot."""

from __future__ import annotations

import msgspec

from orchestrator.core import CoreConfig, JobPhase, State
from orchestrator.core.commands import Launch, Terminate
from orchestrator.core.inputs import JobSubmitted, NodeGone, Tick
from orchestrator.core.placement import launch_markets_for
from orchestrator.core.pricing import deadline_margin_s, efficiency, preemption_rate_h, record_exposure
from tests.core.harness import (
    AgentState,
    CheckpointCommitted,
    Driver,
    GenerationStarted,
    Heartbeat,
    RanksExited,
    StartGenerationCmd,
    cmds,
    pool,
    price,
    spec,
)
from wire import Market

A = pool("p4d.24xlarge", "us-east-1a")
A_OD = pool("p4d.24xlarge", "us-east-1a", market=Market.ON_DEMAND)
T0 = 1000.0
H = 3600.0


def _start(drv: Driver, d, gen: int, step: int = 0, step_time: float = 1.0) -> list[str]:
    """Launched + registered + started + one training heartbeat for the nodes ``d`` launched."""
    ids = drv.launched(d)
    drv.register(ids)
    for nid in ids:
        drv(GenerationStarted(id=f"g{gen}-{nid}", node_id=nid, job_id="j1", generation=gen, first_step=step + 1,
                              ts=drv.now))
        drv(Heartbeat(node_id=nid, seq=gen * 100, ts=drv.now, state=AgentState.TRAINING, job_id="j1",
                      generation=gen, step=step + 1, step_time_s=step_time))
    return ids


def _hb(drv: Driver, nid: str, gen: int, step: int, training: bool = True) -> None:
    drv(Heartbeat(node_id=nid, seq=int(drv.now), ts=drv.now, state=AgentState.TRAINING if training else
                  AgentState.IDLE, job_id="j1", generation=gen, step=step, step_time_s=1.0))


def test_failed_migration_keeps_the_on_demand_node_single_zone() -> None:
    """Issue item 1: the job migrates from on-demand to spot; the spot node is lost before the new
    generation starts and the zone's spot capacity is gone. The job must go on on its on-demand node
    (not terminate it and wait for a pool it excludes forever)."""
    cfg = CoreConfig(price_confirm_s=0.0, progress_line=False)
    drv = Driver(State.empty(cfg), now=T0)
    drv(price(A, 35.0, od=30.0))  # spot at/above on-demand: no spot capacity
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_min=1, nodes_max=1, total_steps=20000,
                                                 deadline_ts=T0 + 30 * H)))
    (la,) = cmds(d, Launch)
    assert la.pool == A_OD
    (od,) = _start(drv, d, 1)
    assert drv.job().phase == JobPhase.RUNNING
    drv(price(A, 10.0, od=30.0, ts=drv.now), dt=5)
    _hb(drv, od, 1, 10)
    d = drv(Tick(), dt=5)
    assert any(a.action == "migrate" for a in d.audit), [a.action for a in d.audit]
    assert drv.job().avoid_pools == (A_OD.name,)
    (la,) = cmds(d, Launch)
    assert la.pool == A
    (spot,) = drv.launched(d)
    d = drv.register([spot])  # the move: checkpoint the generation on the on-demand node
    assert drv.job().phase == JobPhase.CHECKPOINTING
    drv(msgspec.structs.replace(price(A, 10.0, od=30.0, ts=drv.now), capacity_hint=0.0))  # spot gone
    drv(NodeGone(node_id=spot, reason="provider_missing"), dt=5)
    drv(CheckpointCommitted(id="c1", node_id=od, job_id="j1", generation=1, step=100, checkpoint_id="s",
                            url="u100", save_s=20.0, ts=drv.now), dt=20)
    d = drv(RanksExited(id="x1", node_id=od, job_id="j1", generation=1, exit_code=75,
                        reason="emergency_checkpoint", last_step=100, ts=drv.now))
    terminated = [t.node_id for dd in drv.decisions[-3:] for t in cmds(dd, Terminate)]
    assert od not in terminated
    starts = cmds(d, StartGenerationCmd)
    assert [s.node_id for s in starts] == [od] and starts[0].generation == 2
    assert drv.job().avoid_pools == () and drv.job().phase == JobPhase.STARTING
    assert any(a.action == "migrate_abandoned" for dd in drv.decisions for a in dd.audit)
    for i in range(20):  # and it stays alive
        drv.now += 5
        _hb(drv, od, 2, 100 + i)
        drv(Tick())
    assert od in drv.state.nodes and drv.job().phase != JobPhase.RESIZING


def test_a_zone_wide_loss_counts_once_per_job() -> None:
    """Issue item 2: 16 nodes of one job lost together are one interruption of that job, not 16 (and the
    16-node job's efficiency is not at its floor afterwards)."""
    cfg = CoreConfig(price_confirm_s=0.0)
    drv = Driver(State.empty(cfg), now=T0)
    drv(price(A, 10.0, od=30.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=16, nodes_min=16, nodes_max=16, total_steps=100000)))
    ids = _start(drv, d, 1)
    assert len(ids) == 16 and drv.job().phase == JobPhase.RUNNING
    drv(Tick(), dt=10 * H)
    for nid in ids:
        drv(NodeGone(node_id=nid, reason="provider_missing"), dt=1)
    ps = drv.state.pools[A.name]
    assert 0.99 < ps.preemptions < 1.01, ps.preemptions
    now = drv.now
    job = drv.job()
    assert efficiency(job, ps, 16, cfg, now) > 0.5
    # independent losses still count one by one: another job's node, and a loss of this job later
    later = record_exposure(ps, cfg, now + 1, -1, True, "j2")
    assert later["preemptions"] > ps.preemptions + 0.99
    ps2 = msgspec.structs.replace(ps, **record_exposure(ps, cfg, now + 3600, 0, True, "j1"))
    assert ps2.preemptions > 1.9
    assert preemption_rate_h(ps2, cfg, now + 3600) > preemption_rate_h(ps, cfg, now)


def _running_job(drv: Driver, *, total_steps: int, deadline_s: float, step_time_est: float) -> str:
    drv(price(A, 10.0, od=30.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_min=1, nodes_max=1, total_steps=total_steps,
                                                 deadline_ts=T0 + deadline_s,
                                                 step_time_s_estimate=step_time_est)))
    (la,) = cmds(d, Launch)
    (nid,) = _start(drv, d, 1, step_time=step_time_est)
    return nid


def test_deadline_margin_is_time_not_a_share_of_the_work() -> None:
    """Issue item 6: a 48 h job with a 52 h deadline is not forced on-demand at submission (the margin is
    a few restarts, not 10% of the work)."""
    cfg = CoreConfig(price_confirm_s=0.0)
    drv = Driver(State.empty(cfg), now=T0)
    _running_job(drv, total_steps=48 * 3600, deadline_s=52 * H, step_time_est=1.0)
    drv(Tick(), dt=5)
    job = drv.job()
    assert not job.force_on_demand
    assert deadline_margin_s(job, cfg) < H  # 3 x (120 + 240 + 20) s
    assert launch_markets_for(job, 0, cfg, drv.now) == frozenset({Market.SPOT})


def test_a_job_that_regains_slack_goes_back_to_spot() -> None:
    """Issue item 6: forced on-demand when the slack is short (step time estimated at 2 s), then the
    trainer reports 1 s steps: the slack is back, the job may use spot again."""
    cfg = CoreConfig(price_confirm_s=0.0)
    drv = Driver(State.empty(cfg), now=T0)
    nid = _running_job(drv, total_steps=20000, deadline_s=40000 + 300, step_time_est=2.0)
    d = drv(Tick(), dt=5)
    assert drv.job().force_on_demand
    assert any(a.action == "on_demand_fallback" for a in d.audit)
    drv(Heartbeat(node_id=nid, seq=500, ts=drv.now, state=AgentState.TRAINING, job_id="j1", generation=1,
                  step=50, step_time_s=1.0))
    d = drv(Tick(), dt=5)
    assert not drv.job().force_on_demand
    assert any(a.action == "spot_again" for a in d.audit)
    # and no flapping: the next ticks keep it on spot
    for _ in range(5):
        drv(Tick(), dt=5)
        assert not drv.job().force_on_demand


def test_on_demand_waits_until_the_slack_no_longer_covers_waiting() -> None:
    """Issue item 3: behind the uniform-progress line with most of a 24 h slack left, new launches stay on
    spot; on-demand only once the spare slack is down to the reserve."""
    cfg = CoreConfig(price_confirm_s=0.0)
    drv = Driver(State.empty(cfg), now=T0)
    drv(price(A, 10.0, od=30.0))
    drv(JobSubmitted(job_id="j1", spec=spec(nodes=4, nodes_min=4, nodes_max=4, total_steps=24 * 3600,
                                             deadline_ts=T0 + 48 * H)))
    job = drv.job()
    both = frozenset({Market.SPOT, Market.ON_DEMAND})
    # 3 h in, no progress: well behind the line (step 5400), 21 h of slack: still spot only
    assert launch_markets_for(job, 0, cfg, T0 + 3 * H) == frozenset({Market.SPOT})
    # 23 h in, no progress: the spare slack (~40 min) is below the reserve (3 restarts + the expected
    # restarts of 24 h on 4 nodes): on-demand allowed
    assert launch_markets_for(job, 0, cfg, T0 + 23 * H + 1200) == both
