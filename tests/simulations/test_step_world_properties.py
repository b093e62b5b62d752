"""Properties of orchd's core in the decision-step world (``WorldParams.step_world``), over any availability
series: decision steps from 1 s to 15 min, restart overheads from 0 to 0.5 h, notices or none, 1-16 nodes.

- A job whose deadline is feasible on on-demand from its start (its work + one restart) finishes by its
  deadline.
- Its moves from on-demand back to spot stay within ``CoreConfig.spot_returns_per_h`` per hour of its run.

CI runs a bounded number of examples; ``python benchmarks/properties.py --only step_world`` runs many.
Every counterexample found becomes a case in ``REGRESSIONS``."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from orchestrator.core.model import DEFAULT_SPOT_RETURNS_PER_H
from simulations import scenario as scen
from simulations.engine import Job
from simulations.orchd_policy import core_config
from simulations.traces import AvailabilityTrace
from simulations.world import World
from simulations.worldparams import WorldParams

CI_EXAMPLES = 25
ZONES = ("us-east-1a", "us-east-1b", "us-west-2a")


def check_step_world(step_s: float, restart_s: float, notices: bool, nodes: int, work_steps: int,
                     slack_steps: int, series: list[list[int]]) -> None:
    trs = [AvailabilityTrace(z, z[:-1], "aws", "p3.2xlarge", step_s, np.asarray(vals, dtype=np.int32) * 16, 16)
           for z, vals in zip(ZONES, series, strict=False)]
    sc = scen.build(trs, spot_price_ratio=0.33, min_tick_s=step_s, quantum_s=step_s, truncate=True)
    work_s = work_steps * step_s
    # feasible on on-demand from the start with one restart, by at least one step
    deadline_s = work_s + restart_s + slack_steps * step_s
    job = Job(start_tick=0, work_q=int(round(work_s / sc.quantum_s)), nodes=nodes,
              deadline_ticks=int(math.ceil(deadline_s / sc.tick_s)))
    wp = WorldParams.step_world(restart_s=restart_s).with_(no_notice_share=0.0 if notices else 1.0)
    r = World(sc, job, wp, config=core_config()).run()
    assert r.deadline_met, (r.done_ts, job.deadline_ticks * sc.tick_s, r.phase, r.actions)
    run_h = (r.done_ts or 0.0) / 3600.0
    assert r.spot_returns <= math.floor(run_h * DEFAULT_SPOT_RETURNS_PER_H) + 1, (r.spot_returns, run_h)


availability = st.lists(st.integers(0, 1), min_size=4, max_size=60)
step_world_args = dict(
    step_s=st.sampled_from([1.0, 10.0, 60.0, 300.0, 600.0, 900.0]),
    restart_s=st.floats(0.0, 1800.0),
    notices=st.booleans(),
    nodes=st.integers(1, 16),
    work_steps=st.integers(5, 120),
    slack_steps=st.integers(1, 80),
    series=st.lists(availability, min_size=1, max_size=3),
)

# counterexamples found by the property, kept as regression cases:
REGRESSIONS: list[dict] = []


@settings(max_examples=CI_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(**step_world_args)
@example(step_s=600.0, restart_s=720.0, notices=False, nodes=1, work_steps=60, slack_steps=3,
         series=[[1, 0] * 30])  # spot flickering every step, a tight deadline
@example(step_s=600.0, restart_s=180.0, notices=False, nodes=4, work_steps=90, slack_steps=12,
         series=[[1, 1, 1, 0] * 15, [0, 1, 1, 1] * 15])
def test_a_feasible_deadline_is_met_in_the_decision_step_world(step_s: float, restart_s: float, notices: bool,
                                                                nodes: int, work_steps: int, slack_steps: int,
                                                                series: list[list[int]]) -> None:
    check_step_world(step_s, restart_s, notices, nodes, work_steps, slack_steps, series)


def test_every_policy_meets_the_deadlines_on_a_shipped_trace_in_the_decision_step_world(fixture_traces) -> None:
    """The shipped availability fixture (two zones, 10-minute steps), tight deadlines, r = 0.2 h: every job
    of orchd and of the deadline-aware baselines meets its deadline, and orchd's median moves back to spot
    per job are at most greedy_spot's + 1."""
    from simulations.replay import make_jobs, replay
    from simulations.traces import load_trace

    d = fixture_traces / "skypilot-spot-traces/availability/1-node/aws-fixture"
    sc = scen.build([load_trace(p) for p in sorted(d.glob("*.json"))], spot_price_ratio=0.33)
    jobs = make_jobs(sc, job_hours=16, deadline_hours=20, nodes=1, count=3)
    res = replay(sc, jobs, ["greedy_spot", "uniform_progress", "orchd"], WorldParams.step_world(restart_s=720.0))
    assert all(res[p].deadline_met == 1.0 for p in res), {p: res[p].deadline_met for p in res}
    assert res["orchd"].spot_returns is not None and res["greedy_spot"].spot_returns is not None
    assert res["orchd"].spot_returns <= res["greedy_spot"].spot_returns + 1
