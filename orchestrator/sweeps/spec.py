"""Sweep files (TOML) -> ``SweepSpec``, with every problem reported at once; a trial's ``JobSpec``.

Role: the edge between a user's sweep file and the typed spec the controller runs. Pure apart from
reading the file; no clock (a relative deadline is resolved by the caller with its ``now``); no Optuna.

File layout (config/sweeps/*.toml, docs/sweeps.md)::

    name, trials, parallelism, budget_usd, trial_budget_usd, deadline (TOML date-time / ISO-8601) or
    deadline_ts (unix seconds) or deadline_in_s (seconds from submission) or deadline_in ("72h", "3d")
    [objective]  direction (minimize | maximize), report_every_steps   - the trainer's reported loss
    [sampler]    kind (tpe | random), seed
    [pruner]     kind (none | median | successive_halving), startup_trials, warmup_steps,
                 min_resource, reduction_factor
    [space.NAME] type (float | int | categorical), low, high, log, step, choices
    [job]        the trial template: a job spec (orchestrator.jobspec layout); each trial's parameters
                 go into [job.trainer] args, its checkpoint root is <job.checkpoint.url>/<trial job id>
"""

from __future__ import annotations

import datetime as dt
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from orchestrator.jobspec import build_jobspec, parse_duration, spec_problems
from orchestrator.specchecks import SWEEP_ID_RE
from wire import JobSpec
from wire.config import SettingsError

__all__ = ["Param", "SweepSpec", "SweepSpecError", "load_sweepspec", "parse_sweepspec", "trial_job_id",
           "trial_jobspec"]

PARAM_TYPES: Final = ("float", "int", "categorical")
SAMPLERS: Final = ("tpe", "random")
PRUNERS: Final = ("none", "median", "successive_halving")
DIRECTIONS: Final = ("minimize", "maximize")
MAX_TRIALS: Final = 10_000
_TOP_KEYS: Final = frozenset({"name", "trials", "parallelism", "budget_usd", "trial_budget_usd", "deadline",
                              "deadline_ts", "deadline_in_s", "deadline_in", "objective", "sampler", "pruner",
                              "space", "job"})


class SweepSpecError(SettingsError):
    """A sweep file (or sweep id, or storage) with problems; the message lists every one."""

    def __init__(self, problems: list[str] | str, source: str = "sweep file") -> None:
        super().__init__([problems] if isinstance(problems, str) else problems, source)


@dataclass(frozen=True, slots=True, kw_only=True)
class Param:
    name: str
    type: str  # float | int | categorical
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: tuple[str | int | float | bool, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepSpec:
    name: str
    trials: int
    parallelism: int = 1
    budget_usd: float | None = None  # the whole sweep's cap: orchd stops all its trials at it (core/sweeps.py)
    trial_budget_usd: float | None = None  # each trial's own cap (its job's budget); default none
    deadline_ts: float | None = None  # no trial starts after it; orchd stops running ones at it
    deadline_in_s: float | None = None  # resolved into deadline_ts at submission
    direction: str = "minimize"
    report_every_steps: int = 10
    sampler: str = "tpe"
    seed: int | None = None
    pruner: str = "median"
    startup_trials: int = 2  # median: trials completed before any pruning
    warmup_steps: int = 0  # median: steps before a trial may be pruned
    min_resource: int | None = None  # successive halving: the first rung (default report_every_steps)
    reduction_factor: int = 3  # successive halving
    space: tuple[Param, ...] = ()
    template: JobSpec

    def share_usd(self) -> float | None:
        """Each trial's own cap, its job's ``budget_usd`` (docs/sweeps.md, "Budget and deadline"): the lower
        of ``trial_budget_usd`` and the sweep's budget; None without ``trial_budget_usd`` - orchd holds the
        trials together to the sweep's budget (core/sweeps.py), so none needs a share of it."""
        if self.trial_budget_usd is None:
            return None
        return self.trial_budget_usd if self.budget_usd is None else min(self.trial_budget_usd, self.budget_usd)


def load_sweepspec(path: str | os.PathLike[str]) -> tuple[SweepSpec, str]:
    """The spec and the file's text (kept with the sweep, so the controller re-reads exactly it)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise SweepSpecError(f"cannot read it: {e.strerror or e}", os.fspath(path)) from None
    return parse_sweepspec(text, source=os.fspath(path)), text


def parse_sweepspec(text: str, source: str = "sweep file") -> SweepSpec:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SweepSpecError(f"not valid TOML: {e}", source) from None
    spec, problems = build_sweepspec(raw)
    if problems or spec is None:
        raise SweepSpecError(problems, source)
    return spec


def _num(raw: Mapping[str, Any], key: str, p: list[str], *, kind: type = float, lo: float | None = None,
         hi: float | None = None, path: str = "") -> Any:
    v = raw.get(key)
    name = path + key
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or (kind is int and not isinstance(v, int)):
        p.append(f"{name}: must be {'an integer' if kind is int else 'a number'}, got {v!r}")
        return None
    if not math.isfinite(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        p.append(f"{name}: must be within {lo if lo is not None else '-inf'} .. {hi if hi is not None else 'inf'}"
                 f", got {v!r}")
        return None
    return kind(v)


def _choice(raw: Mapping[str, Any], key: str, options: tuple[str, ...], default: str, p: list[str], path: str) -> str:
    v = raw.get(key, default)
    if v not in options:
        p.append(f"{path}{key}: {v!r} is not one of {', '.join(options)}")
        return default
    return str(v)


def _table(raw: Mapping[str, Any], key: str, p: list[str]) -> Mapping[str, Any]:
    v = raw.get(key, {})
    if not isinstance(v, dict):
        p.append(f"{key}: must be a table")
        return {}
    return v


def _unknown(table: Mapping[str, Any], allowed: set[str] | frozenset[str], path: str, p: list[str]) -> None:
    p.extend(f"{path}{k}: unknown key" for k in sorted(set(table) - set(allowed)))


def _param(name: str, raw: Any, p: list[str]) -> Param | None:
    path = f"space.{name}."
    if not isinstance(raw, dict):
        p.append(f"space.{name}: must be a table (type = float | int | categorical, ...)")
        return None
    if not name.replace("_", "").replace("-", "").isalnum() or len(name) > 64:
        p.append(f"space.{name}: a parameter name is letters, digits, '_' and '-' (1 .. 64)")
    t = _choice(raw, "type", PARAM_TYPES, "float", p, path)
    if t == "categorical":
        _unknown(raw, {"type", "choices"}, path, p)
        choices = raw.get("choices")
        if not isinstance(choices, list) or not choices or len(set(map(repr, choices))) != len(choices) or not all(
                isinstance(c, str | int | float | bool) for c in choices):
            p.append(f"{path}choices: must be a non-empty list of distinct strings, numbers or booleans")
            return None
        return Param(name=name, type=t, choices=tuple(choices))
    _unknown(raw, {"type", "low", "high", "log", "step"}, path, p)
    kind = int if t == "int" else float
    low = _num(raw, "low", p, kind=kind, path=path)
    high = _num(raw, "high", p, kind=kind, path=path)
    step = _num(raw, "step", p, kind=kind, lo=0, path=path)
    log = raw.get("log", False)
    if not isinstance(log, bool):
        p.append(f"{path}log: must be true or false")
        log = False
    if low is None or high is None:
        p.append(f"{path}low, high: both required for a {t} parameter")
        return None
    if low > high:
        p.append(f"{path}low: must be <= high, got {low} > {high}")
    if log and low <= 0:
        p.append(f"{path}low: must be > 0 with log = true, got {low}")
    if log and step is not None:
        p.append(f"{path}step: not allowed with log = true")
    if step is not None and step <= 0:
        p.append(f"{path}step: must be > 0")
    return Param(name=name, type=t, low=low, high=high, log=log, step=step)


def _deadline(raw: Mapping[str, Any], p: list[str]) -> tuple[float | None, float | None]:
    given = [k for k in ("deadline", "deadline_ts", "deadline_in_s", "deadline_in") if k in raw]
    if len(given) > 1:
        p.append(f"deadline: give one of deadline, deadline_ts, deadline_in_s, deadline_in, got {', '.join(given)}")
        return None, None
    if "deadline_in" in raw:  # "72h", "3d": resolved once, when the sweep is submitted
        try:
            return None, parse_duration(raw["deadline_in"])
        except ValueError as e:
            p.append(f"deadline_in: {e}")
            return None, None
    if "deadline" in raw:
        v = raw["deadline"]
        try:
            when = v if isinstance(v, dt.datetime) else dt.datetime.fromisoformat(str(v))
        except ValueError:
            p.append(f"deadline: not a date-time, got {v!r}")
            return None, None
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.UTC)
        return when.timestamp(), None
    return _num(raw, "deadline_ts", p, lo=1e9, hi=1e11), _num(raw, "deadline_in_s", p, lo=1.0, hi=366 * 86400.0)


def build_sweepspec(raw: Mapping[str, Any]) -> tuple[SweepSpec | None, list[str]]:
    """The spec, or None with every problem found (layout, values, the job template)."""
    p: list[str] = []
    _unknown(raw, _TOP_KEYS, "", p)
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip() or len(name) > 200:
        p.append("name: required, a non-empty string (at most 200 characters)")
        name = "sweep"
    trials = _num(raw, "trials", p, kind=int, lo=1, hi=MAX_TRIALS)
    if trials is None and "trials" not in raw:
        p.append("trials: required, the number of trials (1 .. 10000)")
    parallelism = _num(raw, "parallelism", p, kind=int, lo=1, hi=1000) or 1
    budget = _num(raw, "budget_usd", p, lo=1e-6, hi=1e9)
    share = _num(raw, "trial_budget_usd", p, lo=1e-6, hi=1e9)
    deadline_ts, deadline_in_s = _deadline(raw, p)

    obj = _table(raw, "objective", p)
    _unknown(obj, {"direction", "report_every_steps"}, "objective.", p)
    direction = _choice(obj, "direction", DIRECTIONS, "minimize", p, "objective.")
    every = _num(obj, "report_every_steps", p, kind=int, lo=1, hi=2**40, path="objective.") or 10

    smp = _table(raw, "sampler", p)
    _unknown(smp, {"kind", "seed"}, "sampler.", p)
    sampler = _choice(smp, "kind", SAMPLERS, "tpe", p, "sampler.")
    seed = _num(smp, "seed", p, kind=int, lo=0, hi=2**31 - 1, path="sampler.")

    pr = _table(raw, "pruner", p)
    _unknown(pr, {"kind", "startup_trials", "warmup_steps", "min_resource", "reduction_factor"}, "pruner.", p)
    pruner = _choice(pr, "kind", PRUNERS, "median", p, "pruner.")
    startup = _num(pr, "startup_trials", p, kind=int, lo=0, hi=MAX_TRIALS, path="pruner.")
    warmup = _num(pr, "warmup_steps", p, kind=int, lo=0, hi=2**40, path="pruner.")
    min_resource = _num(pr, "min_resource", p, kind=int, lo=1, hi=2**40, path="pruner.")
    rf = _num(pr, "reduction_factor", p, kind=int, lo=2, hi=100, path="pruner.")

    space_raw = _table(raw, "space", p)
    space = tuple(x for x in (_param(k, v, p) for k, v in space_raw.items()) if x is not None)
    if not space_raw:
        p.append("space: at least one parameter ([space.NAME] with type, low/high or choices)")

    job_raw = raw.get("job")
    template: JobSpec | None = None
    if not isinstance(job_raw, dict):
        p.append("job: required, the trial template (a job spec table: name, total_steps, gpu_type, "
                 "[job.checkpoint] url, ...)")
    else:
        template, job_problems = build_jobspec(job_raw)
        p.extend(f"job.{q}" for q in job_problems)
        if template is not None:
            for prm in space:
                if not template.trainer.command and prm.name in template.trainer.args:
                    p.append(f"space.{prm.name}: also set in job.trainer.args (a searched parameter comes from "
                             "the space only)")
            if template.total_steps < every:
                p.append(f"objective.report_every_steps: must be <= job.total_steps ({template.total_steps}), "
                         f"got {every}")
    if p or template is None or trials is None:
        return None, p
    spec = SweepSpec(name=name, trials=trials, parallelism=parallelism, budget_usd=budget, trial_budget_usd=share,
                     deadline_ts=deadline_ts, deadline_in_s=deadline_in_s, direction=direction,
                     report_every_steps=every, sampler=sampler, seed=seed, pruner=pruner,
                     startup_trials=2 if startup is None else startup, warmup_steps=warmup or 0,
                     min_resource=min_resource, reduction_factor=rf or 3, space=space, template=template)
    # The template with the parameters at one corner of the space: the trainer's own checks run on it
    probe = {prm.name: (prm.choices[0] if prm.type == "categorical" else prm.low) for prm in space}
    p.extend(f"job (with the space's first values): {q}"
             for q in spec_problems(trial_jobspec(spec, "probe", "probe-t0000", probe, None)))
    return (None, p) if p else (spec, [])


def trial_job_id(sweep_id: str, number: int) -> str:
    """The job id of trial ``number``: the same on every try, so a resubmit is idempotent."""
    return f"{sweep_id}-t{number:04d}"


def trial_jobspec(spec: SweepSpec, sweep_id: str, job_id: str, params: Mapping[str, Any],
                  budget_usd: float | None, deadline_ts: float | None = None) -> JobSpec:
    """The trial's job: the template, its parameters in trainer.args, its own checkpoint root under the
    template's, the sweep id, its own budget (the lower of the template's and the share), and the
    sweep's total budget and absolute deadline, which orchd enforces over all the sweep's jobs."""
    t = spec.template
    args = {**t.trainer.args, **{k: v for k, v in params.items()}}
    caps = [b for b in (t.budget_usd, budget_usd) if b is not None]
    root = t.checkpoint.url.rstrip("/") + "/" + job_id
    return msgspec.structs.replace(
        t, name=f"{t.name}-{job_id}"[:200], trainer=msgspec.structs.replace(t.trainer, args=args),
        checkpoint=msgspec.structs.replace(t.checkpoint, url=root), budget_usd=min(caps) if caps else None,
        sweep_id=sweep_id, sweep_budget_usd=msgspec.UNSET if spec.budget_usd is None else spec.budget_usd,
        sweep_deadline_ts=msgspec.UNSET if deadline_ts is None else deadline_ts)


def check_sweep_id(sweep_id: str) -> str:
    if SWEEP_ID_RE.fullmatch(sweep_id) is None:
        raise SweepSpecError(f"sweep id: must match {SWEEP_ID_RE.pattern}, got {sweep_id[:60]!r}", "sweep id")
    return sweep_id
