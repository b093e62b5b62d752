"""The deadline safety net in time and the price of leaving on-demand (core/safety.py, policy.py): one
constructed case per mechanism found by an independent simulator that acts every 10 minutes and gives no
notices. Each failed on the core before the net was in time (a margin of 3 restarts: below one decision
step with short restarts), before moves back to spot were bounded and priced, and before a job fleeing a
reclaim looked at the pools' recent losses."""

from __future__ import annotations

import msgspec

from orchestrator.core import CoreConfig, JobPhase, State
from orchestrator.core.commands import Launch
from orchestrator.core.inputs import JobSubmitted, LaunchFailed, Tick
from orchestrator.core.pricing import restart_loss_s, spare_slack_s
from orchestrator.core.safety import detect_s
from tests.core.harness import (
    AgentState,
    Driver,
    GenerationStarted,
    Heartbeat,
    cmds,
    pool,
    price,
    spec,
)
from wire import CheckpointPolicy, Market, MarketPolicy
from wire.messages import CheckpointCommitted, FailureReason, PreemptionNotice

A = pool("p4d.24xlarge", "us-east-1a")
A_OD = pool("p4d.24xlarge", "us-east-1a", market=Market.ON_DEMAND)
B = pool("p4d.24xlarge", "us-east-1b")
C = pool("p4d.24xlarge", "us-east-1c")
T0 = 1000.0
H = 3600.0
STEP_WORLD = dict(price_confirm_s=0.0, decision_interval_s=600.0, restart_overhead_s=60.0, boot_s_estimate=60.0)


def _start(drv: Driver, ids: list[str], gen: int, step: int, job: str = "j1") -> None:
    for nid in ids:
        drv(GenerationStarted(id=f"g{gen}-{nid}", node_id=nid, job_id=job, generation=gen, first_step=step + 1,
                              ts=drv.now))
        drv(Heartbeat(node_id=nid, seq=gen * 1000 + int(drv.now), ts=drv.now, state=AgentState.TRAINING,
                      job_id=job, generation=gen, step=step + 1, step_time_s=1.0))


def _commit(drv: Driver, nid: str, gen: int, step: int) -> None:
    drv(CheckpointCommitted(id=f"c{step}", node_id=nid, job_id="j1", generation=gen, step=step,
                            checkpoint_id=f"s{step}", url=f"file:///ckpt/j1/s{step}", save_s=5.0, ts=drv.now))


def _spot_job(drv: Driver, *, total: int, deadline_s: float, nodes: int = 1) -> list[str]:
    drv(price(A, 10.0, od=30.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=nodes, nodes_min=nodes, nodes_max=nodes, total_steps=total,
                                                 deadline_ts=T0 + deadline_s, step_time_s_estimate=1.0)))
    (la,) = cmds(d, Launch)
    assert la.pool == A, la
    ids = drv.launched(d)
    drv.register(ids)
    _start(drv, ids, 1, 0)
    assert drv.job().phase == JobPhase.RUNNING
    return ids


def test_the_margin_is_time_and_covers_one_decision_step() -> None:
    """Item 1: short restarts (2 min estimated), decisions every 10 minutes. The spare slack (deadline - now
    - the work left - one restart) is the 3-restart margin + 100 s: enough for the old rule. Losing spot
    just before the next decision would cost the 10 minutes, the detection and the work since the last
    commit: more than the slack. The net takes on-demand now."""
    cfg = CoreConfig(progress_line=False, **STEP_WORLD)
    drv = Driver(State.empty(cfg), now=T0)
    total = 40_000
    (nid,) = _spot_job(drv, total=total, deadline_s=total + 2 * H)  # on spot with 2 h of slack
    restart = restart_loss_s(drv.job(), cfg)
    margin = cfg.margin_restarts() * restart
    _commit(drv, nid, 1, 1)
    drv.now = T0 + 2 * H - restart - margin - 100.0  # the job made no progress since: the slack shrank
    assert margin < cfg.decision_s()  # the old margin is below one decision step
    _commit(drv, nid, 1, 1)
    drv.heartbeat(nid, 1, 1)
    spare = spare_slack_s(drv.job(), 1, cfg, drv.now)
    assert spare is not None and spare >= margin  # the old rule: stay on spot
    # the worst case the old rule let through: lost at the step's end, detected, the work redone
    assert spare < cfg.decision_s() + detect_s(cfg)
    d = drv(Tick())
    (fb,) = [a for a in d.audit if a.action == "on_demand_fallback"]
    assert fb.details["decision_s"] == 600.0 and drv.job().force_on_demand
    assert [la.pool for la in cmds(d, Launch)] == [A_OD]


def _od_job_with_spot_elsewhere(cfg: CoreConfig, *, total: int, deadline_s: float) -> tuple[Driver, str]:
    drv = Driver(State.empty(cfg), now=T0)
    drv(price(A, 35.0, od=30.0))  # A's spot has no capacity: on-demand
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_min=1, nodes_max=1, total_steps=total,
                                                 deadline_ts=T0 + deadline_s, step_time_s_estimate=1.0)))
    (la,) = cmds(d, Launch)
    assert la.pool == A_OD
    (nid,) = drv.launched(d)
    drv.register([nid])
    _start(drv, [nid], 1, 0)
    drv(price(B, 8.0, od=30.0))  # spot in zone B, far cheaper
    return drv, nid


def test_moves_back_to_spot_are_bounded_per_hour() -> None:
    """Item 2: on on-demand with a day of slack, a cheaper spot pool in zone B that fails every launch
    (its capacity flickers). Evaluated every minute without a cooldown, the job kept trying to go back
    (one try per backoff: 60, 120, 240 ... s): now one move back per hour, recorded with its saving."""
    cfg = CoreConfig(progress_line=False, price_confirm_s=0.0, migrate_cooldown_s=0.0, price_eval_interval_s=60.0)
    drv, nid = _od_job_with_spot_elsewhere(cfg, total=20 * 3600, deadline_s=48 * H)
    tries = 0
    for k in range(1, 61):
        drv.heartbeat(nid, 1, 60 * k)
        d = drv(Tick(), dt=60.0)
        moves = [la for la in cmds(d, Launch) if la.pool == B]
        tries += len(moves)
        drv.fail_launches(moves)
    assert tries == 1, tries
    (ret,) = [a for dd in drv.decisions for a in dd.audit if a.action == "spot_return"]
    assert float(ret.details["saving_usd"]) > float(ret.details["move_usd"])  # type: ignore[arg-type]
    assert isinstance(drv.job().spot_returns, tuple) and len(drv.job().spot_returns) == 1


def test_leaving_on_demand_needs_the_slack_for_the_move_and_the_net() -> None:
    """Item 3: on on-demand (spot was away) with 40 minutes of slack, spot returns cheap in zone B.
    The saving is large, but after the move's restart and the net (a decision step, detection and a spot
    checkpoint interval at risk) nothing would be left: the job stays on on-demand instead of going back to
    spot and being preempted into a miss."""
    cfg = CoreConfig(price_confirm_s=0.0, migrate_cooldown_s=0.0, price_eval_interval_s=60.0, progress_line=False)
    total = 10 * 3600
    drv, nid = _od_job_with_spot_elsewhere(cfg, total=total, deadline_s=total + 40 * 60)
    for k in range(1, 31):
        drv.heartbeat(nid, 1, 60 * k)
        d = drv(Tick(), dt=60.0)
        assert not [la for la in cmds(d, Launch) if la.pool == B], k
    assert not any(a.action in ("spot_return", "migrate") for dd in drv.decisions for a in dd.audit)


def test_a_job_fleeing_a_reclaim_does_not_move_into_a_pool_being_reclaimed() -> None:
    """Item 5: zone B (the cheapest) had a notice 5 minutes ago (another job's node there); zone A is
    reclaimed now. The spot job's replacement goes to zone C, not B."""
    cfg = CoreConfig(price_confirm_s=0.0, progress_line=False)
    drv = Driver(State.empty(cfg), now=T0)
    drv(price(B, 2.0, od=30.0))  # far cheaper than C even with the penalty of a recent preemption
    drv(price(C, 9.0, od=30.0))
    d = drv(JobSubmitted(job_id="j2", spec=spec(nodes=1, nodes_min=1, nodes_max=1, total_steps=10**6,
                                                 step_time_s_estimate=1.0, zones=("us-east-1b",),
                                                 checkpoint=CheckpointPolicy(url="file:///ckpt/j2"))))
    (other,) = drv.launched(d)
    drv.register([other])
    _start(drv, [other], 1, 0, job="j2")
    drv(price(A, 1.0, od=30.0))  # A is cheapest now: j1 lands there
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_min=1, nodes_max=1, total_steps=10**6,
                                                 step_time_s_estimate=1.0, market=MarketPolicy.SPOT)))
    (la,) = cmds(d, Launch)
    assert la.pool == A
    ids = drv.launched(d)
    drv.register(ids)
    _start(drv, ids, 1, 0)
    drv(PreemptionNotice(id="n-other", node_id=other, cloud="aws", deadline_ts=drv.now + 120, observed_ts=drv.now),
        dt=10.0)
    drv.now += 300.0
    d = drv(PreemptionNotice(id="n1", node_id=ids[0], cloud="aws", deadline_ts=drv.now + 120, observed_ts=drv.now))
    (la,) = cmds(d, Launch)
    assert la.pool == C, la
    ps = drv.state.pools[msgspec.structs.replace(B, market=Market.SPOT).name]
    assert ps.last_preempted_ts is not None and drv.now - ps.last_preempted_ts < cfg.reclaim_s()


def test_a_failed_on_demand_launch_puts_the_deadline_at_risk_and_tries_other_on_demand_pools() -> None:
    """The net relies on on-demand: when a deadline job's on-demand launch fails, the audit says the
    guarantee is at risk (orchd_deadline_at_risk_total, alert OrchdDeadlineAtRisk) and the job launches into
    another on-demand pool at once (the failed one is in backoff)."""
    cfg = CoreConfig(price_confirm_s=0.0, progress_line=False)
    drv = Driver(State.empty(cfg), now=T0)
    drv(price(A, 35.0, od=30.0))  # no spot capacity anywhere: on-demand
    drv(price(B, 36.0, od=31.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_min=1, nodes_max=1, total_steps=10_000,
                                                 deadline_ts=T0 + 20_000, step_time_s_estimate=1.0)))
    (la,) = cmds(d, Launch)
    assert la.pool == A_OD
    d = drv(LaunchFailed(node_ids=la.node_ids, job_id="j1", pool=la.pool, token=la.token,
                         reason=FailureReason.CAPACITY))
    (risk,) = [a for a in d.audit if a.action == "deadline_at_risk"]
    assert risk.reason == "on_demand_launch_failed" and risk.details["pool"] == A_OD.name
    (again,) = cmds(d, Launch)
    assert again.pool == msgspec.structs.replace(B, market=Market.ON_DEMAND)



def test_replicas_cap_the_work_at_risk_only_when_a_zone_loss_leaves_a_copy() -> None:
    """Shard replicas bound a node's loss to k + 1 steps, but a spot reclaim takes every node a job has in
    the zone: where the buddies share it, both copies of a shard go and the job resumes from its durable
    checkpoint. The net counts the work since that checkpoint unless every node's buddy is in another zone."""
    from orchestrator.core.model import Job
    from orchestrator.core.replicas import zone_loss_covered
    from orchestrator.core.safety import at_risk_s
    from wire import JobId, JobSpec

    ckpt = CheckpointPolicy(url="file:///ckpt/j1", replica_every=1)
    job = Job(job_id=JobId("j1"), spec=JobSpec(name="j", total_steps=1000, gpu_type="A100", nodes=4, checkpoint=ckpt),
              phase_ts=0.0, submitted_ts=0.0, target_nodes=4, replica_secret="s" * 64)
    one_zone = [pool(zone="us-east-1a")] * 4
    two_zones = [pool(zone=z) for z in ("us-east-1a", "us-east-1b", "us-east-1a", "us-east-1b")]
    lopsided = [pool(zone=z) for z in ("us-east-1a", "us-east-1a", "us-east-1a", "us-east-1b")]
    assert not zone_loss_covered(one_zone) and zone_loss_covered(two_zones) and not zone_loss_covered(lopsided)
    since_commit = at_risk_s(job, 500, 100, 1.0)  # 400 steps since the durable checkpoint
    assert since_commit == 400.0
    for members in (one_zone, lopsided):
        assert at_risk_s(job, 500, 100, 1.0, members=members) == 400.0
    assert at_risk_s(job, 500, 100, 1.0, members=two_zones) == 2.0  # k + 1
