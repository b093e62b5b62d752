"""Read-only views of a State for the shell, the admin API and the simulator (pure, no Tx needed)."""

from __future__ import annotations

from orchestrator.core import lifecycle as lc
from orchestrator.core.model import State
from orchestrator.core.tx import Tx


def job_cost_usd(state: State, job_id: str, now: float) -> float:
    """$ the job has cost up to ``now``: its closed nodes (with termination tails) plus the live ones."""
    job = state.jobs[job_id]
    return lc.cost_now(Tx(state, "view", now), job)


def job_burn_usd_h(state: State, job_id: str) -> float:
    """$ per hour the job's billed nodes cost at current prices."""
    return lc.burn_usd_h(Tx(state, "view", 0.0), state.jobs[job_id])


def job_step(state: State, job_id: str) -> int:
    """Best known progress: last committed / generation-end step or the newest heartbeat step."""
    return lc.progress_step(Tx(state, "view", 0.0), state.jobs[job_id])
