"""A sweep's total budget and deadline, enforced by the core over every job of the sweep.

Role: the jobs of a sweep (``JobSpec.sweep_id``, docs/sweeps.md) carry the sweep's total budget and
deadline (``sweep_budget_usd``, ``sweep_deadline_ts``). The core, not the sweep controller, holds the sweep
to them, so a sweep whose controller is down still stops:

- **The cap is the smallest value any job of the sweep carries** (terminal jobs included, and jobs never
  leave the state): a later submit that names an existing sweep id with a bigger budget or a later deadline
  cannot raise the cap; one with a smaller value lowers it (an admin can cancel those jobs anyway). A
  value that is not a finite positive number is ignored here (orchd's submit refuses it: jobspec.py).
- **Cost** is the sum of ``cost_now`` over every job with that sweep id, ended ones included.
- **Stop** (``on_tick``, before the jobs' own Ticks): once the deadline has passed, or once the budget
  left no longer covers the running trials' checkpoint and termination at their current burn (the
  margins of ``policy.check_budget``, summed over the sweep's live jobs), every live job of the sweep is
  stopped in order: a running generation checkpoints first (intent ``sweep_budget`` / ``sweep_deadline``,
  lifecycle.py ends it as STOPPED with that reason), a job without one stops at once. When even one more
  Tick at the current burn would cross the budget, the jobs are terminated at once (hard stop).
- **Refuse** (``submit_refusal``): a new job of a sweep that is closed - deadline passed, a job of it
  stopped or stopping for the budget, or its cost at the budget - is refused at submit, with the reason.

A job of a sweep never sleeps in the Tick index (timers.deadline_driven): its own Tick must see the
sweep's stop on the Tick it comes. The sweep pass itself reads the index of the sweeps' jobs
(``Timers.sweeps``, ``open_sweeps``): each Tick visits the sweeps that may still have an unfinished job
and their jobs only, whatever the number of other jobs, finished sweeps included.

Pure: no I/O, no clock (``tx.now``).
"""

from __future__ import annotations

from typing import Final

from orchestrator.core import lifecycle as lc
from orchestrator.core.costs import burn_usd_h, worst_burn_usd_h
from orchestrator.core.model import TERMINAL_JOB_PHASES, Intent, Job, JobPhase
from orchestrator.core.pricing import save_seconds
from orchestrator.core.state import State
from orchestrator.core.sweep_budget import SWEEP_BUDGET, SweepCap, cap_of, members, sweep_cost_usd, sweep_of
from orchestrator.core.tx import Tx
from wire.messages import JobSpec

__all__ = ["SWEEP_BUDGET", "SWEEP_DEADLINE", "SweepCap", "cap_of", "closed_reason", "members", "on_tick",
           "refusal_view", "submit_refusal", "sweep_cost_usd", "sweep_of"]

J = JobPhase
SWEEP_DEADLINE: Final = "sweep_deadline"
_INTENTS: Final = {SWEEP_BUDGET: Intent.SWEEP_BUDGET, SWEEP_DEADLINE: Intent.SWEEP_DEADLINE}
# a running checkpoint with one of these intents keeps it (the job ends as asked: cancelled, or stopped
# at its own budget); any other intent (preemption, pause, drain, ...) is replaced by the sweep's stop
_KEEP: Final = frozenset({Intent.CANCEL, Intent.BUDGET, Intent.SWEEP_BUDGET, Intent.SWEEP_DEADLINE})


def _stopping(job: Job) -> str | None:
    """The sweep reason a job of the sweep stopped (or is stopping) for, else None."""
    if job.intent in (Intent.SWEEP_BUDGET, Intent.SWEEP_DEADLINE):
        return str(job.intent)
    if job.phase == J.STOPPED and job.reason in _INTENTS:
        return job.reason
    return None


def closed_reason(tx: Tx, jobs: list[Job], cap: SweepCap) -> str | None:
    """Why the sweep takes no new job: its deadline passed, a job of it stopped (or is stopping) for the
    sweep's budget, or its cost reached the budget. None: open."""
    if cap.deadline_ts is not None and tx.now >= cap.deadline_ts:
        return SWEEP_DEADLINE
    if cap.budget_usd is not None:
        if any(_stopping(j) == SWEEP_BUDGET for j in jobs):
            return SWEEP_BUDGET
        if sweep_cost_usd(tx, jobs) >= cap.budget_usd:
            return SWEEP_BUDGET
    return None


def submit_refusal(tx: Tx, spec: JobSpec) -> tuple[str, str] | None:
    """(reason, message) when a new job with this spec is refused because of its sweep - the message names
    the sweep, the reason, the cap and the cost -, or None. The spec's own values count toward the cap."""
    sid = sweep_of(spec)
    if sid is None:
        return None
    jobs = members(tx, sid)
    cap = cap_of([*(j.spec for j in jobs), spec])
    why = closed_reason(tx, jobs, cap)
    if why is None:
        return None
    if why == SWEEP_DEADLINE:
        return why, (f"sweep {sid!r} is closed (sweep_deadline): its deadline {cap.deadline_ts} has passed; "
                     "no new trial of it starts")
    return why, (f"sweep {sid!r} is closed (sweep_budget): its jobs cost {sweep_cost_usd(tx, jobs):.4f} USD of "
                 f"its budget of {cap.budget_usd} USD; no new trial of it starts")


# --- the Tick ---------------------------------------------------------------------------------


def on_tick(tx: Tx) -> None:
    """Stop the sweeps that reached their budget or deadline. Visits only the open sweeps of the index
    (timers.py: the sweeps that may still have an unfinished job) and their jobs; a sweep found with none
    left to finish leaves the open ones."""
    opened = tx.timers.open_sweeps
    if not opened:
        return
    done: list[str] = []
    for sid in sorted(opened):
        jobs = members(tx, sid)
        if all(j.phase in TERMINAL_JOB_PHASES for j in jobs):
            done.append(sid)
        else:
            _enforce(tx, sid, jobs)
    tx.timers = tx.timers.close_sweeps(done)


def _enforce(tx: Tx, sid: str, jobs: list[Job]) -> None:
    cap = cap_of(j.spec for j in jobs)
    live = [j for j in jobs if j.phase not in TERMINAL_JOB_PHASES]
    if not live or (cap.budget_usd is None and cap.deadline_ts is None):
        return
    cfg = tx.cfg
    if cap.deadline_ts is not None and tx.now >= cap.deadline_ts:
        _stop_all(tx, sid, live, SWEEP_DEADLINE, False, {"deadline_ts": cap.deadline_ts})
        return
    if cap.budget_usd is None:
        return
    cost = sweep_cost_usd(tx, jobs)
    burn = sum((burn_usd_h(tx, j) for j in live), 0.0)
    tail = sum((worst_burn_usd_h(tx, j) for j in live), 0.0) * cfg.terminate_s / 3600.0
    details = {"cost_usd": round(cost, 6), "budget_usd": cap.budget_usd, "burn_usd_h": round(burn, 6)}
    if cost + tail + burn * cfg.tick_s / 3600.0 >= cap.budget_usd:
        _stop_all(tx, sid, live, SWEEP_BUDGET, True, details)
        return
    save = max((save_seconds(j) for j in live), default=0.0)
    if (cost + tail + burn * (save + 2 * cfg.tick_s) / 3600.0 >= cap.budget_usd
            or any(_stopping(j) == SWEEP_BUDGET for j in jobs)):
        _stop_all(tx, sid, live, SWEEP_BUDGET, False, details)


def _stop_all(tx: Tx, sid: str, live: list[Job], why: str, hard: bool, details: dict[str, float]) -> None:
    """Stop every live job of the sweep: checkpoint then stop (``hard``: terminate now). ``details``: the
    figures the audit entries carry (under ``figures``)."""
    intent = _INTENTS[why]
    for job in live:
        job = tx.job(job.job_id)
        if job.phase in TERMINAL_JOB_PHASES or job.intent == intent and not hard:
            continue
        if not hard and job.phase in (J.CHECKPOINTING, J.RECOVERING):
            if job.intent not in _KEEP:
                tx.record(job.job_id, "stop", why, sweep_id=sid, figures=details)
                tx.update_job(job, intent=intent)
            continue
        tx.record(job.job_id, "stop", why + ("_hard_stop" if hard else ""), sweep_id=sid, figures=details)
        if not hard and job.phase in (J.STARTING, J.RUNNING):
            lc.checkpoint_job(tx, job, intent, why)
        else:
            job = lc.terminate_all(tx, job, why)
            tx.job_phase(job, J.STOPPED, reason=why, intent=Intent.NONE)


def refusal_view(state: State, spec: JobSpec, now: float) -> tuple[str, str] | None:
    """``submit_refusal`` on a state (the admin service says why the core refused a submit)."""
    return submit_refusal(Tx(state, "view", now), spec)
