"""The faithful world every policy runs in: per-cloud notices, notices that do not come, saves that
overrun the notice, sampled launch delays and capacity errors, noisy capacity scores from the past
only, the same draws for every policy, and traces read without guessing or silent truncation."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from simulations.engine import Job
from simulations.orchd_policy import run_orchd_job
from simulations.policies import ONLINE
from simulations.replay import make_jobs, replay
from simulations.scenario import Zone, build, probe_capacity
from simulations.traces import AvailabilityTrace, TraceFormatError, load_trace
from simulations.world_policy import run_policy_job
from simulations.worldparams import (
    CAPACITY_ERROR_P,
    LAUNCH_CALL_Q,
    Draws,
    WorldParams,
    capacity_scores,
    derive_defaults,
)

from .conftest import tiny_scenario

CLEAN = WorldParams(no_notice_share=0.0, capacity_error_p=0.0, baseline_checkpoint_interval_s=1e9)


def _one_outage(cloud: str, ticks: int = 200, at: int = 20):
    avail = np.ones((1, ticks))
    avail[0, at:at + 3] = 0
    sc = tiny_scenario(avail, regions_of_zones=[0], spot=np.full((1, ticks), 0.3), od=[1.0])
    zones = tuple(dataclasses.replace(z, cloud=cloud) for z in sc.zones)
    return dataclasses.replace(sc, zones=zones, regions=((cloud, "r0"),))


def _generation_starts(timeline) -> list[float]:
    return [float(d.rsplit("from ", 1)[1].split()[0]) for _, what, d in timeline if what == "start_generation"]


def _save_s(seconds: float) -> WorldParams:
    return dataclasses.replace(CLEAN, state_gib=(seconds - CLEAN.save_fixed_s) * CLEAN.save_gib_s)


@pytest.mark.parametrize("save_s, lost", [(20.0, False), (45.0, True)])
def test_a_30_s_notice_with_a_45_s_save_loses_work(save_s, lost):
    sc = _one_outage("gcp")
    wp = _save_s(save_s)
    assert wp.notice_for("gcp") == 30.0 and wp.save_s == pytest.approx(save_s)
    job = Job(start_tick=0, work_q=60, deadline_ticks=120)
    r = run_policy_job(ONLINE["greedy_spot"](), sc, job, wp, record=True)
    assert r.done_ts is not None
    starts = _generation_starts(r.timeline)
    assert len(starts) == 2 and starts[0] == 0.0
    if lost:  # the save did not commit before the node went: the next generation starts from scratch
        assert starts[1] == 0.0
    else:  # the emergency save committed inside the notice: nothing redone
        assert starts[1] > 1.0


def test_the_same_save_fits_an_aws_notice():
    sc = _one_outage("aws")
    job = Job(start_tick=0, work_q=60, deadline_ticks=120)
    r = run_policy_job(ONLINE["greedy_spot"](), sc, job, _save_s(45.0), record=True)
    assert _generation_starts(r.timeline)[1] > 1.0


@pytest.mark.parametrize("cloud, notice", [("aws", 120), ("gcp", 30), ("azure", 30)])
def test_notice_length_per_cloud_to_the_second(cloud, notice):
    sc = _one_outage(cloud)
    r = run_policy_job(ONLINE["greedy_spot"](), sc, Job(start_tick=0, work_q=60, deadline_ticks=120), CLEAN,
                       record=True)
    notes = [d for _, what, d in r.timeline if what == "notice"]
    assert notes and all(d.endswith(f" {notice} s before its preemption") for d in notes)


def test_preemptions_without_notice_come_from_the_shared_draw():
    sc = _one_outage("aws")
    job = Job(start_tick=0, work_q=60, deadline_ticks=120)
    wp = dataclasses.replace(CLEAN, no_notice_share=1.0)
    r = run_policy_job(ONLINE["greedy_spot"](), sc, job, wp, record=True)
    assert r.preemptions == 1 and not any(what == "notice" for _, what, _ in r.timeline)
    assert _generation_starts(r.timeline)[1] == 0.0  # no notice, no emergency save, no periodic one
    _, wr = run_orchd_job(sc, job, wp, record=True)
    assert wr.preemptions >= 1 and wr.actions.get("preemption_notice:metadata", 0) == 0


def test_launch_delay_and_capacity_errors_are_sampled_and_sourced(shared):
    wp = WorldParams()
    assert wp.launch_delay_s(0.0) == LAUNCH_CALL_Q[0] + wp.agent_start_s
    assert wp.launch_delay_s(0.999999) == pytest.approx(LAUNCH_CALL_Q[-1] + wp.agent_start_s, abs=0.1)
    xs = [wp.launch_delay_s(u) for u in np.linspace(0, 0.99, 50)]
    assert xs == sorted(xs)
    d = derive_defaults(shared)  # the fixed defaults are what the GCP logs of training_on_a_dime say
    assert tuple(d["launch_call_quantiles_s"]) == LAUNCH_CALL_Q
    assert d["capacity_error_p"] == CAPACITY_ERROR_P


def test_a_capacity_error_fails_a_launch_the_trace_has_room_for():
    sc = tiny_scenario(np.ones((1, 100)), regions_of_zones=[0], spot=np.full((1, 100), 0.3))
    wp = dataclasses.replace(CLEAN, capacity_error_p=0.5, seed=3)
    draws = Draws.make(1, 100, wp)
    k = int(np.flatnonzero(draws.cap_error[0])[0])
    job = Job(start_tick=k, work_q=20, deadline_ticks=60)
    r = run_policy_job(ONLINE["greedy_spot"](), sc, job, wp, draws=draws, record=True)
    assert r.timeline[0][1] == "launch_failed"  # the first try hit the error; a later one launched
    assert r.done_ts is not None


def test_a_hint_at_t_uses_no_trace_data_after_t():
    rng = np.random.default_rng(1)
    usable = rng.random((3, 300)) < 0.7
    wp = WorldParams()
    s = capacity_scores(usable, wp)
    assert s.min() >= 0.1 and s.max() <= 1.0  # a score, never 0, never an oracle's 0/1 alone
    for t in (20, 150, 299):
        future = usable.copy()
        future[:, t + 1:] = ~future[:, t + 1:]
        assert np.array_equal(capacity_scores(future, wp)[:, : t + 1], s[:, : t + 1])
    changed = usable.copy()
    changed[:, 150] = ~changed[:, 150]
    assert not np.array_equal(capacity_scores(changed, wp)[:, 150], s[:, 150])


def test_every_policy_gets_the_same_draws():
    a, b = Draws.make(4, 500, WorldParams(seed=5)), Draws.make(4, 500, WorldParams(seed=5))
    c = Draws.make(4, 500, WorldParams(seed=6))
    for f in ("no_notice", "launch_u", "cap_error"):
        assert np.array_equal(getattr(a, f), getattr(b, f))
    assert not np.array_equal(a.launch_u, c.launch_u)
    assert 0.02 < a.no_notice.mean() < 0.08 and 0.18 < a.cap_error.mean() < 0.3


def test_every_policy_runs_in_the_world_and_optimal_bounds_them(shared):
    d = shared / "skypilot-spot-traces/preemption/1-node/aws-04-22-2023"
    sc = build([load_trace(p) for p in sorted(d.glob("*.json"))], spot_price_ratio=0.3, truncate=True)
    jobs = make_jobs(sc, job_hours=6, deadline_hours=9, nodes=1, count=3)
    res = replay(sc, jobs, ["greedy_spot", "uniform_progress", "on_demand", "optimal", "orchd"], WorldParams())
    for name in ("greedy_spot", "uniform_progress", "on_demand", "orchd"):
        assert res[name].goodput < 1.0  # launches, restarts and saves are paid in the world
        for i in range(len(jobs)):
            if res[name].per_job_met[i]:
                assert res["optimal"].per_job_cost_ratio[i] <= res[name].per_job_cost_ratio[i] + 1e-9, (name, i)


def test_no_silent_truncation_and_probe_sizes(tmp_path):
    def tr(zone: str, n: int) -> AvailabilityTrace:
        return AvailabilityTrace(zone, "us-east-1", "aws", "p3.2xlarge", 600.0, np.ones(n, dtype=np.int32))

    with pytest.raises(ValueError, match="different lengths"):
        build([tr("us-east-1a", 100), tr("us-east-1b", 90)], spot_price_ratio=0.3)
    sc = build([tr("us-east-1a", 100), tr("us-east-1b", 90)], spot_price_ratio=0.3, truncate=True)
    assert sc.n_ticks == 90 and sc.truncated == (("us-east-1a", 100),)
    # a 4-node probe with 1 of 4 alive offers 1 node, never "95% available"; 4 of 4 fits any job
    assert probe_capacity(np.array([0, 1, 4]), 4).tolist()[:2] == [0, 1]
    assert probe_capacity(np.array([4]), 4)[0] >= 16
    with pytest.raises(ValueError):
        probe_capacity(np.array([5]), 4)
    f = tmp_path / "us-east-1a_v100_1.json"
    f.write_text(json.dumps({"metadata": {"gap_seconds": 60}, "data": [0, 1, 3]}))
    with pytest.raises(TraceFormatError, match="probe size"):
        load_trace(f)
    assert load_trace(f, probe_nodes=4).nodes_probed == 4


def test_zone_names_keep_their_cloud():
    assert Zone("a", "r", "gcp", "x").cloud == "gcp"
