"""``python -m simulations explain``: the time a job did not train while a zone had room (and, for orchd,
with every such zone's pool in launch backoff), and the same job under greedy_spot and uniform_progress."""

from __future__ import annotations

import json
import re

import numpy as np

from simulations.__main__ import main
from simulations.engine import Job
from simulations.orchd_policy import core_config, run_orchd_job
from simulations.worldparams import WorldParams

from .conftest import tiny_scenario

OV = WorldParams(no_notice_share=0.0, capacity_error_p=0.0)


def test_idle_time_counts_only_ticks_with_room_and_splits_out_the_backoff():
    # no spot anywhere: the job waits and then runs on on-demand; no tick had room for spot
    sc = tiny_scenario(np.zeros((1, 200)), regions_of_zones=[0], od=[1.0])
    _, wr = run_orchd_job(sc, Job(start_tick=0, work_q=20, deadline_ticks=60), OV, record=True)
    assert wr.phase == "succeeded" and wr.od_node_s > 0
    assert wr.idle_capacity_s == 0.0 and wr.idle_backoff_s == 0.0
    # spot for 2 ticks, then out until 3.75 h (the pool's launch backoff grows to its 30-minute cap while
    # the job waits); with the waiting job's retries every 30 minutes (wait_probe_s 1800: probes at 3.0 h
    # and 3.5 h fail, the next is at 4.0 h) the job idles three ticks with room while its only pool is
    # closed to it, then launches
    avail = np.ones((1, 300))
    avail[0, 2:45] = 0
    sc = tiny_scenario(avail, regions_of_zones=[0], od=[1.0])
    job = Job(start_tick=0, work_q=40, deadline_ticks=250)
    _, wr = run_orchd_job(sc, job, OV, config=core_config(wait_probe_s=1800.0), record=True)
    assert wr.phase == "succeeded" and wr.od_node_s == 0
    launches = [t for t, what, _ in wr.timeline if what == "launch"]
    assert launches[-1] == 4.0 * 3600
    assert wr.idle_backoff_s == 3 * sc.tick_s
    assert wr.idle_capacity_s > wr.idle_backoff_s  # and the ticks of the boots and the restart
    # the core's default: a waiting job retries the pool 5 minutes after each failure, whatever its
    # backoff, and launches in the tick the zone is back
    _, wr = run_orchd_job(sc, job, OV, record=True)
    launches = [t for t, what, _ in wr.timeline if what == "launch"]
    assert launches[-1] == 45 * sc.tick_s and wr.idle_backoff_s == 0.0


def test_explain_prints_the_same_job_under_the_baselines(shared, capsys):
    d = shared / "skypilot-spot-traces/preemption/1-node/aws-04-22-2023"
    args = ["--trace", *map(str, sorted(d.glob("*.json"))), "--spot-price-ratio", "0.25", "--job-hours", "12",
            "--deadline-hours", "24", "--jobs", "1", "--notice-s", "30"]
    assert main(["explain", *args, "--job-index", "0", "--limit", "0"]) == 0
    out = capsys.readouterr().out
    got = {m[0]: float(m[1]) for m in re.findall(r"^(\w+): cost_ratio ([0-9.]+)", out, re.M)}
    orchd = re.search(r"^job 0: .*cost_ratio ([0-9.]+)", out, re.M)
    assert orchd is not None and set(got) == {"greedy_spot", "uniform_progress"}
    assert re.search(r"^orchd: idle [0-9.]+ h while a zone had room for the job, [0-9.]+ h of it", out, re.M)
    assert main(["replay", *args, "--json", "--policy", "greedy_spot", "--policy", "uniform_progress",
                 "--policy", "orchd"]) == 0
    p = json.loads(capsys.readouterr().out)["policies"]
    for name, ratio in got.items():  # one job: the replay's mean is that job
        assert abs(p[name]["cost_ratio"] - ratio) < 0.0006, name
    assert abs(p["orchd"]["cost_ratio"] - float(orchd[1])) < 0.0006
