"""The job's step that orchctl and the ``orchd_job_step`` gauge report: ``orchestrator.core.job_step``,
the current step - after a generation is lost and the job resumes from an earlier checkpoint, the step
goes back to the committed step plus the new generation's progress, not the highest step ever seen."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec

from orchestrator.core import Decision, JobPhase, job_step
from orchestrator.core.inputs import JobCancelled, JobSubmitted, NodeGone, Tick
from orchestrator.core.model import TERMINAL_JOB_PHASES
from orchestrator.core.state import State
from orchestrator.daemon.gauges import refresh_gauges
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.summaries import job_summary
from tests.core.harness import (
    AgentState,
    CheckpointCommitted,
    Driver,
    GenerationStarted,
    Heartbeat,
    RanksExited,
    StartGenerationCmd,
    cmds,
    pool,
    price,
    spec,
)

A = pool("p4d.24xlarge", "us-east-1a")
B = pool("p4de.24xlarge", "us-east-1a")


def _beat(drv: Driver, node_ids: list[str], step: int) -> None:
    for node_id in node_ids:
        node = drv.state.nodes[node_id]
        drv(Heartbeat(node_id=node_id, seq=node.hb_seq + 1, ts=drv.now, state=AgentState.TRAINING, job_id="j1",
                      generation=node.generation, step=step, step_time_s=1.0))
    drv(Tick(), dt=1.0)


def _started(drv: Driver, d: Decision) -> int:
    """The generation that decision ``d`` started, confirmed by the trainer."""
    starts = cmds(d, StartGenerationCmd)
    assert starts, "a generation is started"
    gen = starts[0].generation
    drv(GenerationStarted(id=f"g{gen}", node_id=starts[0].node_id, job_id="j1", generation=gen, first_step=1,
                          ts=drv.now), dt=1.0)
    assert drv.job().phase == JobPhase.RUNNING
    return gen


def _run_to_100_committed_at_40(drv: Driver, ids: list[str]) -> None:
    for step in range(1, 41):
        _beat(drv, ids, step)
    drv(CheckpointCommitted(id="c40", node_id=ids[0], job_id="j1", generation=1, step=40, checkpoint_id="40",
                            url="file:///ckpt/j1/40", save_s=2.0, ts=drv.now))
    for step in range(41, 101):
        _beat(drv, ids, step)


def test_a_job_resumed_from_an_earlier_checkpoint_reports_its_current_step() -> None:
    drv = Driver()
    drv(price(A, 10.0))
    drv(price(B, 12.0))
    ids = drv.launched(drv(JobSubmitted(job_id="j1", spec=spec(nodes=2, nodes_min=2, nodes_max=2))))
    assert _started(drv, drv.register(ids)) == 1
    _run_to_100_committed_at_40(drv, ids)
    assert job_step(drv.state, "j1") == 100

    # One node vanishes without a notice: the generation is abandoned at step 100, and the next one
    # resumes from the checkpoint of step 40 (steps 41..100 are lost).
    lost = drv(NodeGone(node_id=ids[1], reason="provider_missing"))
    drv(RanksExited(id="x1", node_id=ids[0], job_id="j1", generation=1, exit_code=77, reason="abandoned",
                    last_step=100, ts=drv.now))
    assert drv.job().step == 100 and drv.job().committed_step == 40  # the highest step seen, the committed one
    assert job_step(drv.state, "j1") == 40  # between generations: where the next one resumes
    (replacement,) = drv.launched(lost)
    assert _started(drv, drv.register([replacement])) == 2
    for step in range(41, 46):
        _beat(drv, [ids[0], replacement], step)

    state = drv.state
    assert job_step(state, "j1") == 45  # committed 40 + 5 steps of generation 2, not the old maximum 100
    assert job_summary(state, state.jobs["j1"], drv.now)["step"] == 45
    metrics = Metrics()
    refresh_gauges(SimpleNamespace(state=state, metrics=metrics, fencing_token=1))  # what the gauges read of a Daemon
    assert metrics.registry.get_sample_value("orchd_job_step", {"job_id": "j1"}) == 45


def test_members_that_carry_over_into_the_resumed_generation_report_its_step() -> None:
    """Every member of the resumed generation ran the lost one too: their steps start again at the
    committed step (the core resets them at the generation's start), so the job reports 45, not 100."""
    drv = Driver()
    drv(price(A, 10.0))
    ids = drv.launched(drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_min=1, nodes_max=1))))
    assert _started(drv, drv.register(ids)) == 1
    _run_to_100_committed_at_40(drv, ids)
    d = drv(RanksExited(id="x1", node_id=ids[0], job_id="j1", generation=1, exit_code=1, reason="failed",
                        last_step=100, ts=drv.now), dt=1.0)
    while not cmds(d, StartGenerationCmd):  # the job restarts on the same node after its backoff
        node = drv.state.nodes[ids[0]]
        drv(Heartbeat(node_id=ids[0], seq=node.hb_seq + 1, ts=drv.now, state=AgentState.IDLE))
        d = drv(Tick(), dt=1.0)
    assert _started(drv, d) == 2
    assert job_step(drv.state, "j1") == 40
    for step in range(41, 46):
        _beat(drv, ids, step)
    assert job_step(drv.state, "j1") == 45


def test_a_finished_job_keeps_its_cost_but_no_budget_and_a_deleted_job_no_series() -> None:
    """``orchd_job_budget_usd`` exists only while the job can still spend: OrchdBudgetNearlySpent resolves
    when the job stops. A job no longer in the state leaves no series behind."""
    drv = Driver()
    drv(price(A, 10.0))
    drv.launched(drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_min=1, nodes_max=1, budget_usd=100.0))))
    metrics = Metrics()

    def gauges(state: State | None = None) -> tuple[float | None, float | None, float | None]:
        refresh_gauges(SimpleNamespace(state=state or drv.state, metrics=metrics, fencing_token=1))
        return tuple(metrics.registry.get_sample_value(name, {"job_id": "j1"})  # type: ignore[return-value]
                     for name in ("orchd_job_cost_usd", "orchd_job_budget_usd", "orchd_job_step"))

    cost, budget, _ = gauges()
    assert cost is not None and budget == 100.0
    drv(JobCancelled(job_id="j1"), dt=1.0)  # before any generation: cancelled at once
    assert drv.job().phase in TERMINAL_JOB_PHASES
    cost, budget, step = gauges()
    assert cost is not None and budget is None and step is not None
    assert gauges(msgspec.structs.replace(drv.state, jobs=drv.state.jobs.delete("j1"))) == (None, None, None)
