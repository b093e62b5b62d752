"""The state gauges are refreshed in slices (``orchestrator.daemon.state.refresh_gauge_slices``), so that the
decide loop takes urgent inputs between them: a scrape between two slices must see every series at its
previous or its new value (none missing), and what left the state is gone once the refresh ends."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec

from orchestrator.core.inputs import JobSubmitted
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.observe import MetricsObserver
from orchestrator.daemon.state import refresh_gauge_slices, refresh_gauges
from tests.core.harness import Driver, pool, price, spec
from wire import CheckpointPolicy

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
