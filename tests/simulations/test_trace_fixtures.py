"""The parsers, the replay CLI and orchd's core on the trace files the repository ships.

tests/fixtures/traces holds generated files in the public traces' formats, so this part of the
simulator is tested in any clone; the tests on the real traces (marker ``traces``) skip where
../shared/traces is absent, and this file checks that they skip with their reason rather than error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from simulations import traces
from simulations.__main__ import main
from simulations.engine import Job
from simulations.orchd_policy import run_orchd_job
from simulations.scenario import build
from simulations.worldparams import WorldParams

from .conftest import FIXTURES

ROOT = Path(__file__).resolve().parents[2]
SKY = "skypilot-spot-traces"


def test_shipped_files_are_what_the_generator_writes(tmp_path):
    gen = subprocess.run([sys.executable, str(FIXTURES / "generate.py"), str(tmp_path)], check=True)
    assert gen.returncode == 0
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    shipped = sorted(p.relative_to(FIXTURES) for p in FIXTURES.rglob("*") if p.is_file() and p.suffix != ".py")
    assert written == shipped and len(written) == 12
    for rel in written:
        assert (tmp_path / rel).read_bytes() == (FIXTURES / rel).read_bytes(), rel


def test_skypilot_files(fixture_traces):
    f = fixture_traces / SKY / "availability/1-node/aws-fixture/us-west-2a_v100_1.json"
    tr = traces.load_trace(f)
    assert (tr.zone, tr.region, tr.cloud, tr.instance_type) == ("us-west-2a", "us-west-2", "aws", "p3.2xlarge")
    assert tr.gap_s == 600 and len(tr.values) == 2000 and tr.nodes_probed == 1
    assert set(np.unique(tr.values)) == {0, 1} and tr.values.sum() == sum(json.loads(f.read_text())["data"])
    four = traces.load_trace(fixture_traces / SKY / "preemption/4-node/aws-fixture/us-east-2a_v100_1.json")
    assert four.nodes_probed == 4 and four.values.max() == 4 and four.gap_s == 300
    g = traces.load_trace(fixture_traces / SKY / "preemption/1-node/gcp-fixture/us-central1-a_c3-88.json")
    assert (g.cloud, g.region, g.instance_type) == ("gcp", "us-central1", "c3-highcpu-88")


def test_bamboo_logs(fixture_traces):
    log = fixture_traces / "bamboo/traces/p3-trace.csv"
    with pytest.raises(traces.TraceFormatError, match="probe size"):
        traces.load_trace(log, gap_s=60.0)
    with pytest.raises(traces.TraceFormatError, match="32 nodes alive but the probe asked for 16"):
        traces.load_trace(log, gap_s=60.0, probe_nodes=16)
    tr = traces.load_trace(log, gap_s=60.0, probe_nodes=32)
    assert tr.instance_type == "p3.2xlarge" and tr.values[0] == 32 and tr.values.min() < 32
    group = traces.load_trace(fixture_traces / "bamboo/traces/gcloud/v100x1-east1c.txt", gap_s=60.0, probe_nodes=80)
    assert (group.cloud, group.zone, group.region) == ("gcp", "us-east1-c", "us-east1")
    assert 23 < group.duration_s / 3600 <= 24  # two interleaved samplers, sorted back into one day


def test_price_files(fixture_traces):
    aws = traces.load_prices(fixture_traces / "training_on_a_dime/aws_spot_price_history.csv")
    s = aws.lookup("us-east-1c", "us-east-1", "p3.2xlarge")
    assert s is not None and np.all(np.diff(s.times) > 0)
    assert s.prices.min() >= 0.30 * 3.06 and s.prices.max() <= 0.34 * 3.06
    assert aws.lookup("us-west-2z", "us-west-2", "p3.2xlarge") is not None  # another zone of the region
    assert aws.lookup("us-west-2z", "us-west-2", "no.such") is None
    gcp = traces.load_prices(fixture_traces / "google-cloud-pricing-cost-calculator/gcp_gpu_vm_price_changelog.csv")
    a100 = gcp.lookup("us-central1-a", "us-central1", "a2-highgpu-1g")
    assert a100 is not None and np.isnan(a100.prices[0])  # absent before it was priced
    assert a100.at(np.asarray([1.78e9]))[0] == pytest.approx(1.285641)


def test_replay_cli_on_shipped_traces(fixture_traces, capsys):
    d = fixture_traces / SKY / "availability/1-node/aws-fixture"
    rc = main(["replay", "--trace", str(d / "us-west-2a_v100_1.json"), str(d / "us-west-2b_v100_1.json"),
               "--prices", str(fixture_traces / "training_on_a_dime/aws_spot_price_history.csv"),
               "--job-hours", "8", "--deadline-hours", "12", "--jobs", "2", "--json",
               "--policy", "on_demand", "--policy", "greedy_spot", "--policy", "optimal", "--policy", "orchd"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    p = doc["policies"]
    assert set(p) == {"on_demand", "greedy_spot", "optimal", "orchd"} and doc["zones"] == ["us-west-2a", "us-west-2b"]
    assert p["on_demand"]["od_share"] == 1.0 and 0.0 <= p["orchd"]["od_share"] <= 1.0
    assert p["optimal"]["cost_ratio"] <= p["greedy_spot"]["cost_ratio"] <= p["on_demand"]["cost_ratio"]


def test_orchd_core_on_a_shipped_trace(fixture_traces):
    d = fixture_traces / SKY / "preemption/1-node/aws-fixture"
    sc = build([traces.load_trace(p) for p in sorted(d.glob("*.json"))], spot_price_ratio=0.3)
    job = Job(start_tick=20, work_q=int(8 * 3600 / sc.quantum_s), deadline_ticks=int(16 * 3600 / sc.tick_s))
    jr, wr = run_orchd_job(sc, job, WorldParams(no_notice_share=0.0, capacity_error_p=0.0), record=True)
    assert any(what == "core:launch" for _, what, _ in wr.timeline)
    assert jr.deadline_met and jr.cost_usd > 0 and wr.useful_s <= wr.billed_node_s + 1e-6


def _run_trace_tests(traces_dir: Path, *, ci: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ORCH_CI", "PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS")}
    env["ORCH_TRACES_DIR"] = str(traces_dir)
    if ci:
        env["ORCH_CI"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "traces", "-p", "no:cacheprovider", "-p", "no:xdist",
         "tests/simulations"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )


def test_without_the_traces_their_tests_skip_with_how_to_get_them(tmp_path):
    missing = tmp_path / "no-traces-here"
    r = _run_trace_tests(missing, ci=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    counts = out.strip().splitlines()[-1]
    assert "skipped" in counts and "error" not in counts and "failed" not in counts and "passed" not in counts
    assert int(counts.split(" skipped")[0].split()[-1]) >= 16
    assert f"the public spot traces are not at {missing}" in out and "'Data and citation'" in out
    ci = _run_trace_tests(missing, ci=True)  # in CI the same tests are required: they fail, never skip
    assert ci.returncode == 1 and "required in CI: the public spot traces are not at" in ci.stdout
