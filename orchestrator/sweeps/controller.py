"""The sweep controller: reconciles every sweep in an Optuna storage with orchd's jobs, one pass at a time.

Role: Optuna's storage is the sweep's durable truth (its spec, its trials, their parameters, intermediate
values and states); orchd's state holds the trials' jobs. A pass reads both and moves each trial one step
on, so a controller (or orchd) that crashed anywhere resumes by running the next pass:

- a RUNNING trial's job id is ``trial_job_id(sweep, number)`` - the same on every try - and its job spec
  is rebuilt from the trial's parameters; a trial without a job (a crash between ``ask`` and the submit)
  is submitted again, and orchd's submit with a known id creates nothing (idempotent);
- a trial is bound to its job by the sweep id orchd holds in the job's record, never by the name: a job
  with the trial's id whose sweep id is not this sweep's (submitted by someone else, before or after) is
  neither adopted, reported nor cancelled; the trial gets a fresh job id (``store.JOB_ID``, recorded
  before its submit, so a crash in between reuses it) and runs under that;
- the newest heartbeat loss of the job's rank 0 becomes the intermediate value at the highest multiple of
  ``report_every_steps`` its step reached (once per step: a step re-run after a lost node reports
  nothing); the pruner decides on it; a pruned trial is recorded (``orch.prune_step``) *before* its job
  is cancelled, so a crash in between still ends it as PRUNED, never as a failure or twice;
- a terminal job ends its trial once (``tell(skip_if_finished=True)``): succeeded -> COMPLETE with the
  job's final loss, cancelled after pruning -> PRUNED, anything else -> FAIL with orchd's reason; a job
  orchd stopped for the sweep's total budget or deadline (``sweep_budget``, ``sweep_deadline``:
  core/sweeps.py), or a trial orchd refused at submit for them, FAILs with that reason and finishes the
  sweep with it;
- a new trial is asked for only while fewer than ``parallelism`` run, fewer than ``trials`` exist, the
  deadline has not passed, the sweep is not cancelled, orchd has not closed it and what its trials cost so
  far is below its budget (orchd stops them all at it and refuses more: core/sweeps.py).

A preempted trial is orchd's business: the job keeps its id and checkpoint root and resumes there in a
new generation; the trial is neither restarted nor told twice.

Concurrency contract: synchronous and blocking (Optuna's storage, orchd through ``OrchdApi``); run a pass
in a worker thread. One controller per storage acts at a time: the service holds a lease in the storage
(lease.py) and hands ``may_act`` in, checked before each sweep of a pass.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from orchestrator.sweeps import store
from orchestrator.sweeps.spec import SweepSpec, trial_job_id, trial_jobspec
from wire import JobSpec

TERMINAL: Final = frozenset({"succeeded", "failed", "cancelled", "stopped"})
ORCHD_STOPS: Final = frozenset({"sweep_budget", "sweep_deadline"})
"""Why orchd stops a sweep's jobs (core/sweeps.py): the trial FAILs with it and the sweep finishes with it."""


class OrchdUnavailable(Exception):
    """orchd (or NATS) did not answer: the pass stops and the next one retries."""


class SweepClosed(Exception):
    """orchd refused a trial's job: its sweep is closed (``reason``: sweep_budget | sweep_deadline)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class TrialRefused(Exception):
    """orchd refused a trial's job spec for good (its 400: e.g. no enabled cloud can run it, a field out of
    bounds): the trial FAILs with orchd's message; submitting it again would be refused again."""


class OrchdApi(Protocol):
    """What the controller needs of orchd's admin API (blocking)."""

    def submit(self, spec: JobSpec, job_id: str) -> None:
        """Raises SweepClosed when orchd refuses it for its sweep's budget or deadline, TrialRefused when
        orchd refuses the spec itself."""
        ...

    def job(self, job_id: str) -> dict[str, Any] | None:
        """``{"summary": {...}, "nodes": [...]}``; None when orchd has no such job."""
        ...

    def cancel(self, job_id: str, reason: str) -> None: ...


@dataclass
class PassResult:
    """What one pass did to one sweep (for logs and tests)."""

    sweep_id: str
    submitted: list[str] = field(default_factory=list)  # job ids submitted (new or again)
    asked: list[int] = field(default_factory=list)  # new trial numbers
    reported: list[tuple[int, int, float]] = field(default_factory=list)  # (trial, step, value)
    pruned: list[int] = field(default_factory=list)
    told: list[tuple[int, str]] = field(default_factory=list)  # (trial, state)
    cancelled: list[str] = field(default_factory=list)  # job ids
    state: str = "running"
    error: str = ""
    closed: str = ""  # orchd closed the sweep (ORCHD_STOPS)
    foreign: list[str] = field(default_factory=list)  # trial job ids held by jobs not of this sweep: left alone


def orchd_stop(trials: Any) -> str | None:
    """The reason orchd stopped the sweep (a trial that FAILed with one of ORCHD_STOPS), or None."""
    for t in trials:
        reason = t.user_attrs.get(store.FAIL_REASON)
        if not store.is_running(t) and reason in ORCHD_STOPS:
            return str(reason)
    return None


def rank0_progress(job: Mapping[str, Any]) -> tuple[int, float] | None:
    """(step, loss) of the current generation's lowest rank that reported a loss, from jobs.show."""
    gen = job["summary"].get("generation")
    best: tuple[int, int, float] | None = None
    for n in job.get("nodes", ()):
        loss, rank = n.get("loss"), n.get("rank")
        if n.get("generation") != gen or loss is None or rank is None or not math.isfinite(loss):
            continue
        if best is None or rank < best[0]:
            best = (int(rank), int(n.get("step") or 0), float(loss))
    return None if best is None else (best[1], best[2])


class Controller:
    """One pass over a sweep at a time; keeps nothing between passes that the storage does not hold
    (``_cancel_sent`` only spares repeated cancel requests within one process)."""

    def __init__(self, sweeps: store.SweepStore, orchd: OrchdApi,
                 may_act: Callable[[], bool] = lambda: True) -> None:
        self.sweeps = sweeps
        self.orchd = orchd
        self.may_act = may_act  # the lease (lease.py): checked before each sweep of a pass
        self._cancel_sent: set[str] = set()

    def run_pass(self, now: float) -> list[PassResult]:
        """One pass over every active sweep; a sweep that fails is reported in its result and the others
        go on (orchd unreachable ends the pass: OrchdUnavailable)."""
        out: list[PassResult] = []
        for sid in self.sweeps.active_ids():
            if not self.may_act():
                break  # the lease lapsed mid-pass: another controller may act now
            try:
                out.append(self.reconcile(sid, now))
            except OrchdUnavailable:
                raise
            except Exception as e:  # one broken sweep must not stop the others; the caller logs it
                out.append(PassResult(sid, state="error", error=f"{type(e).__name__}: {e}"))
        return out

    def _cancel(self, job_id: str, reason: str, res: PassResult) -> None:
        if job_id in self._cancel_sent:
            return
        self.orchd.cancel(job_id, reason)
        self._cancel_sent.add(job_id)
        res.cancelled.append(job_id)

    def reconcile(self, sweep_id: str, now: float) -> PassResult:
        sw = self.sweeps.open(sweep_id)
        spec, study = sw.spec, sw.study
        res = PassResult(sweep_id)
        stop = sw.stop_reason(now) or orchd_stop(study.get_trials(deepcopy=False))
        for t in study.get_trials(deepcopy=False):
            if store.is_running(t):
                self._trial(sw, t, stop, res)
        trials = study.get_trials(deepcopy=False)
        running = sum(1 for t in trials if store.is_running(t))
        blocked = ""
        stop = stop or res.closed or orchd_stop(trials)
        while stop is None and len(trials) < spec.trials and running < spec.parallelism:
            if not sw.budget_allows_one_more(trials):
                blocked = "budget"
                break
            t = sw.ask()
            res.asked.append(t.number)
            self._trial(sw, t, None, res)
            trials = study.get_trials(deepcopy=False)
            running = sum(1 for t in trials if store.is_running(t))
            stop = res.closed or None
        if running == 0:
            finished = sum(1 for t in trials if not store.is_running(t))
            if stop is not None or blocked or finished >= spec.trials:
                sw.finish(stop or blocked or ended_reason(trials))
                res.state = "finished"
        return res

    def _trial(self, sw: store.Sweep, t: Any, stop: str | None, res: PassResult) -> None:
        spec: SweepSpec = sw.spec
        job_id = store.job_id_of(sw.sweep_id, t)
        ua = t.user_attrs
        job = self.orchd.job(job_id)
        if job is not None and not store.is_trial_of(sw.sweep_id, job.get("summary")):
            res.foreign.append(job_id)  # someone else's job: never adopted, reported or cancelled
            job_id = f"{trial_job_id(sw.sweep_id, t.number)}-{secrets.token_hex(3)}"
            sw.set(t, store.JOB_ID, job_id)
            job = None
        if job is None:
            if store.PRUNE_STEP in ua:  # pruned; the job is gone (or never reached orchd)
                sw.tell(t, "pruned", res)
            elif stop is not None:
                sw.set(t, store.STOP, stop)
                sw.tell(t, "fail", res, reason=stop)
            else:
                try:
                    self.orchd.submit(trial_jobspec(spec, sw.sweep_id, job_id, t.params, sw.share(),
                                                    sw.deadline_ts), job_id)
                except SweepClosed as e:  # orchd holds the sweep to its budget and deadline
                    sw.set(t, store.STOP, e.reason)
                    sw.tell(t, "fail", res, reason=e.reason)
                    res.closed = e.reason
                    return
                except TrialRefused as e:  # not retried: the same spec is refused again
                    sw.tell(t, "fail", res, reason=f"refused: {e}"[:500])
                    return
                res.submitted.append(job_id)
            return
        s = job["summary"]
        sw.observe(t, s)
        phase = s.get("phase")
        if phase not in TERMINAL:
            if store.PRUNE_STEP in ua:
                self._cancel(job_id, "pruned", res)
            elif stop is not None or store.STOP in ua:
                if store.STOP not in ua:
                    sw.set(t, store.STOP, stop)
                self._cancel(job_id, str(ua.get(store.STOP, stop)), res)
            else:
                self._report(sw, t, job, res)
            return
        if phase == "succeeded":
            value = s.get("final_loss")
            if value is None and t.intermediate_values:
                value = t.intermediate_values[max(t.intermediate_values)]
            if value is None:
                sw.tell(t, "fail", res, reason="no_loss_reported")
            else:
                sw.tell(t, "complete", res, value=float(value))
        elif phase == "cancelled" and store.PRUNE_STEP in ua:
            sw.tell(t, "pruned", res)
        elif phase == "stopped" and s.get("reason") in ORCHD_STOPS:  # orchd stopped the sweep
            sw.tell(t, "fail", res, reason=str(s["reason"]))
            res.closed = str(s["reason"])
        else:
            sw.tell(t, "fail", res, reason=str(ua.get(store.STOP) or f"{phase}:{s.get('reason', '')}"))

    def _report(self, sw: store.Sweep, t: Any, job: Mapping[str, Any], res: PassResult) -> None:
        prog = rank0_progress(job)
        if prog is None:
            return
        step, loss = prog
        every = sw.spec.report_every_steps
        rung = (step // every) * every
        if rung < every or rung >= sw.spec.template.total_steps or rung in t.intermediate_values:
            return  # nothing new (the final step's value is the job's final loss)
        if t.intermediate_values and rung < max(t.intermediate_values):
            return  # a step re-run after a lost node: already reported further on
        fresh = sw.report(t, rung, loss)
        res.reported.append((t.number, rung, loss))
        if sw.should_prune(fresh):
            sw.set(t, store.PRUNE_STEP, rung)  # recorded first: a crash before the cancel still ends PRUNED
            res.pruned.append(t.number)
            self._cancel(store.job_id_of(sw.sweep_id, t), "pruned", res)


def ended_reason(trials: list[Any]) -> str:
    """Why a sweep whose trials all ended finished: ``completed`` when at least one trial completed;
    ``all_trials_refused`` when orchd refused every trial's job at submit (their reasons say why);
    ``no_trial_completed`` when every trial was pruned or failed otherwise."""
    if any(t.state.name == "COMPLETE" for t in trials):
        return "completed"
    if trials and all(str(t.user_attrs.get(store.FAIL_REASON, "")).startswith("refused:") for t in trials):
        return "all_trials_refused"
    return "no_trial_completed"
