"""Submit-time feasibility (issue item 5) and the wake-up time of a waiting job, as pure functions."""

from __future__ import annotations

from orchestrator.core import CoreConfig, JobPhase, State
from orchestrator.core.commands import Launch
from orchestrator.core.feasibility import deadline_problem, submit_problems, wake_up
from orchestrator.core.inputs import JobSubmitted, LaunchFailed, Tick
from tests.core.harness import Driver, cmds, pool, price, spec
from wire import FailureReason

A = pool("p4d.24xlarge", "us-east-1a")
T0 = 1000.0


def test_a_job_no_enabled_cloud_can_run_is_refused() -> None:
    cfg = CoreConfig()
    problems = submit_problems(spec(clouds=("gcp",)), cfg, T0, clouds=["aws"])
    assert problems == ["no enabled cloud can run this job: it allows clouds [gcp], orchd has [aws] enabled"]
    assert submit_problems(spec(clouds=("gcp",)), cfg, T0, clouds=["aws", "gcp"]) == []
    assert submit_problems(spec(), cfg, T0, clouds=[])[0].startswith("no enabled cloud can run this job")
    assert submit_problems(spec(clouds=("gcp",)), cfg, T0) == []  # clouds not known: not checked


def test_instance_types_outside_the_catalog_are_refused() -> None:
    cfg = CoreConfig(known_instance_types=("aws/p4d.24xlarge",))
    bad = submit_problems(spec(instance_types=("p5.48xlarge",)), cfg, T0, clouds=["aws"])
    assert len(bad) == 1 and "none of the instance types [p5.48xlarge]" in bad[0]
    assert submit_problems(spec(instance_types=("p5.48xlarge", "p4d.24xlarge")), cfg, T0, clouds=["aws"]) == []


def test_a_deadline_on_demand_cannot_meet_is_refused() -> None:
    cfg = CoreConfig()  # boot 240 s + restart 120 s
    need = 1000 * 1.0 + 360.0
    late = submit_problems(spec(total_steps=1000, deadline_ts=T0 + need - 1), cfg, T0, clouds=["aws"])
    assert len(late) == 1 and late[0].startswith("the deadline cannot be met even on on-demand: 0.28 h of work")
    assert submit_problems(spec(total_steps=1000, deadline_ts=T0 + need), cfg, T0, clouds=["aws"]) == []


def test_a_waiting_job_says_why_and_until_when() -> None:
    drv = Driver(State.empty(CoreConfig(price_confirm_s=0.0)), now=T0)
    drv(price(A, 10.0, od=None))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_min=1, nodes_max=1, market="spot")))
    (la,) = cmds(d, Launch)
    drv(LaunchFailed(node_ids=la.node_ids, job_id="j1", pool=la.pool, token=la.token, reason=FailureReason.CAPACITY))
    drv(Tick(), dt=5)
    job = drv.job()
    assert job.phase in (JobPhase.PENDING, JobPhase.PLACING, JobPhase.RESIZING)
    why, until = wake_up(job, drv.state.pools, drv.state.config, drv.now)
    assert why == "no_feasible_pool"
    assert until == drv.state.pools[A.name].backoff_until > drv.now  # the launch backoff ends then


def test_a_best_effort_job_is_accepted_with_an_out_of_reach_deadline() -> None:
    cfg = CoreConfig()
    late = spec(total_steps=1000, deadline_ts=T0 + 10.0)
    (problem,) = submit_problems(late, cfg, T0, clouds=["aws"])
    assert problem.endswith("(best_effort = true accepts it anyway)")
    best = spec(total_steps=1000, deadline_ts=T0 + 10.0, best_effort=True)
    assert submit_problems(best, cfg, T0, clouds=["aws"]) == []
    assert deadline_problem(best, cfg, T0) is not None  # still out of reach: only the refusal is waived
    # the flag waives nothing else
    assert submit_problems(spec(clouds=("gcp",), best_effort=True), cfg, T0, clouds=["aws"]) != []
