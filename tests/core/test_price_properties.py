"""Price policy properties: pause/resume hysteresis never flaps; a forced on-demand job never launches spot."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.core import CoreConfig, JobPhase, State
from orchestrator.core.commands import Launch
from orchestrator.core.inputs import JobSubmitted, Tick
from tests.core.harness import Driver, cmds, pool, price, spec
from wire import CheckpointCommitted, Market, RanksExited

A = pool("p4d.24xlarge", "us-east-1a")
OD = 30.0


@settings(max_examples=60, deadline=None)
@given(ratios=st.lists(st.floats(0.5, 0.999), min_size=5, max_size=60))
def test_pause_resume_hysteresis_never_flaps(ratios: list[float]) -> None:
    drv = Driver(State.empty(CoreConfig(price_confirm_s=0.0)), check_records=False)  # prices act at once
    drv(price(A, 0.5 * OD, od=OD))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_max=1, nodes_min=1, total_steps=10**6)))
    drv.register(drv.launched(d))
    from wire import GenerationStarted as GS

    drv(GS(id="g0", node_id=drv.job().gen_nodes[0], job_id="j1", generation=1, first_step=1, ts=drv.now))
    assert drv.job().phase == JobPhase.RUNNING
    pp = drv.job().spec.price
    current = 0.5
    for r in ratios:
        drv(price(A, round(r * OD, 6), od=OD))
        current = round(r * OD, 6) / OD
        for _ in range(2):
            d = drv(Tick(), dt=1)
            ids = drv.launched(d)  # the cloud and the agent cooperate instantly
            if ids:
                drv.register(ids)
            for a in d.audit:
                if a.action == "pause":
                    assert current > pp.pause_above_ratio
                if a.action == "resume":
                    assert current < pp.resume_below_ratio
            job = drv.job()
            if job.phase == JobPhase.CHECKPOINTING:  # the trainer commits and exits at once
                for n in job.gen_nodes:
                    drv(CheckpointCommitted(id="c", node_id=n, job_id="j1", generation=job.generation, step=1,
                                            checkpoint_id="s", url="u", save_s=1.0, ts=drv.now))
                    drv(RanksExited(id=f"x{job.generation}", node_id=n, job_id="j1", generation=job.generation,
                                    exit_code=75, reason="emergency_checkpoint", last_step=1, ts=drv.now))
            if job.phase == JobPhase.STARTING:
                from wire import GenerationStarted

                drv(GenerationStarted(id="g", node_id=job.gen_nodes[0], job_id="j1", generation=job.generation,
                                      first_step=1, ts=drv.now))
    pauses = sum(1 for d in drv.decisions for a in d.audit if a.action == "pause")
    resumes = sum(1 for d in drv.decisions for a in d.audit if a.action == "resume")
    assert resumes <= pauses <= resumes + 1
    if any(r > pp.pause_above_ratio for r in ratios):
        assert pauses >= 1  # the property is not vacuous


@settings(max_examples=40, deadline=None)
@given(prices=st.lists(st.floats(0.1, 0.9), min_size=1, max_size=30), slack=st.floats(3000.0, 8000.0))
def test_forced_on_demand_never_launches_spot(prices: list[float], slack: float) -> None:
    drv = Driver(check_records=False)
    drv(price(A, 0.3 * OD, od=OD))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_max=2, total_steps=5000, deadline_ts=drv.now + slack)))
    drv.register(drv.launched(d))
    forced = False
    for p in prices:
        drv(price(A, p * OD, od=OD))
        d = drv(Tick(), dt=5)
        if forced:
            assert all(la.pool.market == Market.ON_DEMAND for la in cmds(d, Launch))
        forced = forced or drv.job().force_on_demand
        ids = drv.launched(d)
        if ids:
            drv.register(ids)
    assert forced == drv.job().force_on_demand
