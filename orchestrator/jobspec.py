"""Job spec files (TOML or YAML) -> ``wire.JobSpec``, with every problem reported at once.

Role: the edge between a user's file and the typed ``JobSpec`` the core receives. The file layout is
described by the frozen dataclasses below (``JobFile`` and its tables) and converted by the one
configuration loader, ``wire.config.load_dataclass``: unknown keys, missing required keys, wrong types,
choices not offered and numbers out of bounds are all collected with their key paths. Once the layout is
valid, the cross-field rules run (the file's own, then ``spec_problems`` on the built ``JobSpec``) and
every one of them is collected too. ``JobSpecError`` lists them all.

``spec_problems`` (orchestrator.specchecks) is the one validator of a ``JobSpec`` however it was made:
orchctl runs it on a file before sending it, and orchd runs it again on specs that arrive over the wire
(``jobs submit``), each listing every problem at once. It runs every check of ``SPEC_CHECKS`` (the
fields' rules, the built-in trainer's arguments against ``trainer.contract.TRAINER_ARGS``); a new rule
joins that tuple. Defaults come from the wire structs themselves.

File layout (see config/jobs/*.toml|yaml)::

    name, total_steps, gpu_type, gpus_per_node, nodes, nodes_min, nodes_max, step_time_s_estimate,
    clouds, regions, zones, instance_types, market (spot | on_demand | spot_with_fallback),
    deadline (TOML/YAML date-time or ISO-8601 string; no zone = UTC) or deadline_ts (unix seconds) or
    deadline_in ("72h", "3d": from the submission, resolved by the caller's ``now``), budget_usd
    [trainer]    command = [...], args = {...} (without a command: the built-in trainer's, checked against
                 trainer.contract.TRAINER_ARGS; with one: passed unchecked), env = {...}, integration = "hf" (the
                 command is a Hugging Face Trainer script or Accelerate loop); ``config`` is refused: the built-in
                 trainer reads none
    [checkpoint] url (file:// s3:// gs:// az:// abfs://; one job, one root: orchd refuses a url equal to,
                 inside or containing another job's), interval_s, keep, save_s_estimate, replica_every,
                 start_from (a committed checkpoint, e.g. another job's, to resume from; written under url)
    [price]      pause_above_ratio, resume_below_ratio, migrate_min_saving
    [tracking]   uri (http:// or https://, no credentials in it), experiment, run_name (docs/tracking.md)

Pure apart from reading the file; no clock (the caller passes ``now`` for ``deadline_in``).
"""

from __future__ import annotations

import datetime as dt
import os
import re
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from orchestrator.specchecks import SPEC_CHECKS, Cloud, spec_problems
from trainer.contract import ENV_INTEGRATION
from wire import CheckpointPolicy, JobSpec, MarketPolicy, PricePolicy, TrackingSpec, TrainerSpec
from wire.config import SettingsError, load_dataclass, merge, problem_path, without_problems

__all__ = ["SPEC_CHECKS", "JobSpecError", "JobFile", "build_jobspec", "load_jobspec", "parse_jobspec",
           "spec_problems"]



class JobSpecError(SettingsError):
    """Every problem of one job spec, each ``key.path: what is wrong``."""

    def __init__(self, problems: list[str], source: str = "job spec") -> None:
        super().__init__(problems, source)


def _wire_default(struct: type[msgspec.Struct], name: str) -> Any:
    """The default of ``struct.name``: the file's defaults are the wire's, never a second copy."""
    (info,) = (f for f in msgspec.structs.fields(struct) if f.name == name)
    return info.default


def _job_default(name: str, **bounds: float) -> Any:
    return field(default=_wire_default(JobSpec, name), metadata=bounds)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerTable:
    """``[trainer]``: ``command`` (your own program) or none (the built-in trainer, ``python -m trainer``)."""

    command: tuple[str, ...] | None = None
    config: str | None = None
    """Refused (``check``): the built-in trainer reads no config file. Kept in the layout so that a spec
    written for it gets that reason rather than "unknown key"."""
    args: Mapping[str, str | int | float | bool] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    integration: Literal["hf"] | None = None  # a Hugging Face Trainer script or Accelerate loop (trainer.hf)


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointTable:
    """``[checkpoint]`` -> ``wire.CheckpointPolicy``."""

    url: str
    interval_s: float | None = field(default=_wire_default(CheckpointPolicy, "interval_s"), metadata={"gt": 0})
    """Omitted: orchd derives it from the pool's preemption rate (Young/Daly)."""
    keep: int = field(default=_wire_default(CheckpointPolicy, "keep"), metadata={"ge": 1})
    save_s_estimate: float = _wire_default(CheckpointPolicy, "save_s_estimate")
    start_from: str | None = None
    """A committed checkpoint (``.../step_000000200`` of another job) this job resumes from before its own
    first commit. Omitted: start fresh. The job still writes only under ``url``."""
    replica_every: int = field(default=0, metadata={"ge": 0, "le": 1_000_000})  # replicas every N steps; 0: none


@dataclass(frozen=True, slots=True, kw_only=True)
class PriceTable:
    """``[price]`` -> ``wire.PricePolicy``."""

    pause_above_ratio: float = _wire_default(PricePolicy, "pause_above_ratio")
    resume_below_ratio: float = _wire_default(PricePolicy, "resume_below_ratio")
    migrate_min_saving: float = _wire_default(PricePolicy, "migrate_min_saving")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrackingTable:
    """``[tracking]`` -> ``wire.TrackingSpec``: the job's MLflow run (docs/tracking.md)."""

    experiment: str
    server: str = ""
    """A tracking server of orchd's config (``[tracking.servers]``); "" = its default."""
    uri: str = ""
    """Accepted only when it is the URI of one of orchd's tracking servers; name the server instead."""
    run_name: str = ""
    """"" = the job's name."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JobFile:
    """A job spec file's top level. The one-field bounds here are ``spec_problems``' too, so a file reports
    them with its type errors; the cross-field rules need a valid layout first."""

    name: str
    total_steps: int = field(metadata={"gt": 0})
    gpu_type: str
    gpus_per_node: int = _job_default("gpus_per_node", ge=1)
    nodes: int = _job_default("nodes")
    nodes_min: int | None = field(default=None, metadata={"ge": 1})
    """Default: ``min(nodes, nodes_max)``."""
    nodes_max: int | None = None
    """Default: ``max(nodes, nodes_min)``."""
    step_time_s_estimate: float = _job_default("step_time_s_estimate", gt=0)
    clouds: tuple[Cloud, ...] = ()
    """Empty: any cloud."""
    regions: tuple[str, ...] = ()
    zones: tuple[str, ...] = ()
    instance_types: tuple[str, ...] = ()
    market: MarketPolicy = _wire_default(JobSpec, "market")
    deadline: dt.datetime | None = None
    deadline_ts: float | None = None
    deadline_in: str | None = None
    """A deadline relative to the submission (``"72h"``, ``"3d"``, ``"1d12h"``, ``"90m"``): orchctl resolves it
    once, at submit, into ``deadline_ts``; the file then never expires."""
    budget_usd: float | None = field(default=None, metadata={"gt": 0})
    trainer: TrainerTable = TrainerTable()
    checkpoint: CheckpointTable
    price: PriceTable = PriceTable()
    tracking: TrackingTable | None = None
    best_effort: bool = False
    """Accept a deadline that even on-demand cannot meet (it is then missed); false: refused at submit."""

    def check(self) -> list[str]:
        """The file's own cross-field rules (the JobSpec's are ``spec_problems``)."""
        out = []
        if self.trainer.integration is not None and self.trainer.command is None:
            out.append("trainer.integration: needs trainer.command (your script); the built-in trainer needs none")
        if self.trainer.command is not None and self.trainer.config is not None:
            out.append("trainer: give either command or config, not both")
        elif self.trainer.config is not None:
            out.append("trainer.config: the built-in trainer reads no config file; give its arguments in "
                       "trainer.args (trainer.contract.TRAINER_ARGS, docs/trainer-contract.md)")
        given = [k for k in ("deadline", "deadline_ts", "deadline_in") if getattr(self, k) is not None]
        if len(given) > 1:
            out.append(f"deadline: give one of deadline, deadline_ts, deadline_in, got {', '.join(given)}")
        return out

    def deadline_problem(self, now: float | None) -> str | None:
        """What is wrong with ``deadline_in`` (None: nothing, or not given)."""
        if self.deadline_in is None:
            return None
        try:
            parse_duration(self.deadline_in)
        except ValueError as e:
            return f"deadline_in: {e}"
        if now is None:
            return ("deadline_in: a relative deadline is resolved at submission (orchctl jobs submit); "
                    "give deadline or deadline_ts here")
        return None

    def to_spec(self, now: float | None = None) -> JobSpec:
        nodes_min = self.nodes_min
        if nodes_min is None:
            nodes_min = min(self.nodes, self.nodes if self.nodes_max is None else self.nodes_max)
        nodes_max = self.nodes_max if self.nodes_max is not None else max(self.nodes, nodes_min)
        t, c, p = self.trainer, self.checkpoint, self.price
        args = {**t.args, **({"config": t.config} if t.config is not None else {})}
        env = {**t.env, **({ENV_INTEGRATION: t.integration} if t.integration else {})}
        return JobSpec(
            name=self.name, total_steps=self.total_steps, gpu_type=self.gpu_type, gpus_per_node=self.gpus_per_node,
            nodes=self.nodes, nodes_min=nodes_min, nodes_max=nodes_max,
            step_time_s_estimate=self.step_time_s_estimate, clouds=self.clouds, regions=self.regions,
            zones=self.zones, instance_types=self.instance_types, market=self.market,
            deadline_ts=self._deadline_ts(now), budget_usd=self.budget_usd,
            trainer=TrainerSpec(command=t.command or (), args=args, env=env),
            checkpoint=CheckpointPolicy(url=c.url, interval_s=c.interval_s, keep=c.keep,
                                        save_s_estimate=c.save_s_estimate,
                                        start_from=msgspec.UNSET if c.start_from is None else c.start_from,
                                        replica_every=c.replica_every or msgspec.UNSET),
            price=PricePolicy(pause_above_ratio=p.pause_above_ratio, resume_below_ratio=p.resume_below_ratio,
                              migrate_min_saving=p.migrate_min_saving),
            tracking=(msgspec.UNSET if self.tracking is None else
                      TrackingSpec(uri=self.tracking.uri, experiment=self.tracking.experiment,
                                   run_name=self.tracking.run_name,
                                   server=self.tracking.server or msgspec.UNSET)),
            best_effort=True if self.best_effort else msgspec.UNSET,
        )

    def _deadline_ts(self, now: float | None) -> float | None:
        if self.deadline is not None:
            return _timestamp(self.deadline)
        if self.deadline_in is not None and now is not None and self.deadline_problem(now) is None:
            return now + parse_duration(self.deadline_in)
        return self.deadline_ts


_DURATION = re.compile(r"(\d+(?:\.\d+)?)([dhms])")
_UNIT_S = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
MAX_DEADLINE_IN_S: typing.Final = 366 * 86400.0


def parse_duration(text: object) -> float:
    """Seconds in a duration such as ``"72h"``, ``"3d"``, ``"1d12h"``, ``"90m"``, ``"45s"`` (1 s .. 366 days)."""
    if not isinstance(text, str):
        raise ValueError(f"expected a duration such as \"72h\" or \"3d\", got {text!r}")
    t = text.strip().lower()
    parts = _DURATION.findall(t)
    if not t or "".join(n + u for n, u in parts) != t:
        raise ValueError(f"not a duration, got {text!r} (use d, h, m, s: \"72h\", \"3d\", \"1d12h\", \"90m\")")
    seconds = sum(float(n) * _UNIT_S[u] for n, u in parts)
    if not 1.0 <= seconds <= MAX_DEADLINE_IN_S:
        raise ValueError(f"{text!r} is out of range (1 s .. 366 days)")
    return seconds


def _timestamp(when: dt.datetime) -> float:
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)  # a deadline without a zone is UTC, never local time
    return when.timestamp()


def load_jobspec(path: str | os.PathLike[str], now: float | None = None) -> JobSpec:
    """The spec of a file; ``now`` (the submission time) resolves a relative ``deadline_in``."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise JobSpecError([f"cannot read {p}: {e.strerror}"], str(p)) from None
    return parse_jobspec(text, fmt="yaml" if p.suffix in (".yaml", ".yml") else "toml", source=str(p), now=now)


def parse_jobspec(text: str, fmt: str = "toml", source: str = "job spec", now: float | None = None) -> JobSpec:
    try:
        raw = tomllib.loads(text) if fmt == "toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise JobSpecError([f"not valid {fmt.upper()}: {e}"], source) from None
    if not isinstance(raw, dict):
        raise JobSpecError([f"expected a table at the top level, got {type(raw).__name__}"], source)
    spec, problems = build_jobspec(raw, now)
    if problems or spec is None:
        raise JobSpecError(problems, source)
    return spec


_PLACEHOLDERS: dict[str, Any] = {"name": "job", "total_steps": 1, "gpu_type": "gpu",
                                 "checkpoint": {"url": "file:///placeholder"}}
"""Valid stand-ins for required keys that are missing or bad, so the cross-field rules still run."""
_RULE_INPUTS = {"nodes": ("nodes", "nodes_min", "nodes_max"),
                "deadline": ("deadline", "deadline_ts", "deadline_in"),
                "trainer": ("trainer.command", "trainer.config"),
                "price": ("price.pause_above_ratio", "price.resume_below_ratio")}
"""The keys a cross-field rule reads, by the key its problem names (itself where not listed)."""


def build_jobspec(raw: Mapping[str, Any], now: float | None = None) -> tuple[JobSpec | None, list[str]]:
    """(spec, []) or (None, every problem): the layout's (every key of every table) and the cross-field
    rules'. Where the layout has problems, the rules run on its valid part (bad or missing keys replaced
    by defaults and placeholders) and only rules whose inputs were all valid are reported."""
    problems = _layout_problems(raw)
    job, more = load_dataclass(JobFile, raw)
    problems += more
    if job is None or problems:
        job, _ = load_dataclass(JobFile, merge(_PLACEHOLDERS, without_problems(raw, problems)))
    if job is None:  # the valid part still does not load (a key path the problems cannot name)
        return None, problems
    failed = [problem_path(p) for p in problems]
    spec = job.to_spec(now)
    relative = job.deadline_problem(now)
    # trainer.config is said in the file's own terms (job.check), not again as trainer.args.config
    rules = job.check() + ([relative] if relative else []) + [r for r in spec_problems(spec)
                           if not (job.trainer.config is not None and r.startswith("trainer.args.config:"))]
    problems += [r for r in rules if not _touches(problem_path(r), failed)]
    return (None if problems else spec), problems


def _layout_problems(raw: Mapping[str, Any]) -> list[str]:
    """What the loader would take but a job spec must not: a command line as one string (argv is a list)."""
    trainer = raw.get("trainer")
    if isinstance(trainer, Mapping) and isinstance(trainer.get("command"), str):
        return [f"trainer.command: expected a list of arguments, got {trainer['command']!r}"]
    return []


def _touches(rule: str, failed: list[str]) -> bool:
    """Whether a rule about ``rule`` reads a key that failed (then the rule ran on a stand-in)."""
    inputs = _RULE_INPUTS.get(rule, (rule,))
    if rule.startswith("trainer.args."):  # checked only when no command is given
        inputs = (rule, "trainer.command")
    return any(i == f or f.startswith(i + ".") or i.startswith(f + ".") or not f for i in inputs for f in failed)
