"""The state gauges are refreshed in slices (``orchestrator.daemon.gauges.refresh_gauge_slices``), so that the
decide loop takes urgent inputs between them: a scrape between two slices must see every series at its
previous or its new value (none missing), and what left the state is gone once the refresh ends."""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgspec

from orchestrator.core.inputs import JobSubmitted
from orchestrator.daemon.gauges import refresh_gauge_slices, refresh_gauges
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.observe import MetricsObserver
from tests.core.harness import Driver, pool, price, spec
from wire import CheckpointPolicy, GpuStats

A = pool("p4d.24xlarge", "us-east-1a")
JOB_FAMILIES = ("orchd_job_cost_usd", "orchd_job_budget_usd", "orchd_job_step", "orchd_job_phase",
                "orchd_job_nodes", "orchd_jobs", "orchd_nodes", "orchd_node_heartbeat_age_seconds")


def _series(metrics: Metrics) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    return {(s.name, tuple(sorted(s.labels.items())))
            for fam in metrics.registry.collect() for s in fam.samples if s.name in JOB_FAMILIES}


def test_a_refresh_in_slices_never_hides_a_series_and_drops_what_left() -> None:
    drv = Driver()
    drv(price(A, 10.0))
    for i in range(6):
        one_root = CheckpointPolicy(url=f"file:///ckpt/j{i}", save_s_estimate=20.0)  # a root per job
        drv.launched(drv(JobSubmitted(job_id=f"j{i}", spec=spec(nodes=2, budget_usd=100.0, checkpoint=one_root))))
    metrics = Metrics()
    d = SimpleNamespace(state=drv.state, metrics=metrics, fencing_token=1, observer=MetricsObserver(metrics))
    refresh_gauges(d)
    full = _series(metrics)
    assert {lab for name, lab in full if name == "orchd_job_cost_usd"} == {(("job_id", f"j{i}"),) for i in range(6)}

    slices = refresh_gauge_slices(d, jobs_per_slice=1)
    seen = 0
    for _ in slices:  # between two slices (where the decide loop runs): every series is still there
        seen += 1
        assert _series(metrics) >= full
    assert seen >= 6  # it was sliced
    assert _series(metrics) == full

    d.state = msgspec.structs.replace(drv.state, jobs=drv.state.jobs.delete("j3"))
    refresh_gauges(d)
    left = {name for name, lab in _series(metrics) if ("job_id", "j3") in lab}
    assert left == set(), left
    assert metrics.registry.get_sample_value("orchd_job_cost_usd", {"job_id": "j2"}) is not None


GPU_FAMILIES = ("orchd_node_gpu_utilization_ratio", "orchd_node_gpu_temperature_celsius")


def _gpu_series(metrics: Metrics) -> int:
    return sum(1 for fam in metrics.registry.collect() for s in fam.samples if s.name in GPU_FAMILIES)


def test_every_part_of_the_refresh_keeps_to_the_slice_bound() -> None:
    """The GPU readings (8 a node: 80,000 at 10,000 nodes) and the removal of what left are sliced like the
    rest: a slice of 8 units sets or removes the series of at most 8 readings (2 series each)."""
    drv = Driver()
    drv(price(A, 10.0))
    for i in range(6):
        one_root = CheckpointPolicy(url=f"file:///ckpt/j{i}", save_s_estimate=20.0)
        drv.launched(drv(JobSubmitted(job_id=f"j{i}", spec=spec(nodes=2, checkpoint=one_root))))
    metrics = Metrics()
    observer = MetricsObserver(metrics)
    d = SimpleNamespace(state=drv.state, metrics=metrics, fencing_token=1, observer=observer)
    readings = tuple(GpuStats(index=g, util_pct=50.0, mem_used_mib=1.0, mem_total_mib=2.0, temp_c=60.0)
                     for g in range(8))
    for nid in drv.state.nodes:
        observer.gpus[nid] = (time.time(), readings)
    steps = []
    last = _gpu_series(metrics)
    for _ in refresh_gauge_slices(d, jobs_per_slice=1):  # 8 units a slice
        now = _gpu_series(metrics)
        steps.append(now - last)
        last = now
    assert last == 2 * 8 * len(drv.state.nodes) == 192
    assert max(steps) <= 16, steps  # one node's 8 readings a slice at most, not every node's at once

    observer.gpus.clear()  # every node stopped reporting: every series goes, in slices too
    steps = []
    for _ in refresh_gauge_slices(d, jobs_per_slice=1):
        now = _gpu_series(metrics)
        steps.append(last - now)
        last = now
    assert last == 0
    assert max(steps) <= 16, steps
