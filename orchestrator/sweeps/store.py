"""Sweeps in an Optuna storage: one Optuna study per sweep, named by the sweep id.

Role: the only module that touches Optuna. A sweep is a study whose user attributes hold the sweep
file's text (``orch.source``, re-parsed on every open, so the controller runs exactly what was
submitted), the absolute deadline, the submission time and the sweep's state (running, cancelled,
finished: reason). Each trial's user attributes hold what the controller learnt from orchd (``orch.*``:
its job's phase, step, cost, generation; the step it was pruned at; why it was stopped).

The storage is any URL Optuna's ``RDBStorage`` takes (PostgreSQL, MySQL: reachable from every host
that runs a controller; ``sqlite:///path``: one host only, docs/sweeps.md). Optuna is imported only here
and only when a storage is opened: ``SweepsUnavailable`` says how to install it.

Concurrency contract: synchronous and blocking; one controller per storage at a time.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from orchestrator.sweeps.spec import SweepSpec, SweepSpecError, check_sweep_id, parse_sweepspec, trial_job_id

if TYPE_CHECKING:
    import optuna

SOURCE: Final = "orch.source"
DEADLINE: Final = "orch.deadline_ts"
CREATED: Final = "orch.created_ts"
STATE: Final = "orch.state"  # running | cancelled | finished
REASON: Final = "orch.reason"
# trial user attributes
PRUNE_STEP: Final = "orch.prune_step"
STOP: Final = "orch.stop"
JOB_ID: Final = "orch.job_id"
"""The trial's job id when it is not ``trial_job_id(sweep, number)``: that id was taken by a job that is
not of this sweep (``job_id_of``), so the trial runs under a fresh one, recorded before its submit."""


def job_id_of(sweep_id: str, t: Any) -> str:
    """The job id of trial ``t``: its recorded one (``JOB_ID``) or ``trial_job_id(sweep_id, number)``."""
    jid = t.user_attrs.get(JOB_ID)
    return jid if isinstance(jid, str) and jid else trial_job_id(sweep_id, t.number)


def is_trial_of(sweep_id: str, summary: Mapping[str, Any] | None) -> bool:
    """Whether orchd's summary of a job says it is a job of sweep ``sweep_id`` (its ``sweep_id`` in the
    state, set at submit): a job merely named like a trial is not."""
    return summary is not None and summary.get("sweep_id") == sweep_id
SHARE: Final = "orch.budget_usd"
PHASE: Final = "orch.phase"
STEP: Final = "orch.step"
COST: Final = "orch.cost_usd"
GENERATION: Final = "orch.generation"
FAIL_REASON: Final = "orch.fail_reason"

INSTALL_HINT: Final = "sweeps need Optuna: pip install 'spot-orchestrator[sweeps]'"


class SweepsUnavailable(RuntimeError):
    """Optuna (the ``[sweeps]`` extra) is not installed."""


class SweepNotFound(KeyError):
    pass


def _optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise SweepsUnavailable(INSTALL_HINT) from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def _states() -> Any:
    return _optuna().trial.TrialState


def is_running(t: Any) -> bool:
    """A trial not yet told (Optuna's TrialState.RUNNING)."""
    return bool(t.state.name == "RUNNING")


class SweepStore:
    def __init__(self, url: str) -> None:
        optuna = _optuna()
        if not url:
            raise SweepSpecError("no storage URL: give --storage URL or set ORCH_SWEEP_STORAGE", "sweep storage")
        kwargs: dict[str, Any] = {}
        if url.startswith("sqlite"):
            kwargs = {"connect_args": {"timeout": 30}}  # orchctl and the controller share the file
            folder = Path(url.partition(":///")[2]).parent
            if url.partition(":///")[2] not in ("", ":memory:") and not folder.is_dir():
                raise SweepSpecError(f"the SQLite file's directory {folder} does not exist (create it first)",
                                     f"sweep storage {redact_url(url)}")
        try:
            self.storage = optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
        except Exception as e:  # a bad URL, a missing driver, an unreachable database
            raise SweepSpecError(f"{type(e).__name__}: {e}", f"sweep storage {redact_url(url)}") from None
        self.url = url

    # --- sweeps ----------------------------------------------------------------------------------

    def create(self, sweep_id: str, spec: SweepSpec, text: str, now: float) -> bool:
        """A new sweep; False (nothing changed) when ``sweep_id`` exists with the same file (idempotent),
        SweepSpecError when it exists with another."""
        optuna = _optuna()
        check_sweep_id(sweep_id)
        try:
            study = optuna.create_study(storage=self.storage, study_name=sweep_id, direction=spec.direction)
        except optuna.exceptions.DuplicatedStudyError:
            study = optuna.load_study(storage=self.storage, study_name=sweep_id)
            have = study.user_attrs.get(SOURCE)
            if have is not None:
                if have != text:
                    raise SweepSpecError("exists with another sweep file (submit it with another --id)",
                                         f"sweep {sweep_id}") from None
                return False
        # the attributes go in before the source: a study without orch.source is not (yet) a sweep
        deadline = spec.deadline_ts if spec.deadline_in_s is None else now + spec.deadline_in_s
        study.set_user_attr(DEADLINE, deadline)
        study.set_user_attr(CREATED, now)
        study.set_user_attr(STATE, "running")
        study.set_user_attr(SOURCE, text)
        return True

    def ids(self) -> list[str]:
        out = []
        for s in self.storage.get_all_studies():
            if SOURCE in s.user_attrs:
                out.append(s.study_name)
        return sorted(out)

    def active_ids(self) -> list[str]:
        return [s.study_name for s in self.storage.get_all_studies()
                if SOURCE in s.user_attrs and s.user_attrs.get(STATE) in ("running", "cancelled")
                and s.user_attrs.get(REASON) is None]

    def open(self, sweep_id: str) -> Sweep:
        optuna = _optuna()
        try:
            sid = self.storage.get_study_id_from_name(sweep_id)
        except KeyError:
            raise SweepNotFound(sweep_id) from None
        attrs = self.storage.get_study_user_attrs(sid)
        if SOURCE not in attrs:
            raise SweepNotFound(sweep_id)
        spec = parse_sweepspec(attrs[SOURCE], source=f"sweep {sweep_id}")
        n = len(self.storage.get_all_trials(sid, deepcopy=False))
        seed = None if spec.seed is None else spec.seed + n  # a restarted controller draws on, not again
        sampler = (optuna.samplers.RandomSampler(seed=seed) if spec.sampler == "random"
                   else optuna.samplers.TPESampler(seed=seed))
        if spec.pruner == "median":
            pruner: Any = optuna.pruners.MedianPruner(n_startup_trials=spec.startup_trials,
                                                      n_warmup_steps=spec.warmup_steps)
        elif spec.pruner == "successive_halving":
            pruner = optuna.pruners.SuccessiveHalvingPruner(
                min_resource=spec.min_resource or spec.report_every_steps, reduction_factor=spec.reduction_factor)
        else:
            pruner = optuna.pruners.NopPruner()
        study = optuna.load_study(storage=self.storage, study_name=sweep_id, sampler=sampler, pruner=pruner)
        return Sweep(sweep_id=sweep_id, spec=spec, study=study, attrs=dict(attrs))

    def cancel(self, sweep_id: str, reason: str = "cancelled") -> bool:
        """Mark the sweep cancelled (the controller cancels its running trials); False if it had ended."""
        sw = self.open(sweep_id)
        if sw.attrs.get(REASON) is not None or sw.attrs.get(STATE) == "cancelled":
            return False
        sw.study.set_user_attr(STATE, "cancelled")
        sw.study.set_user_attr("orch.cancel_reason", reason)
        return True


@dataclass
class Sweep:
    sweep_id: str
    spec: SweepSpec
    study: optuna.Study
    attrs: dict[str, Any]

    @property
    def deadline_ts(self) -> float | None:
        d = self.attrs.get(DEADLINE)
        return float(d) if d is not None else None

    def stop_reason(self, now: float) -> str | None:
        if self.attrs.get(STATE) == "cancelled":
            return "sweep_cancelled"
        d = self.deadline_ts
        if d is not None and now >= d:
            return "sweep_deadline"
        return None

    def share(self) -> float | None:
        return self.spec.share_usd()

    def budget_allows_one_more(self, trials: Sequence[Any]) -> bool:
        """What the trials cost so far (as last seen) is below the sweep's cap. orchd holds the sweep to the
        cap over all its jobs (core/sweeps.py: it stops them at it and refuses new ones), so nothing is
        reserved here; each trial's share only caps that trial."""
        cap = self.spec.budget_usd
        if cap is None:
            return True
        return sum(float(t.user_attrs.get(COST, 0.0)) for t in trials) < cap

    def ask(self) -> Any:
        """A new trial with every parameter of the space drawn by the sampler (stored before it is
        returned: a crash after this is a RUNNING trial without a job, submitted by the next pass)."""
        optuna = _optuna()
        d = optuna.distributions
        dists: dict[str, Any] = {}
        for p in self.spec.space:
            if p.type == "categorical":
                dists[p.name] = d.CategoricalDistribution(list(p.choices))
            elif p.type == "int":
                dists[p.name] = d.IntDistribution(int(p.low or 0), int(p.high or 0), log=p.log,
                                                  step=int(p.step or 1))
            else:
                dists[p.name] = d.FloatDistribution(float(p.low or 0.0), float(p.high or 0.0), log=p.log,
                                                    step=p.step)
        trial = self.study.ask(fixed_distributions=dists)
        share = self.share()
        if share is not None:
            trial.set_user_attr(SHARE, share)
        return self.study._storage.get_trial(trial._trial_id)

    def set(self, t: Any, key: str, value: Any) -> None:
        self.study._storage.set_trial_user_attr(t._trial_id, key, value)

    def observe(self, t: Any, summary: Mapping[str, Any]) -> None:
        """Keep what orchd says of the trial's job on the trial (``orchctl sweep show`` reads only the storage)."""
        ua = t.user_attrs
        for key, value in ((PHASE, summary.get("phase")), (STEP, summary.get("step")),
                           (COST, summary.get("cost_usd")), (GENERATION, summary.get("generation"))):
            if value is not None and ua.get(key) != value:
                self.set(t, key, value)

    def report(self, t: Any, step: int, value: float) -> Any:
        storage = self.study._storage
        storage.set_trial_intermediate_value(t._trial_id, step, value)
        return storage.get_trial(t._trial_id)

    def should_prune(self, frozen: Any) -> bool:
        return bool(self.study.pruner.prune(self.study, frozen))

    def tell(self, t: Any, how: str, res: Any, *, value: float | None = None, reason: str = "") -> None:
        states = _states()
        if how == "fail" and reason:
            self.set(t, FAIL_REASON, reason)
        if how == "complete":
            self.study.tell(t.number, value, skip_if_finished=True)
        else:
            self.study.tell(t.number, state=states.PRUNED if how == "pruned" else states.FAIL,
                            skip_if_finished=True)
        res.told.append((t.number, how))

    def finish(self, reason: str) -> None:
        self.study.set_user_attr(REASON, reason)
        self.study.set_user_attr(STATE, "cancelled" if reason == "sweep_cancelled" else "finished")

    # --- views -----------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        trials = self.study.get_trials(deepcopy=False)
        by_state: dict[str, int] = {}
        for t in trials:
            by_state[t.state.name.lower()] = by_state.get(t.state.name.lower(), 0) + 1
        best = best_trial(self.study)
        return {
            "sweep_id": self.sweep_id, "name": self.spec.name, "state": self.attrs.get(STATE),
            "reason": self.attrs.get(REASON), "trials": self.spec.trials, "parallelism": self.spec.parallelism,
            "started": len(trials), **{f"n_{k}": v for k, v in sorted(by_state.items())},
            "best_trial": best.number if best is not None else None,
            "best_value": best.value if best is not None else None,
            "cost_usd": round(sum(float(t.user_attrs.get(COST, 0.0)) for t in trials), 4),
            "budget_usd": self.spec.budget_usd, "deadline_ts": self.deadline_ts,
            "created_ts": self.attrs.get(CREATED),
        }

    def trial_rows(self) -> list[dict[str, Any]]:

        rows = []
        for t in self.study.get_trials(deepcopy=False):
            ua = t.user_attrs
            iv = t.intermediate_values
            rows.append({
                "trial": t.number, "job_id": job_id_of(self.sweep_id, t), "state": t.state.name.lower(),
                "value": t.value if t.value is not None and math.isfinite(t.value) else None,
                "params": dict(t.params), "job_phase": ua.get(PHASE), "step": ua.get(STEP),
                "last_report": (max(iv), iv[max(iv)]) if iv else None, "pruned_at": ua.get(PRUNE_STEP),
                "generations": ua.get(GENERATION), "cost_usd": ua.get(COST), "reason": ua.get(FAIL_REASON),
            })
        return rows


def redact_url(url: str) -> str:
    """A storage URL without its password."""
    return re.sub(r"//([^:/@]+):[^@/]*@", r"//\1:***@", url)


def best_trial(study: Any) -> Any:
    """The best COMPLETE trial so far, or None."""
    try:
        return study.best_trial
    except ValueError:  # no completed trial yet
        return None
