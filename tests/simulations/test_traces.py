"""Parsers on the real public trace files in ../shared/traces (read at run time, never copied)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from simulations import traces
from simulations.scenario import build


def test_skypilot_availability_file(shared):
    f = shared / "skypilot-spot-traces/availability/1-node/aws-10-26-2022/us-west-2a_v100_1.json"
    tr = traces.load_trace(f)
    assert (tr.zone, tr.region, tr.cloud, tr.instance_type) == ("us-west-2a", "us-west-2", "aws", "p3.2xlarge")
    assert tr.gap_s == 600 and len(tr.values) == 3895
    assert set(np.unique(tr.values)) <= {0, 1} and tr.nodes_probed == 1
    assert tr.values.sum() == sum(json.loads(f.read_text())["data"])


def test_skypilot_multinode_and_gcp(shared):
    tr = traces.load_trace(shared / "skypilot-spot-traces/preemption/4-node/aws-08-03-2023/us-east-2a_v100_1.json")
    assert tr.nodes_probed == 4 and tr.values.max() == 4 and tr.gap_s == 300
    g = traces.load_trace(shared / "skypilot-spot-traces/preemption/1-node/gcp-04-30-2023/us-central1-a_c3-88.json")
    assert (g.cloud, g.region, g.instance_type) == ("gcp", "us-central1", "c3-highcpu-88")


def test_bamboo_event_log(shared):
    with pytest.raises(traces.TraceFormatError, match="probe size"):  # never guessed from the maximum
        traces.load_trace(shared / "bamboo/traces/p3-trace.csv", gap_s=60.0)
    tr = traces.load_trace(shared / "bamboo/traces/p3-trace.csv", gap_s=60.0, probe_nodes=32)
    assert tr.instance_type == "p3.2xlarge" and tr.nodes_probed == 32
    assert tr.values.max() == 32  # README: up to 32 nodes
    assert 23 < tr.values.mean() < 25  # README: mean 24.0 nodes
    assert 11 < tr.duration_s / 3600 < 12  # 11.4 h


def test_bamboo_gcloud_group_log_sorted(shared):
    tr = traces.load_trace(shared / "bamboo/traces/gcloud/v100x1-east1c.txt", gap_s=60.0, probe_nodes=80)
    assert (tr.cloud, tr.zone, tr.region) == ("gcp", "us-east1-c", "us-east1")
    assert 20 < tr.duration_s / 3600 < 30


def test_aws_price_history(shared):
    book = traces.load_prices(shared / "training_on_a_dime/aws_spot_price_history_p2_p3_2019-2020.csv")
    s = book.lookup("us-east-1c", "us-east-1", "p3.2xlarge")
    assert s is not None and np.all(np.diff(s.times) >= 0)
    assert 0.9 <= float(np.median(s.prices)) <= 1.1  # 0.31-0.34 x 3.06
    # us-west-2a has no row of its own in some windows: falls back to a zone of the same region
    assert book.lookup("us-west-2z", "us-west-2", "p3.2xlarge") is not None
    assert book.lookup("us-west-2z", "us-west-2", "no.such") is None


def test_gcp_changelog(shared):
    book = traces.load_prices(shared / "google-cloud-pricing-cost-calculator/gcp_gpu_vm_price_changelog.csv")
    s = book.lookup("us-central1-a", "us-central1", "a2-highgpu-1g")
    assert s is not None and s.on_demand is not None
    late = s.at(np.asarray([1.78e9]))[0]  # 2026
    assert 0 < late < float(np.nanmax(s.on_demand))


def test_bad_files_are_rejected(tmp_path):
    bad = tmp_path / "z_v100_1.json"
    bad.write_text('{"metadata": {}, "data": [1]}')
    with pytest.raises(traces.TraceFormatError):
        traces.load_trace(bad)
    log = tmp_path / "x-trace.csv"
    log.write_text("0,add,node1\n5,explode,node1\n")
    with pytest.raises(traces.TraceFormatError):
        traces.load_trace(log)
    with pytest.raises(traces.TraceFormatError):
        traces.load_prices(log)


def test_scenario_resamples_to_common_grid_with_min(shared):
    d = shared / "skypilot-spot-traces/preemption/1-node/aws-04-22-2023"
    trs = [traces.load_trace(p) for p in sorted(d.glob("*.json"))]
    sc = build(trs, spot_price_ratio=0.3, min_tick_s=320.0)
    assert sc.tick_s == 320.0 and sc.avail.shape == (4, min(len(t.values) for t in trs) // 10)
    # a tick is available only if all 10 samples inside it were
    assert sc.avail[0, 0] == trs[0].values[:10].min()
    assert np.allclose(sc.spot_price, 0.3 * 3.06)
