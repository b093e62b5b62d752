"""The CLI's --json shape, the synthetic generator, and orchd end to end through orchestrator.core."""

from __future__ import annotations

import json

import numpy as np
import pytest

from simulations.__main__ import main
from simulations.engine import Job
from simulations.orchd_policy import run_orchd_job
from simulations.scenario import build
from simulations.synth import synth_traces
from simulations.worldparams import WorldParams

from .conftest import tiny_scenario

FIELDS = {"cost_ratio", "deadline_met", "preemptions", "lost_hours", "goodput", "od_share", "jobs",
          "spot_returns_median"}


def test_replay_json_shape(shared, capsys):
    d = shared / "skypilot-spot-traces/availability/1-node/aws-10-26-2022"
    rc = main([
        "replay", "--trace", str(d / "us-west-2a_v100_1.json"), str(d / "us-west-2b_v100_1.json"),
        "--prices", str(shared / "training_on_a_dime/aws_spot_price_history_p2_p3_2019-2020.csv"),
        "--job-hours", "8", "--deadline-hours", "12", "--jobs", "3", "--json",
        "--policy", "on_demand", "--policy", "greedy_spot", "--policy", "optimal", "--policy", "orchd",
    ])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["policies"]) == {"on_demand", "greedy_spot", "optimal", "orchd"}
    for name, f in doc["policies"].items():
        assert set(f) == FIELDS, name
        assert 0.0 <= f["deadline_met"] <= 1.0
        assert (f["od_share"] is None) == (name == "optimal")
        assert (f["spot_returns_median"] is None) == (name == "optimal")
    p = doc["policies"]
    assert p["on_demand"]["od_share"] == 1.0 and 0.0 <= p["orchd"]["od_share"] <= 1.0
    assert p["optimal"]["cost_ratio"] <= p["greedy_spot"]["cost_ratio"] <= p["on_demand"]["cost_ratio"]
    assert doc["zones"] == ["us-west-2a", "us-west-2b"]


def test_replay_ratio_and_bamboo(shared, capsys):
    rc = main(["replay", "--trace", str(shared / "bamboo/traces/p3-trace.csv"), "--spot-price-ratio", "0.3",
               "--job-hours", "4", "--deadline-hours", "8", "--nodes", "16", "--jobs", "2", "--json",
               "--probe-nodes", "32", "--policy", "greedy_spot", "--policy", "optimal"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["nodes"] == 16 and doc["policies"]["optimal"]["deadline_met"] == 1.0


def test_cli_errors_are_reported(tmp_path, capsys):
    bad = tmp_path / "x_v100_1.json"
    bad.write_text("{}")
    assert main(["replay", "--trace", str(bad), "--job-hours", "1", "--deadline-hours", "2"]) == 2
    assert "error" in capsys.readouterr().err


def test_synth_is_seeded_and_shaped():
    a = synth_traces(days=45, zones=9, seed=3)
    b = synth_traces(days=45, zones=9, seed=3)
    c = synth_traces(days=45, zones=9, seed=4)
    assert len(a) == 9 and len(a[0].values) == 45 * 144
    assert all(np.array_equal(x.values, y.values) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x.values, y.values) for x, y in zip(a, c, strict=True))
    assert len({t.region for t in a}) == 3
    # correlated outages: all zones of a region down together happens
    sc = build(a, spot_price_ratio=0.3)
    east1 = [i for i, z in enumerate(sc.zones) if z.region == "us-east-1"]
    assert (sc.avail[east1] == 0).all(axis=0).any()


OV = WorldParams(no_notice_share=0.0, capacity_error_p=0.0)


def test_orchd_runs_through_the_core_on_an_always_available_zone():
    sc = tiny_scenario(np.ones((1, 400)), regions_of_zones=[0], spot=np.full((1, 400), 0.3), od=[1.0])
    job = Job(start_tick=0, work_q=40, deadline_ticks=60)
    jr, wr = run_orchd_job(sc, job, OV, record=True)
    assert wr.phase == "succeeded" and jr.deadline_met
    assert wr.od_node_s == 0 and wr.preemptions == 0
    # 20 ticks of work plus launch + restart, all on spot at 0.3
    assert jr.cost_usd / jr.od_work_cost_usd == pytest.approx(0.3 * (1 + 240 / (40 * 150)), rel=0.02)
    assert wr.actions.get("launch:placement") == 1


def test_orchd_on_a_real_trace_end_to_end(shared):
    from simulations import traces

    d = shared / "skypilot-spot-traces/preemption/1-node/aws-04-22-2023"
    sc = build([traces.load_trace(p) for p in sorted(d.glob("*.json"))], spot_price_ratio=0.3)
    job = Job(start_tick=500, work_q=int(8 * 3600 / sc.quantum_s), deadline_ticks=int(16 * 3600 / sc.tick_s))
    jr, wr = run_orchd_job(sc, job, OV, record=True)
    assert wr.decisions > 10
    assert any(what == "core:launch" for _, what, _ in wr.timeline)
    assert jr.cost_usd > 0 and wr.billed_node_s > 0
    # whatever the core decided, the world's books balance: useful work never exceeds billed time
    assert wr.useful_s <= wr.billed_node_s + 1e-6


def test_orchd_notice_checkpoint_and_resume_lose_no_work():
    # one zone, spot everywhere except a 3-tick outage: the core gets a notice, checkpoints, goes on
    # (a replacement) and finishes; no trained step is lost, only overheads are paid
    avail = np.ones((1, 200))
    avail[0, 20:23] = 0
    sc = tiny_scenario(avail, regions_of_zones=[0], spot=np.full((1, 200), 0.3), od=[1.0])
    job = Job(start_tick=0, work_q=60, deadline_ticks=80)  # 30 ticks of work, 50 of slack
    jr, wr = run_orchd_job(sc, job, OV, record=True)
    assert wr.phase == "succeeded" and jr.deadline_met
    assert wr.preemptions == 1  # counted at the notice; the node left after its checkpoint
    assert wr.actions.get("preemption_notice:metadata") == 1
    assert not any(what == "preempted" for _, what, _ in wr.timeline)  # nothing died while training
    assert wr.actions.get("checkpoint_committed:emergency", 0) >= 1
    # progress is continuous: every generation resumes where the last commit left it
    starts = [d for _, what, d in wr.timeline if what == "start_generation"]
    assert len(starts) >= 2 and starts[0].endswith("from 0.00 h")
    # billed hours = work + overheads (launch, restart, save), nothing redone
    work_h = 60 * 150 / 3600
    assert work_h < wr.billed_node_s / 3600 < work_h + 1.0


def test_results_table_three_settings_with_leave_one_family_out(shared):
    # CI runs at most 3 settings: two families (so each is tuned on the other), one setting each, and
    # one 4-node job on a 1-node trace (a probe<k row, reported apart)
    from simulations.results import FAMILIES, Setting, format_results, results_json, run_table

    fams = tuple(f for f in FAMILIES if f.key in ("gcp-2023-04-30-c3", "aws-2023-04-19-r5"))
    rows = run_table(shared, jobs=2, families=fams, grid=[Setting(1, 30.0, 12.0, 24.0, 0.33)], tune_jobs=1,
                     policies=("greedy_spot", "uniform_progress", "optimal", "orchd"))
    extra = run_table(shared, jobs=2, families=fams[:1], grid=[Setting(4, 120.0, 12.0, 24.0, 0.5)], loo=False,
                      policies=("greedy_spot", "optimal", "orchd"))
    assert len(rows) + len(extra) == 3
    assert [r.extrapolated for r in rows + extra] == [False, False, True]
    # the tuning scores 1 start time per setting here (the first): the second job is the fresh one
    assert [r.fresh for r in rows] == [(False, True), (False, True)]
    text = format_results(rows + extra)
    assert "### jobs within the traces' probe size" in text and "### k-node jobs on smaller probes" in text
    assert "tuned on the other families" in text and "summary (within probe size): 2 settings" in text
    assert "the same over the start times the tuning does not use (1 of 2 jobs per setting):" in text
    doc = json.loads(results_json(rows))
    for row in doc["rows"]:
        pol = row["policies"]
        assert pol["optimal"]["cost_ratio"] <= min(pol[p]["cost_ratio"] for p in pol if pol[p]["deadline_met"] == 1)
        goal = row["orchd_goal"]
        assert goal["gap_to_optimal"] is not None and "greedy_spot" in goal["gap_to_baselines"]


def test_replay_flags_in_use_keep_working(shared, capsys):
    d = shared / "skypilot-spot-traces/preemption/1-node/gcp-04-30-2023"
    rc = main(["replay", "--trace", *map(str, sorted(d.glob("*.json"))), "--spot-price-ratio", "0.33",
               "--job-hours", "6", "--deadline-hours", "9", "--nodes", "4", "--jobs", "2", "--json", "--notice-s", "30",
               "--no-orchd-capacity-hints", "--no-progress", "--policy", "greedy_spot", "--policy", "orchd"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["world"]["notice_override_s"] == 30.0 and doc["orchd_capacity_hints"] is False
    assert doc["nodes"] == 4 and doc["truncated"] == []
    assert set(doc["policies"]) == {"greedy_spot", "orchd"}
