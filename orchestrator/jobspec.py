"""Job spec files (TOML or YAML) -> ``events.JobSpec``, with every problem reported at once.

Role: the edge between a user's file and the typed ``JobSpec`` the core receives. ``load_jobspec``
parses the file (by suffix: .toml, .yaml/.yml), checks every key (unknown keys, wrong types, bad
values, cross-field rules) and raises one ``JobSpecError`` listing all problems with their key paths.
``spec_problems`` holds the cross-field rules, so orchd re-checks specs that arrive over the wire.

File layout (see config/jobs/*.toml|yaml)::

    name, total_steps, gpu_type, gpus_per_node, nodes, nodes_min, nodes_max, step_time_s_estimate,
    clouds, regions, zones, instance_types, market (spot | on_demand | spot_with_fallback),
    deadline (TOML/YAML datetime or ISO-8601 string) or deadline_ts (unix seconds), budget_usd
    [trainer]    command = [...] | config = "path" (passed as args.config), args = {...}, env = {...}
    [checkpoint] url (file:// s3:// gs:// az://), interval_s, keep, save_s_estimate
    [price]      pause_above_ratio, resume_below_ratio, migrate_min_saving

Pure apart from reading the file; no clock.
"""

from __future__ import annotations

import datetime as dt
import os
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import yaml

from wire import CheckpointPolicy, JobSpec, MarketPolicy, PricePolicy, TrainerSpec

KNOWN_CLOUDS = ("aws", "gcp", "azure", "local", "fake")
CHECKPOINT_SCHEMES = ("file://", "s3://", "gs://", "az://", "abfs://")


class JobSpecError(ValueError):
    def __init__(self, problems: list[str], source: str = "job spec") -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid {source} ({len(problems)} problem{'s' * (len(problems) != 1)}):\n{lines}")


_TOP = {
    "name": str, "total_steps": int, "gpu_type": str, "gpus_per_node": int, "nodes": int, "nodes_min": int,
    "nodes_max": int, "step_time_s_estimate": float, "clouds": tuple[str, ...], "regions": tuple[str, ...],
    "zones": tuple[str, ...], "instance_types": tuple[str, ...], "market": MarketPolicy,
    "deadline": Any, "deadline_ts": float, "budget_usd": float,
    "trainer": dict, "checkpoint": dict, "price": dict,
}
_REQUIRED = ("name", "total_steps", "gpu_type", "checkpoint")
_TRAINER = {"command": tuple[str, ...], "config": str, "args": dict[str, str | int | float | bool],
            "env": dict[str, str]}
_CHECKPOINT = {"url": str, "interval_s": float, "keep": int, "save_s_estimate": float}
_PRICE = {"pause_above_ratio": float, "resume_below_ratio": float, "migrate_min_saving": float}


def load_jobspec(path: str | os.PathLike[str]) -> JobSpec:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise JobSpecError([f"cannot read {p}: {e.strerror}"], str(p)) from None
    return parse_jobspec(text, fmt="yaml" if p.suffix in (".yaml", ".yml") else "toml", source=str(p))


def parse_jobspec(text: str, fmt: str = "toml", source: str = "job spec") -> JobSpec:
    try:
        raw = tomllib.loads(text) if fmt == "toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise JobSpecError([f"not valid {fmt.upper()}: {e}"], source) from None
    if not isinstance(raw, dict):
        raise JobSpecError([f"expected a table at the top level, got {type(raw).__name__}"], source)
    spec, problems = build_jobspec(raw)
    if problems or spec is None:
        raise JobSpecError(problems, source)
    return spec


def _check_table(raw: Any, fields: dict[str, Any], path: str, problems: list[str]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        problems.append(f"{path}: expected a table, got {type(raw).__name__}")
        return {}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in fields:
            problems.append(f"{where}: unknown key (known: {', '.join(sorted(fields))})")
            continue
        tp = fields[key]
        if tp is Any:
            out[key] = value
            continue
        if tp is float and isinstance(value, bool):
            problems.append(f"{where}: expected a number, got {value!r}")
            continue
        try:
            out[key] = msgspec.convert(value, tp, strict=False) if tp is not dict else _need_dict(value)
        except (msgspec.ValidationError, TypeError) as e:
            problems.append(f"{where}: {_short(e, value)}")
    return out


def _need_dict(value: Any) -> dict:
    if not isinstance(value, dict):
        raise TypeError(f"expected a table, got {type(value).__name__}")
    return value


def _short(e: Exception, value: Any) -> str:
    text = str(e)
    return f"{text} (got {value!r})" if "Expected" in text else text


def _deadline(value: Any, problems: list[str]) -> float | None:
    if isinstance(value, dt.datetime):
        when = value
    elif isinstance(value, dt.date):
        when = dt.datetime(value.year, value.month, value.day)
    elif isinstance(value, str):
        try:
            when = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            problems.append(f"deadline: not an ISO-8601 date-time: {value!r}")
            return None
    else:
        problems.append(f"deadline: expected a date-time, got {value!r}")
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)  # a deadline without a zone is UTC, never local time
    return when.timestamp()


def build_jobspec(raw: dict[str, Any]) -> tuple[JobSpec | None, list[str]]:
    problems: list[str] = []
    top = _check_table(raw, _TOP, "", problems)
    for key in _REQUIRED:
        if key not in raw:
            problems.append(f"{key}: required")
    trainer = _check_table(top.get("trainer", {}), _TRAINER, "trainer", problems)
    ckpt = _check_table(top.get("checkpoint", {}), _CHECKPOINT, "checkpoint", problems)
    price = _check_table(top.get("price", {}), _PRICE, "price", problems)
    if "checkpoint" in raw and "url" not in ckpt and isinstance(raw.get("checkpoint"), dict):
        if "url" not in raw["checkpoint"]:
            problems.append("checkpoint.url: required")
    if "command" in trainer and "config" in trainer:
        problems.append("trainer: give either command or config, not both")
    deadline_ts = top.get("deadline_ts")
    if "deadline" in top:
        if deadline_ts is not None:
            problems.append("deadline: give either deadline or deadline_ts, not both")
        deadline_ts = _deadline(top["deadline"], problems)
    # Fill what is missing or failed with valid placeholders, so the value and cross-field rules
    # below still report every other problem in the same error (never about a placeholder).
    failed = {p.split(":")[0] for p in problems}
    for key, placeholder in (("name", "job"), ("total_steps", 1), ("gpu_type", "gpu")):
        top.setdefault(key, placeholder)
    ckpt.setdefault("url", "file:///placeholder")
    args = dict(trainer.get("args", {}))
    if "config" in trainer:
        args["config"] = trainer["config"]
    fields = {k: v for k, v in top.items() if k not in ("trainer", "checkpoint", "price", "deadline", "deadline_ts")}
    nodes = fields.get("nodes", 1)
    fields.setdefault("nodes_min", min(nodes, fields.get("nodes_max", nodes)))
    fields.setdefault("nodes_max", max(nodes, fields["nodes_min"]))
    try:
        spec = JobSpec(
            **fields,
            trainer=TrainerSpec(command=trainer.get("command", ()), args=args, env=trainer.get("env", {})),
            checkpoint=CheckpointPolicy(**ckpt),
            price=PricePolicy(**price),
            deadline_ts=deadline_ts,
        )
    except (TypeError, msgspec.ValidationError) as e:
        return None, problems + [str(e)]
    problems += [p for p in spec_problems(spec) if p.split(":")[0] not in failed]
    return (None if problems else spec), problems


def spec_problems(spec: JobSpec) -> list[str]:
    """Cross-field rules of a JobSpec (also applied by orchd to specs that arrive over the wire)."""
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
        p.append(f"nodes: need nodes_min <= nodes <= nodes_max, got {spec.nodes_min} <= {spec.nodes} <= {spec.nodes_max}")
    if spec.step_time_s_estimate <= 0:
        p.append("step_time_s_estimate: must be > 0")
    for i, c in enumerate(spec.clouds):
        if c not in KNOWN_CLOUDS:
            p.append(f"clouds[{i}]: {c!r} is not one of {', '.join(KNOWN_CLOUDS)}")
    if spec.budget_usd is not None and spec.budget_usd <= 0:
        p.append(f"budget_usd: must be > 0, got {spec.budget_usd}")
    ck = spec.checkpoint
    if not ck.url.startswith(CHECKPOINT_SCHEMES):
        p.append(f"checkpoint.url: must start with one of {', '.join(CHECKPOINT_SCHEMES)}, got {ck.url!r}")
    if ck.interval_s is not None and ck.interval_s <= 0:
        p.append("checkpoint.interval_s: must be > 0")
    if ck.keep < 1:
        p.append("checkpoint.keep: must be >= 1")
    pr = spec.price
    if not 0 < pr.resume_below_ratio <= pr.pause_above_ratio:
        p.append("price: need 0 < resume_below_ratio <= pause_above_ratio")
    return p
