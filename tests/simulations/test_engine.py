"""The tick engine's accounting on hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from simulations.engine import IDLE, Job, Policy, run_job
from simulations.overheads import Overheads
from simulations.policies import ONLINE

from .conftest import tiny_scenario

# 300 s ticks of 2 quanta (150 s); first start 240 s -> 2 quanta, resume 300 s -> 2 quanta
OV = Overheads(launch_delay_s=120, restart_s=120, checkpoint_s=60, region_migration_s=300)


class Script(Policy):
    def __init__(self, actions):
        self.actions = list(actions)

    def act(self, run):
        return self.actions[run.k] if run.k < len(self.actions) else IDLE


def test_on_demand_cost_and_partial_last_tick():
    sc = tiny_scenario(np.ones((1, 10)), regions_of_zones=[0])
    job = Job(start_tick=0, work_q=5, deadline_ticks=10)
    r = run_job(ONLINE["on_demand"](), sc, job, OV)
    # tick0: overhead 2 quanta, gain 0; ticks 1,2: +2 each; tick 3: 1 quantum of 2 -> done at 3.5
    assert r.done_ticks == pytest.approx(3.5)
    assert r.cost_usd == pytest.approx(1.0 * 300 / 3600 * 3.5)
    assert r.overhead_q == 2 and r.billed_q == 7 and r.deadline_met
    assert r.od_work_cost_usd == pytest.approx(5 * 150 / 3600)


def test_preemption_launch_failure_and_restart():
    avail = np.array([[1, 1, 0, 0, 1, 1, 1, 1, 1, 1]])
    sc = tiny_scenario(avail, regions_of_zones=[0], spot=np.full((1, 10), 0.25))
    job = Job(start_tick=0, work_q=4, deadline_ticks=10)
    r = run_job(Script([0] * 10), sc, job, OV, record=True)
    # t0 start (gain 0), t1 +2, t2 preempted -> launch fails -> idle, t3 fails, t4 resume (2 q, gain 0),
    # t5 +2 -> done at exactly 6 ticks
    modes = [m for _, m, _ in r.timeline]
    assert modes[:2] == [0, 0] and modes[2] != 0 and modes[4] == 0
    assert r.preemptions == 1 and r.starts == 2
    assert r.done_ticks == pytest.approx(6.0)
    assert r.cost_usd == pytest.approx(0.25 * 300 / 3600 * 4)


def test_migration_overhead_spans_ticks():
    avail = np.array([[1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    sc = tiny_scenario(avail, regions_of_zones=[0, 1])
    job = Job(start_tick=0, work_q=6, deadline_ticks=8)
    # zone 0 at t0 (gain 0), zone 1 in the other region from t1: 2 + 2 quanta -> t1 gain 0, t2 gain 0
    r = run_job(Script([0, 1, 1, 1, 1, 1, 1, 1]), sc, job, OV)
    assert r.overhead_q == 2 + 4
    assert r.done_ticks == pytest.approx(6.0)


def test_deadline_miss_is_finished_on_demand():
    sc = tiny_scenario(np.zeros((1, 10)), regions_of_zones=[0])
    job = Job(start_tick=0, work_q=4, deadline_ticks=3)
    r = run_job(Script([IDLE] * 10), sc, job, OV)
    assert not r.deadline_met and r.done_ticks == pytest.approx(6.0)


@pytest.mark.parametrize("name", sorted(ONLINE))
def test_online_policies_meet_feasible_deadlines(name):
    rng = np.random.default_rng(3)
    avail = (rng.random((3, 400)) < 0.6).astype(int)
    sc = tiny_scenario(avail, regions_of_zones=[0, 0, 1])
    for s in range(0, 300, 37):
        job = Job(start_tick=s, work_q=40, deadline_ticks=40)
        r = run_job(ONLINE[name](), sc, job, OV)
        assert r.deadline_met, (name, s)
        assert r.cost_usd <= r.od_work_cost_usd * 1.2
