"""The rules of a ``wire.JobSpec`` however it was made: ``spec_problems`` runs every check of ``SPEC_CHECKS``
(the fields' bounds, the built-in trainer's arguments against ``trainer.contract.TRAINER_ARGS``, sweeps,
tracking, names) and lists every problem at once. orchctl runs it on a file (through
``orchestrator.jobspec``), orchd on every spec submitted over the wire. Pure."""

from __future__ import annotations

import math
import re
import typing
from collections.abc import Callable, Iterable
from typing import Literal

import msgspec

from orchestrator.core.roots import relation
from trainer.contract import ENV_INTEGRATION, ENV_MODEL_SCHEMES, model_scheme_problems, trainer_args_problems
from wire import JobSpec
from wire.names import BadName, check_key, check_token, is_token

Cloud = Literal["aws", "gcp", "azure", "local", "fake"]
KNOWN_CLOUDS: tuple[str, ...] = typing.get_args(Cloud)
CHECKPOINT_SCHEMES = ("file://", "s3://", "gs://", "az://", "abfs://")


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
    own command is not checked (its program owns its arguments). No job sets where models may come from.
    Shard replicas are refused for a Hugging Face Trainer script: ``spot_train`` hands the Trainer the
    durable checkpoint's step count before any callback runs, so the step orchd chose from the replicas could
    not be honoured (docs/trainer.md)."""
    p = [] if spec.trainer.command else trainer_args_problems(spec.trainer.args)
    if ENV_MODEL_SCHEMES in spec.trainer.env:
        p.append(f"trainer.env.{ENV_MODEL_SCHEMES}: where models and data may come from is orchd's configuration "
                 "([trainer] model_schemes), never a job's")
    k = spec.checkpoint.replica_every
    if isinstance(k, int) and k > 0 and spec.trainer.env.get(ENV_INTEGRATION) == "hf":
        p.append('checkpoint.replica_every: not with trainer.integration = "hf" (a Trainer script resumes from '
                 "the durable checkpoint only); leave it out")
    return p


def model_source_problems(spec: JobSpec, allowed: Iterable[str]) -> list[str]:
    """The built-in trainer's model, tokenizer and dataset sources against ``allowed`` (orchd's ``[trainer]
    model_schemes``: a check bound to orchd's configuration, run at submit after ``SPEC_CHECKS``). A job's own
    command loads its own model; its generations get the same list (``ORCH_MODEL_SCHEMES``) all the same."""
    return [] if spec.trainer.command else model_scheme_problems(spec.trainer.args, allowed)


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
    ("checkpoint.replica_every", 0, 1_000_000),  # 0: off
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
