"""A whole sweep with faults injected: 8 trials x 2 simulated nodes, a real orchd (subprocess, fake cloud) on a
real nats-server, Optuna's storage in a SQLite file and the real controller service. Mid-sweep: 3 preemption
notices into running trials, kill -9 of orchd with a trial's node vanishing from the cloud while it is down,
and a restart of the controller (simulations/sweeps.py). Optuna must hold each trial once, in the state its
job ended in; pruned trials' nodes released; preempted trials resumed, never restarted."""

from __future__ import annotations

import anyio
import pytest

from orchestrator.sweeps.spec import trial_job_id
from simulations.sweeps import SWEEP_ID, DrillConfig, run_drill, trial_loss

pytestmark = pytest.mark.timeout(300)


def test_sweep_survives_notices_vanished_node_and_restarts(tmp_path):
    cfg = DrillConfig(trials=8, parallelism=2, nodes=2, total_steps=60, notices=3, kill_orchd=True,
                      restart_controller=True, timeout_s=200)
    r = anyio.run(run_drill, cfg, tmp_path / "drill", backend="asyncio")
    assert r.problems == []
    assert (r.notices, r.vanished, r.orchd_kills, r.controller_restarts) == (3, 1, 1, 1)
    # each trial once: trial numbers 0..7, one job each, nothing left running or alive
    assert r.trials == 8 and [row["trial"] for row in r.rows] == list(range(8))
    assert sorted(r.jobs_final) == [trial_job_id(SWEEP_ID, i) for i in range(8)] and r.jobs == 8
    assert "running" not in r.states and r.alive_instances == 0
    assert r.complete + r.pruned + r.failed == 8 and r.failed == 0
    for row in r.rows:
        job = r.jobs_final[row["job_id"]]
        assert job["nodes"] == 0  # released, whatever the end
        if row["state"] == "complete":
            assert job["phase"] == "succeeded"
            # the objective is the trainer's own loss at the last step, exactly (not a heartbeat sample)
            assert row["value"] == trial_loss(row["params"], 60) == job["final_loss"]
        else:
            assert row["state"] == "pruned" and job["phase"] == "cancelled"
            assert row["pruned_at"] is not None and row["pruned_at"] % cfg.every == 0
    # a preempted trial continued from its checkpoint in a later generation of the same job (not a new trial,
    # not restarted at step 0); a notice that orchd, lagging on a loaded machine, acts on only after the
    # trial's last step resumes nothing, so at least one of the 4 hits is required to have resumed
    assert r.resumed >= 1
    for job_id, starts in r.starts.items():  # one job per trial, its generations in order
        assert [g for g, _ in starts] == sorted({g for g, _ in starts}), (job_id, starts)
    # the median pruner stopped at least one weak trial; the best trial is the one nearest x = 0.25
    assert r.pruned >= 1
    best = min((row for row in r.rows if row["state"] == "complete"), key=lambda row: row["value"])
    assert r.best_value == best["value"] and r.best_x == best["params"]["x"]
