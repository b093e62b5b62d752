"""results.py's why / fresh summary on awkward rows: an infeasible bound (nan), one job, a baseline that
missed a deadline only in the jobs the fresh subset drops, no fresh jobs at all (--jobs <= --tune-jobs)."""

from __future__ import annotations

import math

from simulations.replay import Summary
from simulations.results import Row, Setting, _goal_cell, format_results, orchd_goal, summary_lines


def _s(per_job: tuple[float, ...], met: tuple[bool, ...] | None = None) -> Summary:
    met = met or (True,) * len(per_job)
    fin = [c for c in per_job if math.isfinite(c)]
    return Summary(cost_ratio=sum(fin) / len(fin) if fin else float("nan"), deadline_met=sum(met) / len(met),
                   preemptions=None, lost_hours=None, goodput=None, jobs=len(per_job), per_job_cost_ratio=per_job,
                   per_job_met=met, od_share=None)


def _row(orchd, greedy, unif, opt, fresh=(), gmet=None) -> Row:  # type: ignore[no-untyped-def]
    res = {"greedy_spot": _s(greedy, gmet), "uniform_progress": _s(unif), "optimal": _s(opt, tuple(
        math.isfinite(c) for c in opt)), "orchd": _s(orchd)}
    return Row("fam", Setting(1, 120.0, 24.0, 36.0, 0.33), ("z",), 1, res, fresh=fresh)


def test_an_infeasible_bound_in_the_fresh_jobs_gives_no_gap_and_no_crash() -> None:
    r = _row((0.5, 0.5), (0.6, 0.6), (0.7, 0.7), (0.4, float("nan")), fresh=(False, True))
    f = r.fresh_only()
    assert f is not None and math.isnan(f.results["optimal"].cost_ratio)
    g = orchd_goal(f)
    assert g["gap_to_optimal"] is None and g["best_baseline_gap_to_optimal"] is None
    assert _goal_cell(g).startswith("NOT MET")
    text = format_results([r])
    assert "nan" in summary_lines([f])  # the mean gap over no setting with a bound: said as nan, not a crash
    assert "2 jobs per setting" in text


def test_one_job_and_no_fresh_job() -> None:
    r = _row((0.5,), (0.4,), (0.7,), (0.3,), fresh=(False,))
    assert r.fresh_only() is None
    g = orchd_goal(r)
    assert g["jobs_not_above"] == {"greedy_spot": 0, "uniform_progress": 1}
    assert "above greedy_spot (not above it in 0 of 1 jobs)" in _goal_cell(g)
    assert "start times the tuning does not use" not in format_results([r])


def test_a_baseline_that_missed_only_in_the_dropped_jobs_is_compared_in_the_fresh_summary() -> None:
    r = _row((0.5, 0.5), (0.4, 0.45), (0.7, 0.7), (0.3, 0.3), fresh=(False, True), gmet=(False, True))
    assert "greedy_spot" not in orchd_goal(r)["not_above_baselines_that_met_all"]
    f = r.fresh_only()
    assert f is not None and orchd_goal(f)["not_above_baselines_that_met_all"] == {"greedy_spot": False,
                                                                                  "uniform_progress": True}
