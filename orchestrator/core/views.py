"""Read-only views of a State for the shell, the admin API and the simulator (pure, no Tx needed)."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.core import sweeps
from orchestrator.core.costs import burn_usd_h, cost_now
from orchestrator.core.model import GEN_PHASES, JobPhase
from orchestrator.core.state import State
from orchestrator.core.tx import Tx


def job_cost_usd(state: State, job_id: str, now: float) -> float:
    """$ the job has cost up to ``now``: its closed nodes (with termination tails) plus the live ones."""
    job = state.jobs[job_id]
    return cost_now(Tx(state, "view", now), job)


def job_burn_usd_h(state: State, job_id: str) -> float:
    """$ per hour the job's billed nodes cost at current prices."""
    return burn_usd_h(Tx(state, "view", 0.0), state.jobs[job_id])


def job_step(state: State, job_id: str) -> int:
    """The job's current training step (orchctl's ``step``, the ``orchd_job_step`` gauge).

    Not the highest step ever seen: a generation resumes from the last committed checkpoint, so the
    steps a lost generation ran past it are not progress. While a generation runs, the step all of its
    ranks have reached: the lowest step its members report (the ranks of a synchronous job move
    together; every member's step starts again at the committed step when a generation starts, in
    ``lifecycle.start_generation``). Between generations, the committed step (where the next one
    resumes); a job that completed, its last step."""
    job = state.jobs[job_id]
    if job.phase == JobPhase.SUCCEEDED:
        return max(job.step, job.committed_step)
    if job.phase not in GEN_PHASES:
        return job.committed_step
    reported = [n.step for nid in job.gen_nodes
                if (n := state.nodes.get(nid)) is not None and n.generation == job.generation]
    return max(job.committed_step, min(reported, default=job.committed_step))


@dataclass(frozen=True, slots=True)
class SweepView:
    """A sweep as the core holds it to its cap (core/sweeps.py): the cap (the smallest budget and earliest
    deadline its jobs carry), the cost of all its jobs so far, how many jobs, and why it takes no new trial
    (``closed``: ``sweep_budget`` / ``sweep_deadline``, None while open)."""

    budget_usd: float | None
    deadline_ts: float | None
    cost_usd: float
    jobs: int
    closed: str | None


def sweep_view(state: State, sweep_id: str, now: float) -> SweepView:
    tx = Tx(state, "view", now)
    jobs = sweeps.members(tx, sweep_id)
    cap = sweeps.cap_of(j.spec for j in jobs)
    return SweepView(cap.budget_usd, cap.deadline_ts, sweeps.sweep_cost_usd(tx, jobs), len(jobs),
                     sweeps.closed_reason(tx, jobs, cap))
