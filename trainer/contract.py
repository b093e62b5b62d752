"""The agent <-> trainer contract: environment, control channel, exit codes, report lines.

Role: the single definition both sides import. This module must stay importable without torch (the
agent and orchd import it on hosts where torch may be absent). Documented in docs/trainer-contract.md.

Launch. The agent (or torchrun, or any launcher) starts one process per local rank with the usual
torch.distributed variables and ours:

    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT   (torch standard)
    ORCH_JOB_ID            job id (free text)
    ORCH_GENERATION        integer generation of the job this process belongs to
    ORCH_CKPT_URL          checkpoint root (file:///..., s3://bucket/prefix, gs://bucket/prefix,
                           az://container/prefix); claimed for ORCH_JOB_ID before the first write
                           (trainer.rootowner)
    ORCH_CLUSTER_ID        the orchd cluster's identity, named in the root's owner marker ("" outside orchd)
    ORCH_RESUME_FROM       "" (fresh start), "latest" (newest committed checkpoint under ORCH_CKPT_URL),
                           or the URL of one committed checkpoint
    ORCH_TOTAL_STEPS       train until this step (inclusive), then exit EXIT_COMPLETED
    ORCH_CONTROL_DIR       directory for control-channel requests (see below)
    ORCH_STEP_LOG          optional path of a JSONL file; every rank appends one StepRecord per step
    ORCH_COLLECTIVE_TIMEOUT_S  timeout for collectives, so a vanished peer never hangs survivors
    ORCH_TRAINER_ARGS      JSON object of trainer arguments (TrainerSpec.args)
    ORCH_CKPT_INTERVAL_S   optional periodic checkpoint interval in seconds chosen by orchd (Young/Daly);
                           overrides the trainer's own checkpoint-every setting when present
    ORCH_MODEL_SCHEMES     where Hugging Face models and data may come from (orchd's [trainer] model_schemes,
                           comma-separated); unset: every scheme (MODEL_SCHEMES)

Control channel. To ask for an emergency checkpoint the agent writes a CheckpointRequest as JSON to
``<ORCH_CONTROL_DIR>/checkpoint.json`` (write to a temp file, then rename) and sends SIGUSR1 to every
rank process. SIGTERM means the same with the deadline ``now + ORCH_SIGTERM_GRACE_S``. Ranks agree on the
stop step with one tiny all-reduce per step, save, commit, print a CheckpointReport line and exit with
EXIT_PREEMPTED.

Reports. Each rank prints JSON lines starting with ``{"orch":`` (the record's tag: "step",
"checkpoint" or "exit") on stdout; the agent parses those and
passes every other line through as a log line.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Final, Literal

import msgspec

from trainer.storage import SCHEMES as STORE_SCHEMES  # torch-free: the stores' scheme names and their aliases

# --- exit codes --------------------------------------------------------------------------------------
EXIT_COMPLETED: Final = 0  # reached ORCH_TOTAL_STEPS; final checkpoint committed
EXIT_FAILED: Final = 1  # an error in the training script
EXIT_PREEMPTED: Final = 75  # emergency checkpoint committed at the agreed step, exited on request
EXIT_CHECKPOINT_FAILED: Final = 76  # asked to checkpoint, but the save/commit failed or was abandoned
EXIT_PEER_LOST: Final = 77  # a collective timed out: a peer vanished; nothing committed at this step
EXIT_NO_CHECKPOINT: Final = 78  # asked to resume, but no checkpoint under the job's root verified: nothing trained
EXIT_REPLICA_UNUSABLE: Final = 79  # asked to resume from replicas (ORCH_REPLICA_STEP), some rank's is unusable

EXIT_REASONS: Final = {
    EXIT_COMPLETED: "completed",
    EXIT_FAILED: "failed",
    EXIT_PREEMPTED: "emergency_checkpoint",
    EXIT_CHECKPOINT_FAILED: "checkpoint_failed",
    EXIT_PEER_LOST: "peer_lost",
    EXIT_NO_CHECKPOINT: "no_usable_checkpoint",
    EXIT_REPLICA_UNUSABLE: "replica_unusable",
}
# ExitReport.reason prefix of an EXIT_CHECKPOINT_FAILED caused by storage (ENOSPC, DCP CheckpointException, a
# failed commit): "storage_error: <exception>". The agent reports the generation with this reason.
STORAGE_ERROR_REASON: Final = "storage_error"
# ExitReport.reason prefix (with EXIT_FAILED) and the agent's start-refusal prefix when the checkpoint root
# belongs to another job or cluster: "checkpoint_root_owned: checkpoint root <url> owned by job X of cluster Y".
ROOT_OWNED_REASON: Final = "checkpoint_root_owned"

# --- environment ----------------------------------------------------------------------------------
ENV_JOB_ID: Final = "ORCH_JOB_ID"
ENV_GENERATION: Final = "ORCH_GENERATION"
ENV_CKPT_URL: Final = "ORCH_CKPT_URL"
ENV_RESUME_FROM: Final = "ORCH_RESUME_FROM"
ENV_TOTAL_STEPS: Final = "ORCH_TOTAL_STEPS"
ENV_CONTROL_DIR: Final = "ORCH_CONTROL_DIR"
ENV_STEP_LOG: Final = "ORCH_STEP_LOG"
ENV_COLLECTIVE_TIMEOUT_S: Final = "ORCH_COLLECTIVE_TIMEOUT_S"
ENV_TRAINER_ARGS: Final = "ORCH_TRAINER_ARGS"
ENV_SIGTERM_GRACE_S: Final = "ORCH_SIGTERM_GRACE_S"
ENV_CKPT_INTERVAL_S: Final = "ORCH_CKPT_INTERVAL_S"
ENV_CLUSTER_ID: Final = "ORCH_CLUSTER_ID"
ENV_INTEGRATION: Final = "ORCH_INTEGRATION"  # "hf": a Hugging Face Trainer script or Accelerate loop (trainer.hf)
ENV_MODEL_SCHEMES: Final = "ORCH_MODEL_SCHEMES"  # where models and data may come from: orchd's config, never the job's
SPEC_ERROR_REASON: Final = "spec_error"
"""ExitReport reason prefix (exit 1) for a job spec that cannot run: a model path that does not exist, a dataset
without the text column. orchd fails the job at once instead of restarting it (the same spec fails again)."""

CHECKPOINT_REQUEST_FILE: Final = "checkpoint.json"
REPORT_PREFIX: Final = '{"orch":'

# Defaults the trainer applies when a variable is unset (added with the trainer, issue 3).
DEFAULT_SIGTERM_GRACE_S: Final = 30.0
DEFAULT_COLLECTIVE_TIMEOUT_S: Final = 60.0

# Checkpoint layout under ORCH_CKPT_URL (added with the trainer): one directory per step, counted only
# once the commit marker (JSON: step, world_size, files -> [size, crc32c]) exists; written last by rank 0.
CHECKPOINT_DIR_FORMAT: Final = "step_{step:09d}"
CHECKPOINT_COMMIT_MARKER: Final = "COMMITTED"


def commit_marker_step(body: bytes) -> int | None:
    """The step a commit marker (``COMMITTED``) names, or None when it is not a JSON object with an integer
    ``step`` (torch-free: the agent reads it to report the committed step instead of trusting a URL's name).
    Full validation of the marker is the trainer's (trainer.store.parse_marker)."""
    try:
        marker = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    step = marker.get("step") if isinstance(marker, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


# --- the built-in trainer's arguments (ORCH_TRAINER_ARGS) -------------------------------------------
# The schema of ``python -m trainer``'s arguments (trainer.gpt.TrainerArgs), torch-free so that orchd
# and orchctl check a job's ``trainer.args`` at submit; tests/unit/test_submit_validation.py keeps the two
# in step. A job with its own ``trainer.command`` gets its args unchecked (its program owns them).

TrainerSize = Literal["tiny", "mini", "small", "125m", "350m", "760m", "1.3b"]
TRAINER_SIZES: Final = typing.get_args(TrainerSize)
"""The model sizes of the built-in trainer (trainer.model.SIZES)."""

_Pos = Annotated[int, msgspec.Meta(ge=1)]
_NonNeg = Annotated[int, msgspec.Meta(ge=0)]
_PosFloat = Annotated[float, msgspec.Meta(gt=0)]
_NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
_Ratio = Annotated[float, msgspec.Meta(ge=0, le=1)]
TRAINER_ARGS: Final[dict[str, Any]] = {
    "size": TrainerSize,
    "seq_len": _Pos, "global_batch": _Pos, "micro_batch": _Pos,
    "lr": _PosFloat, "warmup_steps": _NonNeg, "min_lr_ratio": _Ratio, "weight_decay": _NonNegFloat,
    "grad_clip": _NonNegFloat, "seed": int, "corpus": str,
    "model": str, "dataset": str, "text_column": Annotated[str, msgspec.Meta(min_length=1)], "tokenizer": str,
    "total_steps": _Pos | None, "ckpt_every": _NonNeg, "keep": _Pos,
    "async_ckpt": Literal["thread", "process", "off"], "ckpt_threads": _Pos,
    "storage_options": dict[str, Any],
    "mode": Literal["fsdp", "ddp"], "device": Literal["auto", "cpu", "cuda"], "bf16": bool | None,
    "compile": bool, "activation_checkpointing": bool, "cpu_offload": bool, "debug_oom_above_micro": _NonNeg,
}
"""Argument name -> accepted type (with bounds and choices) of the built-in trainer."""


def trainer_args_problems(args: Mapping[str, Any], path: str = "trainer.args") -> list[str]:
    """Every problem of ``args`` for the built-in trainer, each ``path.key: why`` (empty: accepted)."""
    out = []
    for key in sorted(args):
        tp = TRAINER_ARGS.get(key)
        if tp is None:
            out.append(f"{path}.{key}: not an argument of the built-in trainer (python -m trainer); "
                       f"known: {', '.join(sorted(TRAINER_ARGS))}")
            continue
        value = args[key]
        try:
            msgspec.convert(value, tp)
        except msgspec.ValidationError as e:
            choices = typing.get_args(tp) if typing.get_origin(tp) is Literal else ()
            why = f"{value!r} is not one of {', '.join(choices)}" if choices else f"{e} (got {value!r})"
            out.append(f"{path}.{key}: {why}")
    return out + _exclusions(args, path)


def _exclusions(args: Mapping[str, Any], path: str) -> list[str]:
    """Arguments that exclude or need each other: a Hugging Face ``model`` or the GPT's ``size``; ``dataset``
    (needs ``model``) or ``corpus``; ``text_column`` / ``tokenizer`` only with ``model``."""
    out = []
    if args.get("model") in TRAINER_SIZES:
        out.append(f"{path}.model: {args['model']!r} is a size of the built-in GPT: give size = {args['model']!r} "
                   "(model names a Hugging Face model)")
    elif args.get("model") and "size" in args:
        out.append(f"{path}.size: give either size (the built-in GPT) or model (a Hugging Face model), not both")
    if args.get("dataset") and args.get("corpus"):
        out.append(f"{path}.corpus: give either dataset or corpus, not both")
    for key, default in (("dataset", ""), ("text_column", "text"), ("tokenizer", "")):
        if args.get(key, default) != default and not args.get("model"):
            out.append(f"{path}.{key}: needs {path}.model (a Hugging Face model and its tokenizer)")
    return out


MODEL_SCHEMES: Final = ("file", "s3", "gs", "az", "hub", "builtin")
"""Where a Hugging Face model, tokenizer or dataset (``trainer.args.model`` / ``tokenizer`` / ``dataset``) may come
from: every scheme the trainer knows (``hub``: a hub id; ``builtin``: ``builtin://NAME``, a config shipped with the
trainer). The default of orchd's ``[trainer] model_schemes``, which orchd passes to every generation as
``ORCH_MODEL_SCHEMES`` (comma-separated) and checks at submit."""
MODEL_SOURCE_ARGS: Final = ("model", "tokenizer", "dataset")


def source_scheme(value: str) -> str | None:
    """The scheme of a model, tokenizer or dataset source as far as the value shows it without the node's files:
    a URL's scheme (aliases folded: ``s3a`` -> ``s3``, ``gcs`` -> ``gs``, ``abfs`` -> ``az``), ``builtin`` for
    ``builtin://NAME``, ``file`` for an absolute or home path; None for a bare name (a hub id, or a path relative
    to the node's work directory: only the node can tell, and the trainer checks it there)."""
    if "://" in value:
        raw = value.split("://", 1)[0].lower()
        return STORE_SCHEMES.get(raw, raw)
    if value.startswith(("/", "~")):
        return "file"
    return None


def scheme_names(values: typing.Iterable[str]) -> tuple[str, ...]:
    """Scheme names with their aliases folded, in order, without repeats."""
    out: list[str] = []
    for v in values:
        name = STORE_SCHEMES.get(v.strip().lower(), v.strip().lower())
        if name and name not in out:
            out.append(name)
    return tuple(out)


def model_scheme_problems(args: Mapping[str, Any], allowed: typing.Iterable[str],
                          path: str = "trainer.args") -> list[str]:
    """The model, tokenizer and dataset sources of ``args`` whose scheme ``allowed`` (orchd's ``[trainer]
    model_schemes``) does not name, each ``path.key: why``. A bare name (hub id or relative path) is left to
    the trainer on the node; ``tokenizer = "bytes"`` is no source."""
    ok = scheme_names(allowed)
    out = []
    for key in MODEL_SOURCE_ARGS:
        value = args.get(key)
        if not isinstance(value, str) or not value or (key == "tokenizer" and value == "bytes"):
            continue
        scheme = source_scheme(value)
        if scheme is not None and scheme not in ok:
            out.append(f"{path}.{key}: scheme {scheme!r} of {value[:200]!r} is not allowed by orchd's configuration "
                       f"([trainer] model_schemes = {', '.join(ok)})")
    return out


class CheckpointRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    reason: str  # preemption_notice | sigterm | price_pause | budget | migrate | drain | admin
    deadline_ts: float | None  # wall-clock epoch seconds by which the commit must be done
    issued_ts: float


# --- report lines (stdout) ------------------------------------------------------------------------


class StepReport(msgspec.Struct, frozen=True, kw_only=True, tag_field="orch", tag="step"):
    rank: int
    generation: int
    step: int
    loss: float
    grad_norm: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    step_time_s: float
    ts: float
    # A job with shard replicas (trainer.replicas): steps a loss during this step would send back - the step
    # minus the newest step every rank had finished replicating before it began (k + 1 when copies keep up).
    # Unset is not encoded.
    replica_lag: int | msgspec.UnsetType = msgspec.UNSET


class CheckpointReport(msgspec.Struct, frozen=True, kw_only=True, tag_field="orch", tag="checkpoint"):
    rank: int
    generation: int
    step: int
    checkpoint_id: str
    url: str
    save_s: float  # request (or periodic start) -> commit marker written
    emergency: bool
    deadline_margin_s: float | None = None  # deadline - commit time
    reason: str = "periodic"
    ts: float


class ExitReport(msgspec.Struct, frozen=True, kw_only=True, tag_field="orch", tag="exit"):
    rank: int
    generation: int
    exit_code: int
    reason: str
    last_step: int
    ts: float


Report = StepReport | CheckpointReport | ExitReport


class StepRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One line of ORCH_STEP_LOG per rank per step: what was actually fed to the model."""

    generation: int
    step: int
    rank: int
    world_size: int
    loss: float
    sample_ids: tuple[int, ...]
    ts: float


_report_decoder = msgspec.json.Decoder(Report)
_encoder = msgspec.json.Encoder()


def encode_report(report: StepReport | CheckpointReport | ExitReport) -> str:
    return _encoder.encode(report).decode()


def parse_report(line: str) -> StepReport | CheckpointReport | ExitReport | None:
    """Parse one stdout line; None when it is an ordinary log line (or a malformed report)."""
    line = line.strip()
    if not line.startswith(REPORT_PREFIX):
        return None
    try:
        return _report_decoder.decode(line)
    except msgspec.DecodeError:
        return None


def write_checkpoint_request(control_dir: str, request: CheckpointRequest) -> str:
    """Atomically place a request for ranks to read after SIGUSR1. Returns the file path."""
    path = os.path.join(control_dir, CHECKPOINT_REQUEST_FILE)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(_encoder.encode(request))
    os.replace(tmp, path)
    return path


def read_checkpoint_request(control_dir: str) -> CheckpointRequest | None:
    path = os.path.join(control_dir, CHECKPOINT_REQUEST_FILE)
    try:
        with open(path, "rb") as f:
            return msgspec.json.decode(f.read(), type=CheckpointRequest)
    except (FileNotFoundError, msgspec.DecodeError):
        return None


