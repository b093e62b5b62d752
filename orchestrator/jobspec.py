"""Job spec files (TOML or YAML) -> ``wire.JobSpec``, with every problem reported at once.

Role: the edge between a user's file and the typed ``JobSpec`` the core receives. The file layout is
described by the frozen dataclasses below (``JobFile`` and its tables) and converted by the one
configuration loader, ``wire.config.load_dataclass``: unknown keys, missing required keys, wrong types,
choices not offered and numbers out of bounds are all collected with their key paths. Once the layout is
valid, the cross-field rules run (the file's own, then ``spec_problems`` on the built ``JobSpec``) and
every one of them is collected too. ``JobSpecError`` lists them all.

``spec_problems`` is the one validator of a ``JobSpec`` however it was made: orchctl runs it on a file
before sending it, and orchd runs it again on specs that arrive over the wire (``jobs submit``), each
listing every problem at once. It runs every check of ``SPEC_CHECKS`` (the fields' rules, the built-in
trainer's arguments against ``trainer.contract.TRAINER_ARGS``); a new rule joins that tuple. Defaults
come from the wire structs themselves.

File layout (see config/jobs/*.toml|yaml)::

    name, total_steps, gpu_type, gpus_per_node, nodes, nodes_min, nodes_max, step_time_s_estimate,
    clouds, regions, zones, instance_types, market (spot | on_demand | spot_with_fallback),
    deadline (TOML/YAML date-time or ISO-8601 string; no zone = UTC) or deadline_ts (unix seconds) or
    deadline_in ("72h", "3d": from the submission, resolved by the caller's ``now``), budget_usd
    [trainer]    command = [...], args = {...} (without a command: the built-in trainer's, checked against
                 trainer.contract.TRAINER_ARGS; with one: passed unchecked), env = {...}, integration = "hf" (the
                 command is a Hugging Face Trainer script); ``config`` is refused: the built-in trainer reads none
    [checkpoint] url (file:// s3:// gs:// az:// abfs://; one job, one root: orchd refuses a url equal to,
                 inside or containing another job's), interval_s, keep, save_s_estimate, replica_every,
                 start_from (a committed checkpoint, e.g. another job's, to resume from; written under url)
    [price]      pause_above_ratio, resume_below_ratio, migrate_min_saving
    [tracking]   uri (http:// or https://, no credentials in it), experiment, run_name (docs/tracking.md)

Pure apart from reading the file; no clock (the caller passes ``now`` for ``deadline_in``).
"""

from __future__ import annotations

import datetime as dt
import math
import os
import re
import tomllib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from orchestrator.core.roots import relation
from trainer.contract import ENV_INTEGRATION, trainer_args_problems
from wire import CheckpointPolicy, JobSpec, MarketPolicy, PricePolicy, TrackingSpec, TrainerSpec
from wire.config import SettingsError, load_dataclass, merge, problem_path, without_problems
from wire.names import BadName, check_key, check_token, is_token

__all__ = ["SPEC_CHECKS", "JobSpecError", "JobFile", "build_jobspec", "load_jobspec", "parse_jobspec",
           "spec_problems"]

Cloud = Literal["aws", "gcp", "azure", "local", "fake"]
KNOWN_CLOUDS: tuple[str, ...] = typing.get_args(Cloud)
CHECKPOINT_SCHEMES = ("file://", "s3://", "gs://", "az://", "abfs://")


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
    integration: Literal["hf"] | None = None  # the command is a Hugging Face Trainer script (trainer.hf.callback)


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
            checkpoint=CheckpointPolicy(url=c.url, interval_s=c.interval_s, keep=c.keep, save_s_estimate=c.save_s_estimate,
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


def _checkpoint_url_problems(key: str, url: str) -> list[str]:
    if not url.startswith(CHECKPOINT_SCHEMES):
        return [f"{key}: must start with one of {', '.join(CHECKPOINT_SCHEMES)}, got {url!r}"]
    if url.startswith("file://") and not url.startswith("file:///"):
        return [f"{key}: a file:// path must be absolute (file:///path), got {url!r}"]
    return []


SpecCheck = Callable[[JobSpec], list[str]]
"""One rule set of a JobSpec: every problem it finds, each ``key.path: what is wrong``."""


def spec_problems(spec: JobSpec) -> list[str]:
    """Every problem of a JobSpec, from every check in ``SPEC_CHECKS`` (the one validator: orchctl runs
    it on a file, orchd on every spec submitted over the wire)."""
    return [problem for check in SPEC_CHECKS for problem in check(spec)]


def _trainer_problems(spec: JobSpec) -> list[str]:
    """The built-in trainer's arguments (an empty ``trainer.command``) against its torch-free schema; a job's
    own command is not checked (its program owns its arguments)."""
    return [] if spec.trainer.command else trainer_args_problems(spec.trainer.args)


def _field_problems(spec: JobSpec) -> list[str]:
    """The fields' own rules and bounds."""
    p: list[str] = []
    if not spec.name.strip():
        p.append("name: must not be empty")
    if spec.total_steps <= 0:
        p.append(f"total_steps: must be > 0, got {spec.total_steps}")
    if spec.gpus_per_node < 1:
        p.append(f"gpus_per_node: must be >= 1, got {spec.gpus_per_node}")
    if spec.nodes_min < 1:
        p.append(f"nodes_min: must be >= 1, got {spec.nodes_min}")
    if not spec.nodes_min <= spec.nodes <= spec.nodes_max:
        p.append("nodes: need nodes_min <= nodes <= nodes_max, "
                 f"got {spec.nodes_min} <= {spec.nodes} <= {spec.nodes_max}")
    if spec.step_time_s_estimate <= 0:
        p.append(f"step_time_s_estimate: must be > 0, got {spec.step_time_s_estimate}")
    for i, c in enumerate(spec.clouds):
        if c not in KNOWN_CLOUDS:
            p.append(f"clouds[{i}]: {c!r} is not one of {', '.join(KNOWN_CLOUDS)}")
    if spec.budget_usd is not None and spec.budget_usd <= 0:
        p.append(f"budget_usd: must be > 0, got {spec.budget_usd}")
    ck = spec.checkpoint
    p += _checkpoint_url_problems("checkpoint.url", ck.url)
    start = ck.start_from
    if isinstance(start, str):
        p += _checkpoint_url_problems("checkpoint.start_from", start)
        if start.startswith(CHECKPOINT_SCHEMES) and relation(start, ck.url) is not None:
            p.append(f"checkpoint.start_from: must lie outside checkpoint.url (the job's own root, which it "
                     f"rotates), got {start!r}")
    if ck.interval_s is not None and ck.interval_s <= 0:
        p.append(f"checkpoint.interval_s: must be > 0, got {ck.interval_s}")
    if ck.keep < 1:
        p.append(f"checkpoint.keep: must be >= 1, got {ck.keep}")
    pr = spec.price
    if not 0 < pr.resume_below_ratio <= pr.pause_above_ratio:
        p.append("price: need 0 < resume_below_ratio <= pause_above_ratio")
    named = {problem.split(":")[0] for problem in p}
    return p + [m for m in _magnitude_problems(spec) if m.split(":")[0] not in named]


_DAY_S = 86400.0
_MAGNITUDES: tuple[tuple[str, float, float], ...] = (
    # (field path, lowest, highest): what no honest spec goes beyond (a spec over the wire is not trusted)
    ("total_steps", 1, 2**53),
    ("gpus_per_node", 1, 64),
    ("nodes_max", 1, 100_000),
    ("step_time_s_estimate", 1e-3, 7 * _DAY_S),
    ("budget_usd", 1e-6, 1e9),
    ("deadline_ts", 1e9, 1e11),  # 2001 .. 5138, in unix seconds
    ("checkpoint.interval_s", 1.0, 30 * _DAY_S),
    ("checkpoint.keep", 1, 1000),
    ("checkpoint.save_s_estimate", 1e-3, _DAY_S),
    ("price.pause_above_ratio", 1e-3, 1000.0),
    ("price.resume_below_ratio", 1e-3, 1000.0),
    ("price.migrate_min_saving", 0.0, 1.0),
)


SWEEP_ID_RE: typing.Final = re.compile(r"[a-z0-9][a-z0-9-]{0,39}")
"""A sweep id (``JobSpec.sweep_id``, docs/sweeps.md): lower-case letters, digits and dashes, 1 .. 40."""


SWEEP_CAPS: typing.Final = (("sweep_budget_usd", 1e-6, 1e9), ("sweep_deadline_ts", 1e9, 1e11))
"""The sweep's total budget and deadline on a trial job (core/sweeps.py): bounds like budget_usd, deadline_ts."""


def _sweep_problems(spec: JobSpec) -> list[str]:
    """The sweep id a trial job carries and the sweep's total budget and deadline (set by the sweep
    controller, never by a job file): the caps need a sweep id and must be finite and within bounds."""
    p: list[str] = []
    sid = spec.sweep_id
    if isinstance(sid, str) and SWEEP_ID_RE.fullmatch(sid) is None:
        p.append(f"sweep_id: must match {SWEEP_ID_RE.pattern}, got {sid[:60]!r}")
    for name, lo, hi in SWEEP_CAPS:
        value = getattr(spec, name)
        if isinstance(value, msgspec.UnsetType):
            continue
        if not isinstance(sid, str):
            p.append(f"{name}: only on a job of a sweep (with sweep_id)")
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
                math.isfinite(value) and lo <= value <= hi):
            p.append(f"{name}: must be a number within {lo:g} .. {hi:g}, got {value!r}")
    return p


TRACKING_SCHEMES = ("http://", "https://")
TRACKING_SECRET_ENV = ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME",
                       "DATABRICKS_TOKEN")
"""Credentials of a tracking server: never in a job's spec (its state, logs and ``orchctl`` output)."""


def _tracking_problems(spec: JobSpec) -> list[str]:
    """``[tracking]``: a plain http(s) URI without credentials, an experiment name; no tracking credentials in
    ``trainer.env`` (orchd and the agents take them from their own environment, docs/tracking.md)."""
    p = [f"trainer.env.{k}: credentials never go in a job spec (it is kept in orchd's state and shown by "
         "orchctl); set it in the environment of orchd and of the agents" for k in sorted(spec.trainer.env)
         if k in TRACKING_SECRET_ENV]
    t = spec.tracking
    if isinstance(t, msgspec.UnsetType):
        return p
    if isinstance(t.server, str) and not is_token(t.server, 64):
        p.append(f"tracking.server: the name of a server of orchd's [tracking.servers], got {t.server[:64]!r}")
    if t.uri and not t.uri.startswith(TRACKING_SCHEMES):  # no uri: the server's, set by orchd at submit
        p.append(f"tracking.uri: must start with one of {', '.join(TRACKING_SCHEMES)}, got {t.uri[:100]!r}")
    elif t.uri:
        netloc = t.uri.split("://", 1)[1].split("/", 1)[0]
        if "@" in netloc:  # never echo the secret back
            p.append("tracking.uri: must not carry credentials (user:password@host): set MLFLOW_TRACKING_USERNAME "
                     "and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the environment of orchd and "
                     "of the agents")
        elif not netloc:
            p.append(f"tracking.uri: no host in {t.uri[:100]!r}")
    if not t.experiment.strip():
        p.append("tracking.experiment: must not be empty")
    for key, value in (("tracking.uri", t.uri), ("tracking.experiment", t.experiment),
                       ("tracking.run_name", t.run_name)):
        if len(value) > 500:
            p.append(f"{key}: at most 500 characters, got {len(value)}")
    return p


def _name_problems(spec: JobSpec) -> list[str]:
    """The names a spec places the job by (clouds, regions, zones: tokens; instance types: dotted keys,
    ``wire.names``): a name no pool can have is refused here with the field, not matched never."""
    p: list[str] = []
    for name, values, check in (("clouds", spec.clouds, check_token), ("regions", spec.regions, check_token),
                                ("zones", spec.zones, check_token), ("instance_types", spec.instance_types, check_key)):
        for i, value in enumerate(values):
            try:
                check(f"{name}[{i}]", value)
            except BadName as e:
                p.append(str(e))
    return p


SPEC_CHECKS: tuple[SpecCheck, ...] = (_field_problems, _trainer_problems, _sweep_problems, _tracking_problems,
                                      _name_problems)
"""The checks ``spec_problems`` runs, in this order, all of them on every spec. A further rule on the spec
alone is one more entry here. A check that needs orchd's state (e.g. checkpoint-root ownership or feasibility
against the pools) is a ``SpecCheck`` bound to that state which orchd's submit path appends to these."""


def _magnitude_problems(spec: JobSpec) -> list[str]:
    """Every number within what an honest spec could hold: finite, neither absurdly large nor small."""
    out = []
    for path, lo, hi in _MAGNITUDES:
        value: object = spec
        for part in path.split("."):
            value = getattr(value, part, None)
        if value is None or not isinstance(value, int | float):
            continue  # optional and unset (checked above when it must be set)
        if not (math.isfinite(value) and lo <= value <= hi):
            out.append(f"{path}: must be within {lo:g} .. {hi:g}, got {value!r}")
    return out
