"""Liveness and deadline safety of the core as properties (hypothesis, over tests/core/propworld.py).

Liveness: after any sequence of launch failures, terminate notices, vanishing nodes, price moves (up to
no capacity), waits and orchd restarts (state re-loaded from its records), once launches succeed and
spot has capacity again every active job trains again within LIVENESS_BOUND_S; while it does not, the
job says why (its reason) and the wake-up time is never in the past.

Deadline safety: for any spot availability trace (capacity per pool coming and going, losses with or
without a notice) in which on-demand can be obtained, a job whose deadline was feasible at submit
(``submit_problems`` finds nothing) meets it.

The example counts here keep CI short; ``python benchmarks/properties.py --examples 5000`` runs many.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from orchestrator.core import JobPhase
from orchestrator.core.feasibility import submit_problems, wake_up
from orchestrator.core.inputs import JobSubmitted
from tests.core.harness import spec
from tests.core.propworld import ACTIVE, CONFIG, JOB, SPOT, TRAINING, World
from wire import CheckpointPolicy, MarketPolicy

# launch timeout + the longest launch backoff + notice skip + hold + boot, with room to spare
LIVENESS_BOUND_S = 900
CI_EXAMPLES = 60

op = st.one_of(
    st.tuples(st.just("fail"), st.booleans()),
    st.tuples(st.just("notice"), st.integers(0, 3)),
    st.tuples(st.just("vanish"), st.integers(0, 3)),
    st.tuples(st.just("price"), st.integers(0, len(SPOT) - 1), st.floats(1.0, 45.0)),
    st.tuples(st.just("wait"), st.integers(1, 200)),
    st.tuples(st.just("restart")),
)


def apply(w: World, o: tuple[Any, ...]) -> None:
    kind = o[0]
    if kind == "fail":
        w.fail_launches = o[1]
    elif kind in ("notice", "vanish"):
        live = w.live_spot()
        if live:
            nid = live[o[1] % len(live)]
            w.notice(nid) if kind == "notice" else w.vanish(nid)
    elif kind == "price":
        w.set_prices({SPOT[o[1]].name: round(o[2], 2)})
    elif kind == "wait":
        for _ in range(o[1]):
            w.second()
    elif kind == "restart":
        w.restart()


def check_liveness(market: str, nodes: int, slack_s: float | None, ops: list[tuple[Any, ...]],
                   warmup_s: int) -> None:
    w = World()
    w.set_prices({})
    for _ in range(10):
        w.second()
    deadline = None if slack_s is None else w.now + 3000 + slack_s
    w.feed(JobSubmitted(job_id=JOB, spec=spec(nodes=nodes, nodes_min=nodes, nodes_max=nodes, total_steps=3000,
                                              market=MarketPolicy(market), deadline_ts=deadline,
                                              checkpoint=CheckpointPolicy(url="file:///ck/j", save_s_estimate=3.0))))
    for _ in range(warmup_s):  # the chaos may start before or after the job runs
        w.second()
    for o in ops:
        apply(w, o)
    # the cloud works again: launches succeed, spot has capacity at a sane price
    w.fail_launches = False
    w.spot_down.clear()
    w.set_prices({})
    start = w.now
    live = ACTIVE | {JobPhase.PAUSED}  # non-terminal: none of them may be absorbing
    while w.now - start < LIVENESS_BOUND_S:
        job = w.state.jobs[JOB]
        if job.phase not in live or job.phase in TRAINING and job.gen_confirmed:
            break
        if job.phase not in TRAINING:
            why, until = wake_up(job, w.state.pools, w.config, w.now)
            assert why, (job.phase, job.reason)
            assert until is None or until >= w.now
        w.second()
    job = w.state.jobs[JOB]
    assert job.phase not in live or (job.phase in TRAINING and job.gen_confirmed), (
        job.phase, job.reason, job.avoid_pools, job.zone, w.now - start, sorted(w.state.pools))


liveness_args = dict(
    market=st.sampled_from([m.value for m in MarketPolicy]),
    nodes=st.integers(1, 3),
    slack_s=st.none() | st.floats(0.0, 20000.0),
    ops=st.lists(op, max_size=20),
    warmup_s=st.sampled_from([0, 60, 300]),
)


@settings(max_examples=CI_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(**liveness_args)
# found by this property: a PENDING job that kept its zone launched there and never became PLACING
@example(market="spot_with_fallback", nodes=1, slack_s=None, ops=[("fail", True), ("price", 0, 30.0), ("wait", 36)],
         warmup_s=0)
def test_every_active_job_trains_again_once_the_cloud_works(market: str, nodes: int, slack_s: float | None,
                                                           ops: list[tuple[Any, ...]], warmup_s: int) -> None:
    check_liveness(market, nodes, slack_s, ops, warmup_s)


# A spot availability trace: per segment (seconds, which spot pools have capacity, how nodes are lost).
segment = st.tuples(st.integers(30, 900), st.sets(st.integers(0, len(SPOT) - 1)), st.booleans())


def check_deadline(nodes: int, total_steps: int, extra_s: float, trace: list[tuple[int, set[int], bool]]) -> None:
    w = World()
    w.set_prices({})
    for _ in range(4):
        w.second()
    start = CONFIG.boot_s_estimate + CONFIG.restart_overhead_s
    deadline = w.now + total_steps + start + extra_s
    sp = spec(nodes=nodes, nodes_min=nodes, nodes_max=nodes, total_steps=total_steps, deadline_ts=deadline,
              market=MarketPolicy.SPOT_WITH_FALLBACK, checkpoint=CheckpointPolicy(url="file:///ck/j",
                                                                                  save_s_estimate=3.0))
    assert submit_problems(sp, CONFIG, w.now, clouds=["aws"]) == []
    w.feed(JobSubmitted(job_id=JOB, spec=sp))
    seg = 0
    seg_end = w.now
    while w.state.jobs[JOB].phase in ACTIVE and w.now < deadline + 600:
        if w.now >= seg_end:
            secs, up, with_notice = trace[seg % len(trace)] if trace else (10**6, {0, 1}, True)
            seg += 1
            seg_end = w.now + secs
            w.spot_down = {p.name for i, p in enumerate(SPOT) if i not in up}
            for p in sorted(w.spot_down):
                for nid in w.live_spot(p):
                    w.notice(nid) if with_notice else w.vanish(nid)
        w.second()
    job = w.state.jobs[JOB]
    assert job.phase == JobPhase.SUCCEEDED, (job.phase, job.reason, job.step)
    assert w.now <= deadline + 1.0, (w.now - deadline, job.force_on_demand)  # the loop ends at completion


deadline_args = dict(
    nodes=st.integers(1, 2),
    total_steps=st.integers(300, 1500),
    extra_s=st.floats(0.0, 2500.0),
    trace=st.lists(segment, max_size=12),
)


@settings(max_examples=CI_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(**deadline_args)
def test_a_feasible_deadline_is_met_when_on_demand_can_be_had(nodes: int, total_steps: int, extra_s: float,
                                                               trace: list[tuple[int, set[int], bool]]) -> None:
    check_deadline(nodes, total_steps, extra_s, trace)
