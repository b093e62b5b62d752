"""orchd's side of tracking without a server: the summary of a tracked job and the package check at submit."""

from __future__ import annotations

import msgspec

from orchestrator.core import JobPhase
from orchestrator.core.inputs import JobSubmitted, TrackingRunCreated
from orchestrator.core.model import CoreConfig
from orchestrator.core.state import State
from orchestrator.daemon import tracking
from tests.core.harness import Driver, pool, price, spec
from wire import TrackingSpec

TRACKED = TrackingSpec(uri="http://mlflow:5000", experiment="exp")


def _driver() -> Driver:
    drv = Driver(State.empty(CoreConfig(price_confirm_s=0.0)))
    drv(price(pool(), 10.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_max=1, tracking=TRACKED)))
    drv.register(drv.launched(d))
    return drv


def test_no_summary_before_the_run_exists_then_orchds_figures() -> None:
    drv = _driver()
    seen = tracking._Seen(preemptions=2)
    assert tracking.summarize(drv.state, drv.job(), seen, None, drv.now) is None
    drv(TrackingRunCreated(job_id="j1", run_id="r1"))
    s = tracking.summarize(drv.state, drv.job(), seen, 0.75, drv.now)
    assert s is not None and s.run_id == "r1" and s.uri == TRACKED.uri and s.status is None
    tags, metrics = dict(s.tags), dict(s.metrics)
    assert tags["orch.generations"] == "1" and tags["orch.preemptions"] == "2"
    assert tags["orch.pools"] == pool().name and "orch.final_checkpoint" not in tags
    assert metrics["orchd/goodput"] == 0.75 and metrics["orchd/preemptions"] == 2.0 and metrics["orchd/cost_usd"] >= 0
    # the same figures are not sent again; a change is
    later = tracking.summarize(drv.state, drv.job(), seen, 0.75, drv.now)
    assert later is not None and later.same_figures(s)
    seen.preemptions += 1
    changed = tracking.summarize(drv.state, drv.job(), seen, 0.75, drv.now)
    assert changed is not None and not changed.same_figures(s)


def test_the_end_closes_the_run_with_the_final_checkpoint() -> None:
    drv = _driver()
    drv(TrackingRunCreated(job_id="j1", run_id="r1"))
    job = msgspec.structs.replace(drv.job(), phase=JobPhase.SUCCEEDED, committed_url="file:///ckpt/j1/step_000000010",
                                  committed_step=10)
    s = tracking.summarize(drv.state, job, tracking._Seen(), None, drv.now)
    assert s is not None and s.status == "FINISHED"
    assert dict(s.tags)["orch.final_checkpoint"] == "file:///ckpt/j1/step_000000010"
    assert "orchd/goodput" not in dict(s.metrics)


def test_submit_refuses_tracking_without_the_client_package(monkeypatch) -> None:
    assert tracking.submit_problems(spec()) == []
    monkeypatch.setattr(tracking, "mlflow_available", lambda: False)
    (problem,) = tracking.submit_problems(spec(tracking=TRACKED))
    assert problem.startswith("tracking: this orchd cannot create MLflow runs") and "[tracking]" in problem
    assert tracking.submit_problems(spec()) == []
