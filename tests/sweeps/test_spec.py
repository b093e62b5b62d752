"""Sweep files, trial job specs, the sweep id on the wire, and the clear error without Optuna (no I/O but a
temp file and one subprocess)."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

import wire as ev
from orchestrator.jobspec import spec_problems
from orchestrator.sweeps.controller import rank0_progress
from orchestrator.sweeps.spec import SweepSpecError, load_sweepspec, parse_sweepspec, trial_job_id, trial_jobspec
from simulations.sweeps import sweep_file

GOOD = sweep_file(trials=4, parallelism=2, nodes=2, total_steps=100, pruner="median", seed=1,
                  checkpoint_root="file:///data/sweeps/lr", every=10, budget_usd=20.0)


def test_a_good_file_and_its_trials():
    spec = parse_sweepspec(GOOD)
    assert (spec.trials, spec.parallelism, spec.pruner, spec.report_every_steps) == (4, 2, "median", 10)
    assert spec.share_usd() is None  # no trial_budget_usd: orchd holds the trials together to the budget
    job = trial_jobspec(spec, "lr-1a2b", trial_job_id("lr-1a2b", 3), {"x": 0.5}, spec.share_usd(), 1.9e9)
    assert job.sweep_id == "lr-1a2b" and job.budget_usd is None
    assert (job.sweep_budget_usd, job.sweep_deadline_ts) == (20.0, 1.9e9)  # the sweep's, on every trial
    shared = parse_sweepspec(GOOD.replace("budget_usd = 20.0\n", "budget_usd = 20.0\ntrial_budget_usd = 50.0\n"))
    assert shared.share_usd() == 20.0  # a trial's own cap, never above the sweep's
    assert job.checkpoint.url == "file:///data/sweeps/lr/lr-1a2b-t0003"  # each trial its own root
    assert job.trainer.args == {"x": 0.5} and job.trainer.command == ("sim-trainer",)
    assert spec_problems(job) == []


def test_every_problem_is_listed_at_once(tmp_path):
    bad = GOOD.replace("trials = 4", "trials = 0").replace('kind = "median"', 'kind = "asha"')
    bad = bad.replace("low = 0.0", "low = 2.0").replace('gpu_type = "A100"', "gpu_type = 3")
    bad += "\nsurprise = 1\n"  # lands in [job.checkpoint]
    f = tmp_path / "s.toml"
    f.write_text(bad)
    with pytest.raises(SweepSpecError) as e:
        load_sweepspec(f)
    msg = str(e.value)
    for needle in ("trials: must be within 1 .. 10000, got 0", "pruner.kind: 'asha' is not one of",
                   "space.x.low: must be <= high", "job.gpu_type", "job.checkpoint.surprise"):
        assert needle in msg, msg
    assert str(f) in msg


def test_the_template_is_checked_with_the_space_in_it():
    """The built-in trainer checks its arguments: a searched parameter it does not know is refused."""
    text = GOOD.replace('command = ["sim-trainer"]', "")
    with pytest.raises(SweepSpecError, match=r"job \(with the space's first values\).*trainer"):
        parse_sweepspec(text)


def test_orchd_refuses_a_malformed_sweep_id_and_old_specs_keep_their_bytes():
    spec = trial_jobspec(parse_sweepspec(GOOD), "ok-1", "ok-1-t0000", {"x": 0.1}, None)
    assert spec_problems(msgspec.structs.replace(spec, sweep_id="Bad Id!")) == [
        "sweep_id: must match [a-z0-9][a-z0-9-]{0,39}, got 'Bad Id!'"]
    plain = msgspec.structs.replace(spec, sweep_id=msgspec.UNSET)
    data = msgspec.json.encode(plain)
    assert b"sweep_id" not in data  # unset is not encoded: specs and records without sweeps are unchanged
    assert msgspec.json.decode(data, type=ev.JobSpec).sweep_id is msgspec.UNSET
    assert msgspec.json.decode(msgspec.json.encode(spec), type=ev.JobSpec).sweep_id == "ok-1"


def test_rank0_progress_reads_the_current_generation_only():
    job = {"summary": {"generation": 2}, "nodes": [
        {"generation": 1, "rank": 0, "step": 90, "loss": 0.1},  # an old member, still listed
        {"generation": 2, "rank": 1, "step": 41, "loss": 0.5},
        {"generation": 2, "rank": 0, "step": 40, "loss": 0.4},
        {"generation": 2, "rank": 2, "step": 40, "loss": None}]}
    assert rank0_progress(job) == (40, 0.4)
    assert rank0_progress({"summary": {"generation": 1}, "nodes": []}) is None


def test_without_optuna_the_error_says_how_to_install(tmp_path):
    code = ("import sys; sys.modules['optuna'] = None\n"
            "from orchestrator.cli.main import main\n"
            f"sys.exit(main(['sweep', 'list', '--storage', 'sqlite:///{tmp_path}/s.db']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "pip install 'spot-orchestrator[sweeps]'" in p.stderr


def test_the_shipped_example_is_valid():
    from pathlib import Path

    spec, _ = load_sweepspec(Path(__file__).resolve().parents[2] / "config" / "sweeps" / "gpt-lr.toml")
    assert (spec.trials, spec.parallelism, spec.share_usd()) == (16, 4, 25.0)
    assert [p.name for p in spec.space] == ["lr", "warmup_steps", "weight_decay"]
    assert (spec.deadline_ts, spec.deadline_in_s) == (None, 72 * 3600.0)  # resolved once, at sweep submit
    local, _ = load_sweepspec(Path(__file__).resolve().parents[2] / "config" / "sweeps" / "local-lr.toml")
    assert local.template.clouds == ("local",) and local.deadline_in_s == 2 * 3600.0


def test_deadline_in_is_a_duration():
    assert parse_sweepspec(GOOD.replace("budget_usd = 20.0\n", "budget_usd = 20.0\ndeadline_in = \"1d\"\n",
                                        1)).deadline_in_s == 86400.0
    with pytest.raises(SweepSpecError, match="deadline_in: not a duration, got 'soon'"):
        parse_sweepspec(GOOD.replace("budget_usd = 20.0\n", "budget_usd = 20.0\ndeadline_in = \"soon\"\n", 1))


def test_a_sqlite_storage_in_a_missing_directory_says_so(tmp_path):
    """The README's ``sqlite:////var/lib/orch/sweeps.db`` on a host without that directory failed with
    SQLite's "unable to open database file"; the error now names the directory."""
    from orchestrator.sweeps.store import SweepStore

    with pytest.raises(SweepSpecError, match=f"directory {tmp_path / 'nope'} does not exist"):
        SweepStore(f"sqlite:///{tmp_path / 'nope' / 'sweeps.db'}")
    SweepStore(f"sqlite:///{tmp_path / 'sweeps.db'}")  # an existing directory: created as before


def test_orch_sweep_help_names_the_global_options(capsys):
    from orchestrator.cli.main import sweep_service_main as service_main

    assert service_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--server URL" in out and "--storage" in out
