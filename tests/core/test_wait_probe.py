"""A job that waits for capacity (nothing to train on) retries a pool in launch backoff
``CoreConfig.probe_s()`` after the failure that set the backoff, however long the backoff has grown; a
running job's move to another pool waits out the whole backoff. Traced on aws-2023-08-03-v100x4,
aws-2023-04-22-v100 and bamboo-aws-g4dn (``python -m simulations explain``), where orchd paid more than
greedy_spot: after an outage of every zone each pool's backoff had grown to ``backoff_max_s`` (30 min) and
the job sat idle for up to that long after a zone was back, while waiting cost its slack and a failed
launch would have cost it nothing."""

from __future__ import annotations

from orchestrator.core import CoreConfig, JobPhase, State
from orchestrator.core.commands import Launch
from orchestrator.core.feasibility import wake_up
from orchestrator.core.inputs import JobSubmitted, LaunchFailed, NodeLaunched, Tick
from orchestrator.core.placement import retry_at
from tests.core.harness import (
    Driver,
    GenerationStarted,
    cmds,
    pool,
    price,
    spec,
)
from wire import Market
from wire.messages import CheckpointPolicy, FailureReason

A = pool("p4d.24xlarge", "us-east-1a")
A_OD = pool("p4d.24xlarge", "us-east-1a", market=Market.ON_DEMAND)
B = pool("p4d.24xlarge", "us-east-1b")
T0 = 1000.0
H = 3600.0


def _failed_at(drv: Driver, name: str) -> float:
    """When the failure that set the pool's current backoff happened (the backoff is at its cap here)."""
    ps = drv.state.pools[name]
    assert ps.failures >= 6 and ps.backoff_until - ps.changed_ts == drv.state.config.backoff_max_s
    return ps.changed_ts


def test_a_waiting_job_retries_a_pool_in_a_long_backoff_after_probe_s() -> None:
    """Both spot zones are out for 2 h: every launch fails, each pool's backoff grows to 30 minutes.
    Then the job, still waiting, retries each pool ``probe_s`` (5 min) after its last failure - not 30
    minutes later - and ``wake_up`` says so."""
    cfg = CoreConfig(price_confirm_s=0.0)  # 40 h of slack: spot only
    assert cfg.probe_s() < cfg.backoff_max_s
    drv = Driver(State.empty(cfg), now=T0)
    drv(price(A, 11.0, od=30.0))
    drv(price(B, 10.0, od=30.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_min=1, nodes_max=1, total_steps=40 * 3600,
                                                 deadline_ts=T0 + 80 * H, step_time_s_estimate=1.0)))
    drv.fail_launches(cmds(d, Launch))
    outage_end = drv.now + 2 * H
    while drv.now < outage_end:
        drv.fail_launches(cmds(drv(Tick(), dt=60), Launch))
    # from here on every launch the job makes is answered by the test (not failed automatically)
    while drv.state.pools[A.name].backoff_until - drv.state.pools[A.name].changed_ts != cfg.backoff_max_s:
        drv.fail_launches(cmds(drv(Tick(), dt=60), Launch))
    failed_a, until_a = _failed_at(drv, A.name), drv.state.pools[A.name].backoff_until
    job = drv.job()
    assert job.phase == JobPhase.PENDING and not job.nodes
    _, until = wake_up(job, drv.state.pools, cfg, drv.now)
    assert until is not None and until <= failed_a + cfg.probe_s() < until_a
    assert retry_at(drv.state.pools[A.name], cfg, True) == failed_a + cfg.probe_s()
    assert retry_at(drv.state.pools[A.name], cfg, False) == until_a
    tried_a = False
    while not tried_a:
        assert drv.now <= failed_a + cfg.probe_s()
        pending = cmds(drv(Tick(), dt=30), Launch)
        while pending and not tried_a:  # B may come first: fail it, it is A this test watches
            la = pending.pop(0)
            tried_a = la.pool == A
            if not tried_a:
                pending += cmds(drv(LaunchFailed(node_ids=la.node_ids, job_id="j1", pool=la.pool, token=la.token,
                                                 reason=FailureReason.CAPACITY)), Launch)
    assert failed_a + cfg.probe_s() <= drv.now < until_a  # before the backoff ended: a waiting job probes


def test_a_running_job_does_not_move_into_a_pool_before_its_backoff_ends() -> None:
    """A job runs on on-demand in zone A (A's spot has no capacity); B's spot is cheaper, and every
    move there fails until B's backoff is at its cap. The job has a node to train on, so its next move
    to B waits out the whole backoff (``probe_s`` applies to waiting jobs only)."""
    # on-demand at once while spot is away; moves back to spot unbounded (this is about the backoff)
    cfg = CoreConfig(price_confirm_s=0.0, progress_line=False, spot_returns_per_h=1e9)
    drv = Driver(State.empty(cfg), now=T0)
    drv(price(A, 35.0, od=30.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_min=1, nodes_max=1, total_steps=40 * 3600,
                                                 deadline_ts=T0 + 80 * H, step_time_s_estimate=1.0)))
    (la,) = cmds(d, Launch)
    assert la.pool == A_OD
    (nid,) = drv.launched(d)
    drv.register([nid])
    drv(GenerationStarted(id="g1", node_id=nid, job_id="j1", generation=1, first_step=1, ts=drv.now))
    drv.heartbeat(nid, 1, 1)
    assert drv.job().phase == JobPhase.RUNNING
    drv(price(B, 10.0, od=30.0))
    step = 1
    while not (drv.state.pools.get(B.name) and drv.state.pools[B.name].failures >= 6
               and drv.state.pools[B.name].backoff_until - drv.state.pools[B.name].changed_ts == cfg.backoff_max_s):
        step += 60
        drv.heartbeat(nid, 1, step)
        drv.fail_launches(cmds(drv(Tick(), dt=60), Launch))
        assert drv.now < T0 + 6 * H
    failed_b, until_b = _failed_at(drv, B.name), drv.state.pools[B.name].backoff_until
    moves: list[Launch] = []
    while not moves:
        step += 60
        drv.heartbeat(nid, 1, step)
        moves = [la for la in cmds(drv(Tick(), dt=60), Launch) if la.pool == B]
        assert drv.job().phase == JobPhase.RUNNING and nid in drv.job().nodes
    assert drv.now >= until_b > failed_b + cfg.probe_s()


def test_many_waiting_jobs_send_one_probe_and_follow_its_success() -> None:
    """Three jobs wait for the one spot pool, whose backoff has grown to its cap. Its retry
    (``probe_s`` after the last failure) is one launch of one job, not one per waiting job; while it is
    out the others do not launch there, and once it succeeds (``NodeLaunched``: the backoff ends) they
    launch at the next Tick."""
    cfg = CoreConfig(price_confirm_s=0.0)
    drv = Driver(State.empty(cfg), now=T0)
    drv(price(A, 10.0, od=30.0))
    launches: list[Launch] = []
    for j in ("j1", "j2", "j3"):
        ckpt = CheckpointPolicy(url=f"file:///ckpt/{j}", save_s_estimate=20.0)
        launches += cmds(drv(JobSubmitted(job_id=j, spec=spec(nodes=1, nodes_min=1, nodes_max=1, total_steps=40 * 3600,
                                                               deadline_ts=T0 + 80 * H, step_time_s_estimate=1.0,
                                                               checkpoint=ckpt))), Launch)
    assert sorted(la.job_id for la in launches) == ["j1", "j2", "j3"]
    drv.fail_launches(launches)
    while drv.state.pools[A.name].backoff_until - drv.state.pools[A.name].changed_ts != cfg.backoff_max_s:
        drv.fail_launches(cmds(drv(Tick(), dt=60), Launch))
    last_failure = drv.state.pools[A.name].changed_ts
    probes: list[Launch] = []
    while not probes:
        probes = cmds(drv(Tick(), dt=30), Launch)
    assert len(probes) == 1 and drv.now < drv.state.pools[A.name].backoff_until
    assert last_failure + cfg.probe_s() <= drv.now
    (probe,) = probes
    for _ in range(8):  # the probe is out for 4 minutes: nobody else tries the pool
        assert cmds(drv(Tick(), dt=30), Launch) == []
    (nid,) = probe.node_ids
    drv(NodeLaunched(node_id=nid, job_id=probe.job_id, instance_id="i-probe", pool=A, token=probe.token))
    assert drv.state.pools[A.name].backoff_until <= drv.now and drv.state.pools[A.name].failures == 0
    followers = cmds(drv(Tick(), dt=5), Launch)
    assert sorted(la.job_id for la in followers) == sorted({"j1", "j2", "j3"} - {probe.job_id})
    assert all(la.pool == A for la in followers)
