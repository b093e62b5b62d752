"""Policy fixes found by tracing single jobs of the results table (``python -m simulations explain``; the
aws-2023-04-22-v100 family, where orchd paid more than greedy_spot): a job that reaches on-demand while
spot is away is not locked onto on-demand by the work its on-demand node has not saved yet, and goes back
to spot once the slack covers a spot checkpoint interval; a price migration to another zone whose launch
fails leaves the job in its zone, on its running node, free to try the next pool. On gcp-2023-04-30-c3
(orchd a hair above greedy_spot): a notice that comes before the launch's confirmation is acted on. On
aws-2022-v100x8 (16-node jobs above uniform_progress): a reclaim of a multi-node job's pool is replaced by
one launch request with the last of its notices, not one request per notice. On aws-2023-04-22-v100 again
(orchd idle while a zone was back): a pool's launch backoff counts one run of failures, not every failure
since its last successful launch."""

from __future__ import annotations

from orchestrator.core import CoreConfig, JobPhase, State
from orchestrator.core.commands import Launch, Terminate
from orchestrator.core.inputs import JobSubmitted, LaunchFailed, NodeLaunched, Tick
from orchestrator.core.placement import zone_of
from tests.core.harness import (
    AgentState,
    Driver,
    GenerationStarted,
    Heartbeat,
    NodeRegistered,
    StartGenerationCmd,
    cmds,
    pool,
    price,
    spec,
)
from wire import Market
from wire.messages import FailureReason, PreemptionNotice

A = pool("p4d.24xlarge", "us-east-1a")
A_OD = pool("p4d.24xlarge", "us-east-1a", market=Market.ON_DEMAND)
B = pool("p4d.24xlarge", "us-east-1b")
B_OD = pool("p4d.24xlarge", "us-east-1b", market=Market.ON_DEMAND)
T0 = 1000.0
H = 3600.0


def _start(drv: Driver, ids: list[str], gen: int, step: int, step_time: float) -> None:
    for nid in ids:
        drv(GenerationStarted(id=f"g{gen}-{nid}", node_id=nid, job_id="j1", generation=gen, first_step=step + 1,
                              ts=drv.now))
        drv(Heartbeat(node_id=nid, seq=gen * 1000, ts=drv.now, state=AgentState.TRAINING, job_id="j1",
                      generation=gen, step=step + 1, step_time_s=step_time))


def _on_demand_job(drv: Driver, *, total_steps: int, deadline_s: float) -> str:
    """A 1-node job on on-demand in zone A (its spot is priced at on-demand: no capacity)."""
    drv(price(A, 35.0, od=30.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_min=1, nodes_max=1, total_steps=total_steps,
                                                 deadline_ts=T0 + deadline_s, step_time_s_estimate=1.0)))
    (la,) = cmds(d, Launch)
    assert la.pool == A_OD
    (nid,) = drv.launched(d)
    drv.register([nid])
    _start(drv, [nid], 1, 0, 1.0)
    assert drv.job().phase == JobPhase.RUNNING
    return nid


def test_unsaved_work_on_on_demand_does_not_force_on_demand_for_good() -> None:
    """A job on on-demand (checkpoint interval: the long on-demand one) with ~1.9 h of spare slack trains
    2 h without a commit. That work is not at risk of a preemption: the deadline fallback must not fire
    (before the fix it did, and ``force_on_demand`` then stayed set until the end: the job could never go
    back to spot when spot returned). ``progress_line`` off: on-demand at once (spot has no capacity)."""
    cfg = CoreConfig(price_confirm_s=0.0, progress_line=False)
    drv = Driver(State.empty(cfg), now=T0)
    total = 20 * 3600
    od = _on_demand_job(drv, total_steps=total, deadline_s=total + 2 * H)
    assert (drv.job().ckpt_interval_s or 0.0) >= 2 * H  # the on-demand interval: no periodic commit here
    start = drv.now
    for k in range(1, 25):  # 2 h in 5-minute steps, 1 step per second, nothing committed
        drv.now = start + k * 300.0
        drv.heartbeat(od, 1, k * 300)
        d = drv(Tick())
        assert not any(a.action == "on_demand_fallback" for a in d.audit), k
    assert not drv.job().force_on_demand


def test_a_forced_job_on_on_demand_goes_back_to_spot_with_a_spot_interval_of_slack() -> None:
    """The step time was estimated at 2 s: the deadline is out of reach on spot, so the first launch is
    on-demand (the safety net) and the next Tick forces it. The trainer then reports 1 s steps: ~1.9 h of
    spare slack, which covers the move's restart and the net with a spot checkpoint interval at risk (not
    the 4 h on-demand interval the job runs with): back to spot, recorded with the slack after the move."""
    cfg = CoreConfig(price_confirm_s=0.0)
    drv = Driver(State.empty(cfg), now=T0)
    drv(price(A, 10.0, od=30.0))
    total = 20000
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_min=1, nodes_max=1, total_steps=total,
                                                 deadline_ts=T0 + total + 2 * H, step_time_s_estimate=2.0)))
    (la,) = cmds(d, Launch)
    assert la.pool == A_OD
    (od,) = drv.launched(d)
    drv.register([od])
    _start(drv, [od], 1, 0, 2.0)
    drv(Tick(), dt=5)
    assert (drv.job().ckpt_interval_s or 0.0) >= 2 * H and drv.job().force_on_demand
    drv.heartbeat(od, 1, 10, step_time=1.0)
    d = drv(Tick(), dt=5)
    (again,) = [a for a in d.audit if a.action == "spot_again"]
    assert float(again.details["slack_after_move_s"]) >= 0, again  # type: ignore[arg-type]
    assert not drv.job().force_on_demand


def test_a_failed_move_to_another_zone_keeps_the_job_in_its_zone() -> None:
    """On on-demand in zone A, a cheaper spot pool appears in zone B: the job moves (make before break);
    the spot launch fails for capacity. The job must stay in zone A on its on-demand node (before the fix
    its zone stayed B: the node in A was terminated as unusable and replaced by an on-demand node in B,
    a move across zones on on-demand), and the next evaluation may try again (no migration cooldown for a
    move that never happened)."""
    cfg = CoreConfig(price_confirm_s=0.0, progress_line=False)
    drv = Driver(State.empty(cfg), now=T0)
    od = _on_demand_job(drv, total_steps=40 * 3600, deadline_s=80 * H)
    drv(price(B, 10.0, od=30.0, ts=drv.now), dt=5)
    drv.heartbeat(od, 1, 100)
    d = drv(Tick(), dt=cfg.price_eval_interval_s)
    assert any(a.action == "migrate" for a in d.audit), [a.action for a in d.audit]
    (la,) = cmds(d, Launch)
    assert la.pool == B and drv.job().zone == zone_of(B)
    d = drv(LaunchFailed(node_ids=la.node_ids, job_id="j1", pool=B, token=la.token, reason=FailureReason.CAPACITY))
    assert any(a.action == "migrate_abandoned" for dd in drv.decisions[-2:] for a in dd.audit)
    job = drv.job()
    assert job.zone == zone_of(A_OD) and job.avoid_pools == () and job.migrate_ts is None
    for i in range(5):
        drv.heartbeat(od, 1, 200 + i)
        d = drv(Tick(), dt=5)
        assert od not in [t.node_id for t in cmds(d, Terminate)]
        assert B_OD not in [c.pool for c in cmds(d, Launch)]
    assert od in drv.state.nodes and drv.job().phase == JobPhase.RUNNING


def test_a_notice_before_the_launch_is_confirmed_drops_the_node_and_closes_its_pool() -> None:
    """A spot node in zone A gets a notice; the replacement goes to zone B, whose capacity is reclaimed at
    the same moment: B's notice for the new node comes before its NodeLaunched (the node is still
    REQUESTED). Before the fix the core ignored that notice ("not launched"), started the next
    generation on the doomed node and launched into B again; now the node is terminated at once, B is
    closed like any noticed pool (the next launch goes elsewhere), and the late NodeLaunched and
    registration of that instance start nothing."""
    cfg = CoreConfig(price_confirm_s=0.0)  # 40 h of slack: spot only
    drv = Driver(State.empty(cfg), now=T0)
    drv(price(A, 10.0, od=30.0))
    drv(price(B, 11.0, od=30.0))
    c = pool("p4d.24xlarge", "us-east-1c")
    drv(price(c, 12.0, od=30.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_min=1, nodes_max=1, total_steps=40 * 3600,
                                                 deadline_ts=T0 + 80 * H, step_time_s_estimate=1.0)))
    (a_node,) = drv.launched(d)
    drv.register([a_node])
    _start(drv, [a_node], 1, 0, 1.0)
    d = drv(PreemptionNotice(id="na", node_id=a_node, cloud="aws", deadline_ts=drv.now + 120, observed_ts=drv.now),
            dt=60)
    (la,) = cmds(d, Launch)
    assert la.pool == B
    (b_node,) = la.node_ids
    d = drv(PreemptionNotice(id="nb", node_id=b_node, cloud="aws", deadline_ts=drv.now + 120, observed_ts=drv.now))
    assert b_node in [t.node_id for t in cmds(d, Terminate)], [a.action for a in d.audit]
    assert b_node not in drv.state.nodes
    assert drv.state.pools[B.name].noticed_until > drv.now
    assert [la.pool for la in cmds(d, Launch)] == [c]
    d = drv(NodeLaunched(node_id=b_node, job_id="j1", instance_id="i-b", pool=B, token=la.token))
    assert [t.instance_id for t in cmds(d, Terminate)] == ["i-b"] and b_node not in drv.state.nodes
    d = drv(NodeRegistered(id="r-b", node_id=b_node, host="10.0.0.9", ts=drv.now), dt=30)
    assert not cmds(d, StartGenerationCmd) and b_node not in drv.job().gen_nodes


def _four_node_job_on_spot(drv: Driver) -> list[str]:
    """A 4-node job on spot in zone A; ``progress_line`` off: on-demand in zone A replaces lost spot."""
    drv(price(A, 10.0, od=30.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=4, nodes_min=4, nodes_max=4, total_steps=40 * 3600,
                                                 deadline_ts=T0 + 80 * H, step_time_s_estimate=1.0)))
    (la,) = cmds(d, Launch)
    assert la.pool == A
    ids = drv.launched(d)
    drv.register(ids)
    _start(drv, ids, 1, 0, 1.0)
    assert drv.job().phase == JobPhase.RUNNING and len(drv.job().gen_nodes) == 4
    return ids


def _notice(drv: Driver, nid: str) -> list[Launch]:
    d = drv(PreemptionNotice(id=f"n-{nid}", node_id=nid, cloud="aws", deadline_ts=drv.now + 120, observed_ts=drv.now))
    return cmds(d, Launch)


def test_a_reclaim_of_a_multi_node_job_is_replaced_in_two_requests_not_one_per_notice() -> None:
    """The zone reclaims all 4 spot nodes: 4 notices in the same second. The first is replaced at once (one
    on-demand node in the zone), the other three together with the last notice, in one request (before the
    fix: one request per notice, and the next generation waited for the slowest of four launches)."""
    drv = Driver(State.empty(CoreConfig(price_confirm_s=0.0, progress_line=False)), now=T0)
    ids = _four_node_job_on_spot(drv)
    drv.now += 60
    (first,) = _notice(drv, ids[0])
    assert first.pool == A_OD and len(first.node_ids) == 1
    for nid in ids[1:-1]:
        assert _notice(drv, nid) == []
    (rest,) = _notice(drv, ids[-1])
    assert rest.pool == A_OD and len(rest.node_ids) == 3
    assert drv.job().phase == JobPhase.CHECKPOINTING


def test_a_reclaim_that_stops_short_is_replaced_at_the_next_tick() -> None:
    """Two nodes of four get a notice, the others none: the second one's replacement waits for no other
    notice beyond the next Tick (the job is never left short of a launch)."""
    drv = Driver(State.empty(CoreConfig(price_confirm_s=0.0, progress_line=False)), now=T0)
    ids = _four_node_job_on_spot(drv)
    drv.now += 60
    assert len(_notice(drv, ids[0])) == 1
    assert _notice(drv, ids[1]) == []
    d = drv(Tick(), dt=5)
    assert [(la.pool, len(la.node_ids)) for la in cmds(d, Launch)] == [(A_OD, 1)]


def test_a_capacity_error_hours_after_a_pools_last_failures_backs_off_from_the_start() -> None:
    """Both spot zones are out for 2 h (every launch fails: each pool's backoff grows to ``backoff_max_s``),
    then B has room and the job runs there for 5 h, never trying A. B's notice sends the replacement to A,
    which fails once (a capacity error). A's failures of 5 h ago are not a run of failures with this one:
    A backs off ``backoff_base_s`` and is tried again a minute later. Before the fix its count never
    started over: 30 minutes for one error, while the job waited (traced on aws-2023-04-22-v100, 48/72 h:
    orchd idle with a zone back, every such zone in a 30-minute backoff)."""
    cfg = CoreConfig(price_confirm_s=0.0)  # 40 h of slack: spot only
    drv = Driver(State.empty(cfg), now=T0)
    drv(price(A, 11.0, od=30.0))
    drv(price(B, 10.0, od=30.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_min=1, nodes_max=1, total_steps=40 * 3600,
                                                 deadline_ts=T0 + 80 * H, step_time_s_estimate=1.0)))
    drv.fail_launches(cmds(d, Launch))
    outage_end = drv.now + 2 * H
    while drv.now < outage_end:
        drv.fail_launches(cmds(drv(Tick(), dt=60), Launch))
    pools = drv.state.pools
    assert pools[A.name].failures >= 5 and pools[A.name].backoff_until - pools[A.name].changed_ts == cfg.backoff_max_s
    while not (launches := cmds(drv(Tick(), dt=60), Launch)) or launches[0].pool != B:
        drv.fail_launches(launches)
    (b_node,) = drv.launched(drv.decisions[-1])
    drv.register([b_node])
    _start(drv, [b_node], 1, 0, 1.0)
    for k in range(1, 61):  # 5 h on B
        drv.heartbeat(b_node, 1, k * 300)
        drv(Tick(), dt=300)
    assert drv.job().phase == JobPhase.RUNNING and drv.state.pools[A.name].failures >= 5
    d = drv(PreemptionNotice(id="nb", node_id=b_node, cloud="aws", deadline_ts=drv.now + 120, observed_ts=drv.now))
    (la,) = cmds(d, Launch)
    assert la.pool == A
    drv(LaunchFailed(node_ids=la.node_ids, job_id="j1", pool=A, token=la.token, reason=FailureReason.CAPACITY))
    a = drv.state.pools[A.name]
    assert (a.failures, a.backoff_until - drv.now) == (1, cfg.backoff_base_s)
    d = drv(Tick(), dt=cfg.backoff_base_s + 1)
    assert [la.pool for la in cmds(d, Launch)] == [A]
