"""A sweep's total budget and deadline in the pure core (orchestrator/core/sweeps.py): orchd, not the sweep
controller, stops every trial of a sweep at either - checkpoint first, terminal reason ``sweep_budget`` /
``sweep_deadline`` - and refuses new trials of a closed sweep; a later submit cannot raise the cap."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest

from orchestrator.core import CoreConfig, JobPhase, State, job_cost_usd, state_from_records, state_to_records
from orchestrator.core.inputs import JobSubmitted, Tick
from orchestrator.core.model import Intent
from orchestrator.jobspec import spec_problems
from tests.core.harness import (
    CheckpointCmd,
    CheckpointCommitted,
    Driver,
    GenerationStarted,
    RanksExited,
    Terminate,
    cmds,
    pool,
    price,
    spec,
)

A = pool("p4d.24xlarge", "us-east-1a")
T0 = 1_800_000_000.0  # now, in unix seconds (deadlines are absolute)


def trial(n: int, sweep: str = "sw", **kw: Any):
    base: dict[str, Any] = dict(nodes=1, nodes_max=1, sweep_id=sweep)
    base.update(kw)
    return spec(checkpoint=spec().checkpoint.__class__(url=f"file:///ckpt/{sweep}-t{n}", save_s_estimate=20.0),
                **base)


def start(drv: Driver, job_id: str, s) -> list[str]:
    d = drv(JobSubmitted(job_id=job_id, spec=s))
    ids = drv.launched(d)
    drv.register(ids)
    drv(GenerationStarted(id=f"g-{job_id}", node_id=ids[0], job_id=job_id, generation=1, first_step=1,
                          ts=drv.now), dt=1)
    assert drv.job(job_id).phase == JobPhase.RUNNING
    return ids


def drv_with_price(usd: float = 10.0) -> Driver:
    drv = Driver(State.empty(CoreConfig(price_confirm_s=0.0)), now=T0)
    drv(price(A, usd))
    return drv


def ticks_until(drv: Driver, cond, dt: float = 5.0, limit: int = 5000) -> None:
    for _ in range(limit):
        if cond():
            return
        drv(Tick(), dt=dt)
    raise AssertionError("condition never held")


def checkpoint_and_exit(drv: Driver, job_id: str, node: str) -> None:
    drv(CheckpointCommitted(id=f"c-{job_id}", node_id=node, job_id=job_id, generation=1, step=50,
                            checkpoint_id="s", url=f"file:///ckpt/{job_id}/s", save_s=5.0, ts=drv.now), dt=1)
    drv(RanksExited(id=f"x-{job_id}", node_id=node, job_id=job_id, generation=1, exit_code=75,
                    reason="emergency_checkpoint", last_step=50, ts=drv.now), dt=1)


def sweep_cost(drv: Driver, sweep: str = "sw") -> float:
    return sum(job_cost_usd(drv.state, j, drv.now) for j, job in drv.state.jobs.items() if job.spec.sweep_id == sweep)


def test_the_sweep_budget_stops_every_trial_checkpoint_first_and_closes_the_sweep() -> None:
    drv = drv_with_price(10.0)  # 10 $/h per node; two trials -> 20 $/h; budget 10 $ -> about 30 minutes
    n0 = start(drv, "sw-t0000", trial(0, sweep_budget_usd=10.0))
    n1 = start(drv, "sw-t0001", trial(1, sweep_budget_usd=10.0))
    other = start(drv, "solo", spec(nodes=1, nodes_max=1, checkpoint=spec().checkpoint.__class__(url="file:///o")))
    ticks_until(drv, lambda: drv.job("sw-t0000").intent == Intent.SWEEP_BUDGET)
    # both trials asked to checkpoint for the sweep at once, the other job untouched; no trial has a budget
    asked = {c.job_id: c.reason for d in drv.decisions[-2:] for c in cmds(d, CheckpointCmd)}
    assert asked == {"sw-t0000": "sweep_budget", "sw-t0001": "sweep_budget"}
    assert drv.job("sw-t0001").intent == Intent.SWEEP_BUDGET and drv.job("sw-t0000").spec.budget_usd is None
    assert drv.job("solo").phase == JobPhase.RUNNING and other
    # under the cap by the termination tails (at the on-demand price) and one checkpoint at the burn
    assert 0.8 * 10.0 < sweep_cost(drv) < 10.0
    # a new trial of the closed sweep is refused, with the reason in the audit
    d = drv(JobSubmitted(job_id="sw-t0002", spec=trial(2, sweep_budget_usd=10.0)))
    assert "sw-t0002" not in drv.state.jobs
    (refused,) = [a for a in d.audit if a.action == "submit_refused"]
    assert refused.reason == "sweep_budget" and "sweep 'sw' is closed (sweep_budget)" in str(refused.details)
    for job_id, node in (("sw-t0000", n0[0]), ("sw-t0001", n1[0])):
        checkpoint_and_exit(drv, job_id, node)
    for job_id in ("sw-t0000", "sw-t0001"):
        job = drv.job(job_id)
        assert (job.phase, job.reason, job.nodes) == (JobPhase.STOPPED, "sweep_budget", ())
    assert sweep_cost(drv) <= 10.0  # the termination tails included
    assert drv.job("solo").phase == JobPhase.RUNNING


def test_hard_stop_when_the_checkpoint_hangs() -> None:
    drv = drv_with_price(10.0)
    start(drv, "sw-t0000", trial(0, sweep_budget_usd=2.0))
    ticks_until(drv, lambda: drv.job("sw-t0000").phase == JobPhase.STOPPED)
    assert drv.job("sw-t0000").reason == "sweep_budget" and not drv.state.nodes
    assert any(a.reason == "sweep_budget_hard_stop" for d in drv.decisions for a in d.audit)
    assert sweep_cost(drv) <= 2.0


def test_the_deadline_stops_running_and_waiting_trials_and_refuses_new_ones() -> None:
    drv = drv_with_price(10.0)
    deadline = T0 + 120.0
    n0 = start(drv, "sw-t0000", trial(0, sweep_deadline_ts=deadline))
    # a trial with no capacity anywhere (another GPU type): it waits, with no nodes
    drv(JobSubmitted(job_id="sw-t0001", spec=trial(1, gpu_type="H100")))
    assert drv.job("sw-t0001").phase == JobPhase.PENDING
    ticks_until(drv, lambda: drv.now >= deadline - 5.0)
    assert drv.job("sw-t0000").phase == JobPhase.RUNNING  # not before the deadline
    ticks_until(drv, lambda: drv.job("sw-t0000").intent == Intent.SWEEP_DEADLINE)
    assert drv.now - deadline <= 5.0  # at the first Tick after it
    assert drv.job("sw-t0001").phase == JobPhase.STOPPED and drv.job("sw-t0001").reason == "sweep_deadline"
    d = drv(JobSubmitted(job_id="sw-t0002", spec=trial(2)))  # no values of its own: the sweep's apply
    assert "sw-t0002" not in drv.state.jobs
    assert [a.reason for a in d.audit if a.action == "submit_refused"] == ["sweep_deadline"]
    checkpoint_and_exit(drv, "sw-t0000", n0[0])
    assert (drv.job("sw-t0000").phase, drv.job("sw-t0000").reason) == (JobPhase.STOPPED, "sweep_deadline")


def test_a_later_submit_cannot_raise_the_cap() -> None:
    drv = drv_with_price(10.0)
    start(drv, "sw-t0000", trial(0, sweep_budget_usd=2.0, sweep_deadline_ts=T0 + 3600))
    # a hostile admin claims the sweep with a much bigger budget and a later deadline: the smallest holds
    start(drv, "evil", trial(9, sweep_budget_usd=1e6, sweep_deadline_ts=T0 + 10 * 86400))
    ticks_until(drv, lambda: drv.job("evil").intent == Intent.SWEEP_BUDGET or drv.job("evil").phase
                == JobPhase.STOPPED)
    assert drv.now < T0 + 600 and sweep_cost(drv) < 2.0
    assert drv.job("sw-t0000").intent == Intent.SWEEP_BUDGET or drv.job("sw-t0000").phase == JobPhase.STOPPED
    # a smaller deadline from a later job lowers it (stopping sooner is always allowed: so is a cancel)
    drv2 = drv_with_price(10.0)
    start(drv2, "sw-t0000", trial(0, sweep_deadline_ts=T0 + 3600))
    start(drv2, "sw-t0001", trial(1, sweep_deadline_ts=T0 + 60))
    ticks_until(drv2, lambda: drv2.job("sw-t0000").intent == Intent.SWEEP_DEADLINE)
    assert drv2.now < T0 + 80


def test_jobs_of_other_sweeps_and_without_caps_are_not_touched() -> None:
    drv = drv_with_price(10.0)
    start(drv, "a-t0000", trial(0, sweep="a", sweep_budget_usd=2.0))
    start(drv, "b-t0000", trial(0, sweep="b"))  # a sweep without caps: never stopped by the core
    ticks_until(drv, lambda: drv.job("a-t0000").phase == JobPhase.STOPPED
                or drv.job("a-t0000").intent == Intent.SWEEP_BUDGET)
    ticks_until(drv, lambda: drv.now > T0 + 3 * 3600, dt=60.0)
    assert drv.job("b-t0000").phase == JobPhase.RUNNING and drv.job("b-t0000").intent == Intent.NONE


def test_caps_are_validated_and_unset_caps_keep_the_old_bytes() -> None:
    assert spec_problems(trial(0, sweep_budget_usd=5.0, sweep_deadline_ts=T0)) == []
    probs = spec_problems(trial(0, sweep_budget_usd=math.inf, sweep_deadline_ts=math.nan))
    assert probs == ["sweep_budget_usd: must be a number within 1e-06 .. 1e+09, got inf",
                     "sweep_deadline_ts: must be a number within 1e+09 .. 1e+11, got nan"]
    assert spec_problems(trial(0, sweep_budget_usd=-1.0)) == [
        "sweep_budget_usd: must be a number within 1e-06 .. 1e+09, got -1.0"]
    assert spec_problems(trial(0, sweep_budget_usd=1e12)) == [
        "sweep_budget_usd: must be a number within 1e-06 .. 1e+09, got 1000000000000.0"]
    no_sweep = spec(sweep_budget_usd=5.0)
    assert spec_problems(no_sweep) == ["sweep_budget_usd: only on a job of a sweep (with sweep_id)"]
    enc = msgspec.json.encode(trial(0))
    assert b"sweep_budget" not in enc and b"sweep_deadline" not in enc


@pytest.mark.parametrize("value", [-5.0, 0.0])
def test_the_core_ignores_values_that_are_not_positive(value: float) -> None:
    """The admin path refuses them (above); the core, handed one anyway, neither raises nor stops on it
    (a non-finite one never reaches a record: Tx.decision refuses it)."""
    drv = drv_with_price(10.0)
    start(drv, "sw-t0000", trial(0, sweep_budget_usd=value))
    ticks_until(drv, lambda: drv.now > T0 + 600)
    assert drv.job("sw-t0000").phase == JobPhase.RUNNING


def test_the_stop_survives_the_records() -> None:
    drv = drv_with_price(10.0)
    start(drv, "sw-t0000", trial(0, sweep_budget_usd=2.0))
    ticks_until(drv, lambda: drv.job("sw-t0000").intent == Intent.SWEEP_BUDGET)
    again = state_from_records(state_to_records(drv.state))
    assert again.jobs["sw-t0000"].intent == Intent.SWEEP_BUDGET
    assert again.jobs["sw-t0000"].spec.sweep_budget_usd == 2.0
    d = Driver(again, now=drv.now)(JobSubmitted(job_id="sw-t0001", spec=trial(1)))
    assert [a.reason for a in d.audit if a.action == "submit_refused"] == ["sweep_budget"]
    assert not cmds(d, Terminate)


def test_a_launch_reserves_the_sweeps_budget() -> None:
    """A trial launches only if what the sweep spent, what its live trials are committed to (boot, one
    checkpoint, two Ticks, the termination tail - a node launched and not billed yet included) and this
    launch fit the cap; the others wait while a trial holds nodes, and stop (sweep_budget) once none does."""
    drv = drv_with_price(10.0)
    for n in range(3):  # submitted in a row, no node billed yet: the requested nodes are reserved too
        drv(JobSubmitted(job_id=f"sw-t000{n}", spec=trial(n, sweep_budget_usd=1.5)))
    launched = [j for j in ("sw-t0000", "sw-t0001", "sw-t0002") if drv.job(j).nodes]
    assert launched == ["sw-t0000"]
    for j in ("sw-t0001", "sw-t0002"):
        assert drv.job(j).phase == JobPhase.PENDING and drv.job(j).reason == "launch_refused_sweep_budget"
    refused = [a for d in drv.decisions for a in d.audit if a.action == "launch_refused"]
    assert {a.reason for a in refused} == {"sweep_budget"} and refused[0].details["figures"]["budget_usd"] == 1.5
    (nid,) = drv.job("sw-t0000").nodes
    drv.register([nid])
    drv(GenerationStarted(id="g-0", node_id=nid, job_id="sw-t0000", generation=1, first_step=1, ts=drv.now), dt=1)
    ticks_until(drv, lambda: all(drv.job(f"sw-t000{n}").phase == JobPhase.STOPPED for n in range(3)))
    assert [drv.job(f"sw-t000{n}").reason for n in range(3)] == ["sweep_budget"] * 3
    assert not any(drv.job(j).nodes for j in ("sw-t0001", "sw-t0002"))  # never launched
    assert sweep_cost(drv) <= 1.5


@pytest.mark.parametrize("budget", [0.02, 1e-6])
def test_a_budget_below_one_nodes_commitment_launches_nothing(budget: float) -> None:
    """The attack: a sweep whose budget cannot carry one node's termination tail (0.02 USD, 3 trials).
    Nothing launches: the first trial stops at once with sweep_budget, which closes the sweep, so the
    others are refused at submit; nothing is spent."""
    drv = drv_with_price(10.0)
    refused = []
    for n in range(3):
        d = drv(JobSubmitted(job_id=f"sw-t000{n}", spec=trial(n, sweep_budget_usd=budget)))
        refused += [a.reason for a in d.audit if a.action == "submit_refused"]
    assert not drv.state.nodes and sweep_cost(drv) == 0.0
    assert (drv.job("sw-t0000").phase, drv.job("sw-t0000").reason) == (JobPhase.STOPPED, "sweep_budget")
    assert refused == ["sweep_budget", "sweep_budget"] and list(drv.state.jobs) == ["sw-t0000"]
