"""Attacks on the waiting job's probe of a pool in launch backoff (``placement.retry_at`` /
``PoolStats.probe_until``): a paused job sleeping past a backoff's end, ``wake_up`` losing it, and a
probe time of 0 relaunching into the pool that just failed were faults (each test failed before its
fix); the rest check what was found sound (an unanswered probe, a cancelled prober, forged launches,
random runs keeping the timer index complete)."""

from __future__ import annotations

import random

from orchestrator.core import CoreConfig, JobPhase, State, decide
from orchestrator.core.commands import Launch
from orchestrator.core.inputs import JobCancelled, JobSubmitted, LaunchFailed, NodeLaunched, Tick
from orchestrator.core.timers import POOLS
from tests.core.harness import (
    CheckpointCommitted,
    Driver,
    GenerationStarted,
    RanksExited,
    cmds,
    pool,
    price,
    spec,
)
from wire import CheckpointCmd, MarketPolicy, NodeRegistered
from wire.messages import CheckpointPolicy, FailureReason

A = pool("p4d.24xlarge", "us-east-1a")
B = pool("p4d.24xlarge", "us-east-1b")


def _fresh(s: State) -> State:
    """The same records with no index (the full scan)."""
    return State(s.jobs, s.nodes, s.pools, s.meta)


def test_a_paused_job_wakes_when_a_backoff_ends_after_the_probe_time_passed() -> None:
    """A job paused for price sleeps under POOLS. B (cheap) is in a 600 s launch backoff from another
    job's failure. ``_resume`` ranks without ``waiting``, so B becomes a resume target only at the end
    of its backoff; but ``tick._maybe_sleep`` takes the wake-up time from ``retry_at(ps, cfg, True)``,
    which is ``probe_s`` (300 s) after the failure - once that has passed it is dropped (``t > now``) and
    B's real reopening (``backoff_until``) is in no wake-up time: the paused job sleeps past it (here for
    good: nothing else writes a pool). A full scan (fresh index) resumes it when B reopens."""
    cfg = CoreConfig(price_confirm_s=0.0, backoff_base_s=600.0)
    assert cfg.probe_s() < cfg.backoff_base_s
    drv = Driver(State.empty(cfg))
    drv(price(A, 10.0))
    drv(price(B, 12.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_max=1, market=MarketPolicy.SPOT)))
    (la,) = cmds(d, Launch)
    assert la.pool == A
    ids = drv.launched(d)
    drv.register(ids)
    drv(GenerationStarted(id="g", node_id=ids[0], job_id="j1", generation=1, first_step=1, ts=drv.now), dt=1)
    assert drv.job().phase == JobPhase.RUNNING
    # another job fails in B and is cancelled: B is in backoff until t_f + 600, no one waits for it
    ck2 = CheckpointPolicy(url="file:///ckpt/j2", save_s_estimate=20.0)
    d = drv(JobSubmitted(job_id="j2", spec=spec(nodes=1, nodes_max=1, market=MarketPolicy.SPOT, zones=["us-east-1b"],
                                                 checkpoint=ck2)))
    (lb,) = cmds(d, Launch)
    assert lb.pool == B
    drv(LaunchFailed(node_ids=lb.node_ids, job_id="j2", pool=B, token=lb.token, reason=FailureReason.CAPACITY))
    t_f = drv.now
    drv(JobCancelled(job_id="j2", reason="test"))
    # A's price rises above the pause ratio; B is in backoff: j1 pauses
    drv(price(A, 29.0))
    d = drv(Tick(), dt=1)
    assert cmds(d, CheckpointCmd)[0].reason == "price_pause"
    drv(CheckpointCommitted(id="c", node_id=ids[0], job_id="j1", generation=1, step=50, checkpoint_id="s50",
                            url="u50", save_s=5.0, ts=drv.now))
    drv(RanksExited(id="x", node_id=ids[0], job_id="j1", generation=1, exit_code=75,
                    reason="emergency_checkpoint", last_step=50, ts=drv.now))
    assert drv.job().phase == JobPhase.PAUSED and not drv.state.nodes
    resumed_fresh = None
    while drv.now < t_f + 900:
        ref = decide(_fresh(drv.state), Tick(), drv.now + 10)
        if resumed_fresh is None and ref.state.jobs["j1"].phase != JobPhase.PAUSED:
            resumed_fresh = drv.now + 10
        drv(Tick(), dt=10)
        if drv.job().phase != JobPhase.PAUSED:
            break
        if t_f + cfg.probe_s() < drv.now < t_f + cfg.backoff_base_s:
            assert drv.state.timers is not None and drv.state.timers.asleep.get("j1") == POOLS
    assert resumed_fresh is not None and resumed_fresh <= t_f + 620  # a full scan resumes it when B reopens
    assert drv.job().phase != JobPhase.PAUSED, "the paused job slept past B's reopening"
    assert drv.now <= t_f + 620


def test_wake_up_keeps_the_end_of_a_backoff_once_the_probe_time_passed() -> None:
    """``feasibility.wake_up`` (orchctl jobs show: ``waiting.until``) for a job that is not waiting for
    capacity - a RESIZING job that trains on ``nodes_min`` nodes waits out the whole backoff - must still
    name the end of B's backoff after B's probe time (``retry_at(.., True)``) has passed; it named no time
    at all."""
    import msgspec

    from orchestrator.core.feasibility import wake_up

    cfg = CoreConfig(price_confirm_s=0.0, backoff_base_s=600.0)
    drv = Driver(State.empty(cfg))
    drv(price(B, 12.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=2, nodes_min=1, nodes_max=2, market=MarketPolicy.SPOT)))
    (lb,) = cmds(d, Launch)
    drv(LaunchFailed(node_ids=lb.node_ids, job_id="j1", pool=B, token=lb.token, reason=FailureReason.CAPACITY))
    until = drv.state.pools[B.name].backoff_until
    job = msgspec.structs.replace(drv.job(), phase=JobPhase.RESIZING)
    now = drv.now + cfg.probe_s() + 100  # past the probe time, before the backoff ends
    assert now < until
    _, t = wake_up(job, drv.state.pools, cfg, now)
    assert t is not None and t <= until


class Twin(Driver):
    """A Driver that decides every event twice - with the kept index and with a fresh one (the full
    scan) - and requires the same decision: a sleeper the index misses shows as a difference."""

    def __call__(self, event, dt: float = 0.0):  # type: ignore[no-untyped-def]
        from orchestrator.core import state_to_records

        ref = decide(_fresh(self.state), event, self.now + dt)
        d = super().__call__(event, dt)
        assert d.commands == ref.commands, (event, self.now, d.commands, ref.commands)
        assert state_to_records(d.state) == state_to_records(ref.state), (event, self.now)
        return d


def _capped(cfg: CoreConfig, n: int = 3) -> tuple[Twin, list[str]]:
    """``n`` spot jobs waiting for A, whose backoff has grown to its cap (every launch failed)."""
    drv = Twin(State.empty(cfg), now=1000.0)
    drv(price(A, 10.0))
    launches: list[Launch] = []
    jobs = [f"j{i}" for i in range(1, n + 1)]
    for j in jobs:
        ck = CheckpointPolicy(url=f"file:///ckpt/{j}", save_s_estimate=20.0)
        launches += cmds(drv(JobSubmitted(job_id=j, spec=spec(nodes=1, nodes_max=1, market=MarketPolicy.SPOT,
                                                               checkpoint=ck))), Launch)

    drv.fail_launches(launches)
    while drv.state.pools[A.name].backoff_until - drv.state.pools[A.name].changed_ts != cfg.backoff_max_s:
        drv.fail_launches(cmds(drv(Tick(), dt=60), Launch))
    return drv, jobs


def _until_launch(drv: Driver, limit: float, dt: float = 10.0) -> list[Launch]:
    out: list[Launch] = []
    while not out and drv.now < limit:
        out = cmds(drv(Tick(), dt=dt), Launch)
    return out


def test_a_probe_that_is_never_answered_does_not_strand_the_others() -> None:
    """The probe's Launch gets no answer at all. The other waiting jobs retry once ``probe_until`` has
    passed (not after the launch timeout, not never), and the probe itself times out into a new backoff."""
    cfg = CoreConfig(price_confirm_s=0.0)
    drv, jobs = _capped(cfg)
    (probe,) = _until_launch(drv, drv.now + cfg.backoff_max_s)
    t_probe = drv.now
    assert drv.state.pools[A.name].probe_until == t_probe + cfg.probe_s()
    nxt = _until_launch(drv, t_probe + cfg.probe_s() + 60)
    assert nxt and nxt[0].job_id != probe.job_id and drv.now <= t_probe + cfg.probe_s() + 10
    # the unanswered probes time out (launch_timeout_s) and everybody keeps retrying
    while drv.now < t_probe + cfg.launch_timeout_s + 4 * cfg.probe_s():
        drv(Tick(), dt=30)
    assert not any(n.node_id in probe.node_ids for n in drv.state.nodes.values())
    assert drv.state.pools[A.name].failures > 0


def test_a_probe_of_a_job_cancelled_meanwhile_leaves_the_pool_to_the_others() -> None:
    """The probing job is cancelled while its probe is out (its node record goes; a late NodeLaunched is
    an unknown node). The others retry at ``probe_until`` at the latest."""
    from orchestrator.core.inputs import NodeLaunched

    cfg = CoreConfig(price_confirm_s=0.0)
    drv, jobs = _capped(cfg)
    (probe,) = _until_launch(drv, drv.now + cfg.backoff_max_s)
    t_probe = drv.now
    drv(JobCancelled(job_id=probe.job_id, reason="test"), dt=5)
    (nid,) = probe.node_ids
    drv(NodeLaunched(node_id=nid, job_id=probe.job_id, instance_id="i-late", pool=A, token=probe.token), dt=5)
    nxt = _until_launch(drv, t_probe + cfg.probe_s() + 60)
    assert nxt and nxt[0].job_id != probe.job_id and drv.now <= t_probe + cfg.probe_s() + 10


def test_forged_and_redelivered_node_launched_do_not_end_a_backoff() -> None:
    """A NodeLaunched for an unknown node, with another launch's token, or redelivered after a later
    failure of the pool must not end the pool's backoff (nor clear ``probe_until``)."""
    from orchestrator.core.inputs import NodeLaunched

    cfg = CoreConfig(price_confirm_s=0.0)
    drv, jobs = _capped(cfg)
    (probe,) = _until_launch(drv, drv.now + cfg.backoff_max_s)
    ps0 = drv.state.pools[A.name]
    assert ps0.backoff_until > drv.now
    (nid,) = probe.node_ids
    drv(NodeLaunched(node_id="nope", job_id=probe.job_id, instance_id="i-x", pool=A, token=probe.token), dt=1)
    drv(NodeLaunched(node_id=nid, job_id=probe.job_id, instance_id="i-x", pool=A, token="forged"), dt=1)
    drv(NodeLaunched(node_id=nid, job_id="j9", instance_id="i-x", pool=B, token="forged"), dt=1)
    ps = drv.state.pools[A.name]
    assert (ps.backoff_until, ps.failures, ps.probe_until) == (ps0.backoff_until, ps0.failures, ps0.probe_until)
    # the real answer ends it; its redelivery after a new failure of the pool does not end the new one
    drv(NodeLaunched(node_id=nid, job_id=probe.job_id, instance_id="i-p", pool=A, token=probe.token), dt=1)
    assert drv.state.pools[A.name].backoff_until <= drv.now
    followers = cmds(drv(Tick(), dt=5), Launch)
    assert followers
    la = followers[0]
    drv(LaunchFailed(node_ids=la.node_ids, job_id=la.job_id, pool=la.pool, token=la.token,
                     reason=FailureReason.CAPACITY), dt=1)
    ps1 = drv.state.pools[A.name]
    assert ps1.backoff_until > drv.now
    drv(NodeLaunched(node_id=nid, job_id=probe.job_id, instance_id="i-p", pool=A, token=probe.token), dt=1)
    assert drv.state.pools[A.name].backoff_until == ps1.backoff_until


def test_a_probe_time_of_zero_or_less_never_relaunches_into_the_pool_that_just_failed() -> None:
    """``wait_probe_s`` 0 (or < 0) put the probe time at (or before) the failure itself: each LaunchFailed
    was answered in the same decision by a Launch into the pool that just failed (a launch storm at the
    cloud's answer rate). Such values now mean no probes. (nan cannot be persisted: records.check_finite.)"""
    for w in (0.0, -5.0):
        drv = Driver(State.empty(CoreConfig(price_confirm_s=0.0, wait_probe_s=w)))
        drv(price(A, 10.0))
        (la,) = cmds(drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_max=1, market=MarketPolicy.SPOT))),
                     Launch)
        d = drv(LaunchFailed(node_ids=la.node_ids, job_id="j1", pool=la.pool, token=la.token,
                             reason=FailureReason.CAPACITY))
        assert cmds(d, Launch) == [], w
        assert isinstance(drv.state.pools[A.name].probe_until, type(CoreConfig().wait_probe_s)), w  # UNSET


# --- random runs: many waiting jobs, probes that fail, hang or succeed ------------------------------------

_P = [pool("p4d.24xlarge", z) for z in ("us-east-1a", "us-east-1b")]

def _random_run(seed: int) -> None:
    rng = random.Random(seed)
    cfg = CoreConfig(price_confirm_s=0.0, backoff_base_s=rng.choice([60.0, 200.0]), backoff_max_s=900.0,
                     wait_probe_s=rng.choice([30.0, 120.0, 300.0]), launch_timeout_s=rng.choice([200.0, 900.0]))
    drv = Twin(State.empty(cfg), now=1000.0, check_records=False)
    for pk in _P:
        drv(price(pk, 10.0))
    pending: list[tuple[float, object]] = []
    mode = "fail"
    def execute(cs):
        for c in cs:
            if isinstance(c, Launch):
                m = mode if mode != "mix" else rng.choice(["fail", "hang", "ok"])
                if m == "fail":
                    pending.append((drv.now + rng.uniform(1, 30), LaunchFailed(node_ids=c.node_ids, job_id=c.job_id,
                                    pool=c.pool, token=c.token, reason=FailureReason.CAPACITY)))
                elif m == "ok":
                    for nid in c.node_ids:
                        t = drv.now + rng.uniform(1, 30)
                        pending.append((t, NodeLaunched(node_id=nid, job_id=c.job_id,
                                        instance_id=f"i-{nid}", pool=c.pool, token=c.token)))
                        pending.append((t + 20, NodeRegistered(id=f"r-{nid}", node_id=nid, host=f"h-{nid}", ts=0)))
    n = rng.randint(2, 5)
    for i in range(n):
        ck = CheckpointPolicy(url=f"file:///ck/j{i}", save_s_estimate=20.0)
        execute(drv(JobSubmitted(job_id=f"j{i}", spec=spec(nodes=rng.randint(1, 2), nodes_min=1, nodes_max=2,
                                  market=MarketPolicy.SPOT, checkpoint=ck)), dt=1).commands)
    for _ in range(rng.randint(50, 300)):
        if rng.random() < 0.05:
            mode = rng.choice(["fail", "hang", "mix", "ok"])
        if rng.random() < 0.01:
            j = f"j{rng.randrange(n)}"
            execute(drv(JobCancelled(job_id=j, reason="t")).commands)
        if rng.random() < 0.02:
            execute(drv(price(rng.choice(_P), rng.choice([10.0, 12.0, 29.5]))).commands)
        due = [e for e in pending if e[0] <= drv.now]
        pending[:] = [e for e in pending if e[0] > drv.now]
        for _, ev in due:
            execute(drv(ev).commands)
        execute(drv(Tick(), dt=rng.choice([5.0, 30.0, 60.0])).commands)
    # the cloud works, prices sane
    mode = "ok"
    for pk in _P:
        execute(drv(price(pk, 10.0)).commands)
    start = drv.now
    bound = cfg.launch_timeout_s + cfg.backoff_max_s + 200
    while drv.now - start < bound:
        due = [e for e in pending if e[0] <= drv.now]
        pending[:] = [e for e in pending if e[0] > drv.now]
        for _, ev in due:
            execute(drv(ev).commands)
        execute(drv(Tick(), dt=10.0).commands)
    for j in drv.state.jobs.values():
        if j.phase in (JobPhase.CANCELLED,):
            continue
        assert j.nodes, (seed, j.job_id, j.phase, j.reason,
                         {k: (p.backoff_until - drv.now, p.failures, p.probe_until)
                          for k, p in drv.state.pools.items()})


def test_random_runs_with_probes_keep_the_index_complete_and_every_job_places() -> None:
    """Several waiting jobs, two spot pools, a cloud that fails, never answers or launches (modes switch at
    random), price moves, cancels; probe_s below the backoff. Every event is decided with the kept and a
    fresh index (a missed wake-up shows as a difference); once the cloud works, every job that is not
    cancelled has nodes within launch timeout + longest backoff (no stranding by probe_until)."""
    for seed in range(12):
        _random_run(seed)
