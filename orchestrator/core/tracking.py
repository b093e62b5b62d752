"""A job's MLflow run in the core: ask the shell to create it once, keep its id, hand it to every generation.

Role: the pure part of tracking (docs/tracking.md). At submit, a job whose spec has ``[tracking]`` gets one
``CreateTrackingRun`` command; the shell creates the run (or finds the one it created before a crash: the
run carries the job id as a tag) and feeds back ``TrackingRunCreated``, whose run id the job keeps. Every
``StartGenerationCmd`` hands the trainer MLflow's standard variables (``trainer_spec``): the tracking URI,
the experiment name and, once known, the run id. A generation started before the run id is known finds the
run by its job-id tag (trainer/tracking.py). Credentials never pass through here: orchd and the agents take
them from their own environment.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from typing import Final

import msgspec

from orchestrator.core.commands import CreateTrackingRun
from orchestrator.core.inputs import TrackingRunCreated
from orchestrator.core.model import Job
from orchestrator.core.tx import Tx
from wire.messages import TrainerSpec

# MLflow's own variables (read by mlflow's client and by trainer.tracking), plus the tag naming the job
ENV_TRACKING_URI: Final = "MLFLOW_TRACKING_URI"
ENV_EXPERIMENT_NAME: Final = "MLFLOW_EXPERIMENT_NAME"
ENV_RUN_ID: Final = "MLFLOW_RUN_ID"
ENV_TRACKING: Final = "ORCH_TRACKING"  # = trainer.tracking.ENV_TRACKING: "mlflow" turns the trainer's logger on
JOB_TAG: Final = "orch.job_id"
MAX_RUN_ID_LEN: Final = 64


def on_submit(tx: Tx, job: Job) -> None:
    """A job asking for tracking: one command to create its run (deterministic, so a redecided submit
    gives the same outbox entry)."""
    t = job.spec.tracking
    if isinstance(t, msgspec.UnsetType):
        return
    tx.emit(CreateTrackingRun(job_id=job.job_id, uri=t.uri, experiment=t.experiment,
                              run_name=t.run_name or job.spec.name))


def run_created(tx: Tx, ev: TrackingRunCreated) -> None:
    """Keep the first run id of a tracked job; a redelivered or conflicting one changes nothing."""
    job = tx.jobs.get(ev.job_id)
    if job is None or isinstance(job.spec.tracking, msgspec.UnsetType):
        return
    if not isinstance(job.tracking_run_id, msgspec.UnsetType):
        if job.tracking_run_id != ev.run_id:
            tx.record(job.job_id, "tracking_run_ignored", "run_already_set", run_id=ev.run_id[:MAX_RUN_ID_LEN])
        return
    if not ev.run_id or len(ev.run_id) > MAX_RUN_ID_LEN or not ev.run_id.isalnum():
        tx.record(job.job_id, "tracking_run_ignored", "bad_run_id")
        return
    tx.update_job(job, tracking_run_id=ev.run_id)
    tx.record(job.job_id, "tracking_run", "created", run_id=ev.run_id)


def trainer_spec(job: Job) -> TrainerSpec:
    """The trainer a generation runs: the spec's, plus MLflow's variables when the job is tracked (the spec's
    own env never overrides them: a job logs to its own run only)."""
    t = job.spec.tracking
    tr = job.spec.trainer
    if isinstance(t, msgspec.UnsetType):
        return tr
    env = dict(tr.env)
    env[ENV_TRACKING] = "mlflow"
    env[ENV_TRACKING_URI] = t.uri
    env[ENV_EXPERIMENT_NAME] = t.experiment
    if isinstance(job.tracking_run_id, msgspec.UnsetType):
        env.pop(ENV_RUN_ID, None)
    else:
        env[ENV_RUN_ID] = job.tracking_run_id
    return msgspec.structs.replace(tr, env=env)
