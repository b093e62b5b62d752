"""Tracking in the spec and the core: one run per job, created once, its id in the state and in every generation.

Pure: no MLflow here (tests/integration/test_tracking_mlflow.py has the real server).
"""

from __future__ import annotations

import msgspec
import pytest

from orchestrator.core import JobPhase, state_from_records, state_to_records
from orchestrator.core.commands import CreateTrackingRun
from orchestrator.core.inputs import JobSubmitted, Tick, TrackingRunCreated
from orchestrator.core.model import CoreConfig
from orchestrator.core.state import State
from orchestrator.jobspec import JobSpecError, parse_jobspec, spec_problems
from tests.core.harness import (
    AgentState,
    Driver,
    GenerationStarted,
    Heartbeat,
    RanksExited,
    StartGenerationCmd,
    cmds,
    pool,
    price,
    spec,
)
from wire import TrackingSpec, TrainerSpec

BASE = 'name = "j"\ntotal_steps = 10\ngpu_type = "A100"\n[checkpoint]\nurl = "file:///ckpt"\n'
TRACKED = TrackingSpec(uri="http://mlflow:5000", experiment="exp")


def test_tracking_table_parses_into_the_spec() -> None:
    s = parse_jobspec(BASE + '[tracking]\nuri = "https://mlflow.example:5000"\nexperiment = "gpt"\n')
    assert s.tracking == TrackingSpec(uri="https://mlflow.example:5000", experiment="gpt", run_name="")
    assert isinstance(parse_jobspec(BASE).tracking, msgspec.UnsetType)
    # a spec without tracking encodes as before the field existed
    assert b"tracking" not in msgspec.json.encode(parse_jobspec(BASE))


def test_credentials_are_refused_and_never_echoed() -> None:
    with pytest.raises(JobSpecError) as e:
        parse_jobspec(BASE + '[tracking]\nuri = "https://alice:s3cret@mlflow:5000"\nexperiment = " "\n'
                      '[trainer.env]\nMLFLOW_TRACKING_PASSWORD = "s3cret"\n')
    text = str(e.value)
    assert "s3cret" not in text
    assert "tracking.uri: must not carry credentials" in text
    assert "tracking.experiment: must not be empty" in text
    assert "trainer.env.MLFLOW_TRACKING_PASSWORD: credentials never go in a job spec" in text
    bad = spec(tracking=TrackingSpec(uri="file:///tmp/mlruns", experiment="e"))
    assert spec_problems(bad) == ["tracking.uri: must start with one of http://, https://, got 'file:///tmp/mlruns'"]


def _running(drv: Driver, **kw: object) -> list[str]:
    drv(price(pool(), 10.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_max=1, **kw)))
    ids = drv.launched(d)
    drv.register(ids)
    return ids


def _start_env(drv: Driver) -> dict[str, str]:
    (start,) = [c for d in drv.decisions for c in cmds(d, StartGenerationCmd)][-1:]
    return dict(start.trainer.env)


def test_one_run_per_job_its_id_kept_and_handed_to_every_generation() -> None:
    drv = Driver(State.empty(CoreConfig(price_confirm_s=0.0)))
    drv(price(pool(), 10.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_max=1, tracking=TRACKED,
                                                trainer=TrainerSpec(env={"A": "1", "MLFLOW_RUN_ID": "spoof"}))))
    assert cmds(d, CreateTrackingRun) == [CreateTrackingRun(job_id="j1", uri=TRACKED.uri, experiment="exp",
                                                            run_name="t")]
    # before the run exists, generation 1 gets the URI and the experiment (the trainer finds the run by tag)
    ids = drv.launched(d)
    drv.register(ids)
    env = _start_env(drv)
    assert env["A"] == "1" and env["ORCH_TRACKING"] == "mlflow" and env["MLFLOW_TRACKING_URI"] == TRACKED.uri
    assert env["MLFLOW_EXPERIMENT_NAME"] == "exp" and "MLFLOW_RUN_ID" not in env
    d = drv(TrackingRunCreated(job_id="j1", run_id="abc123"))
    assert drv.job().tracking_run_id == "abc123" and "job.j1" in d.dirty
    # a redelivery or a second answer never replaces it
    drv(TrackingRunCreated(job_id="j1", run_id="zzz999"))
    drv(TrackingRunCreated(job_id="j1", run_id="../bad"))
    drv(TrackingRunCreated(job_id="nope", run_id="abc"))
    assert drv.job().tracking_run_id == "abc123"
    # the run id survives the records (a restarted orchd) and reaches the next generation
    drv.state = state_from_records(state_to_records(drv.state))
    drv(GenerationStarted(id="g", node_id=ids[0], job_id="j1", generation=1, first_step=1, ts=drv.now), dt=1)
    drv(RanksExited(id="x", node_id=ids[0], job_id="j1", generation=1, exit_code=1, reason="failed",
                    last_step=3, ts=drv.now), dt=1)
    for _ in range(300):  # the restart hold, the idle node heartbeating
        node = drv.state.nodes[ids[0]]
        drv(Heartbeat(node_id=ids[0], seq=node.hb_seq + 1, ts=drv.now, state=AgentState.IDLE))
        if cmds(drv(Tick(), dt=1.0), StartGenerationCmd):
            break
    assert drv.job().generation == 2
    env = _start_env(drv)
    assert env["MLFLOW_RUN_ID"] == "abc123" and env["A"] == "1"
    assert sum(len(cmds(x, CreateTrackingRun)) for x in drv.decisions) == 1


def test_untracked_jobs_are_unchanged() -> None:
    drv = Driver(State.empty(CoreConfig(price_confirm_s=0.0)))
    _running(drv, trainer=TrainerSpec(env={"A": "1"}))
    assert not any(cmds(d, CreateTrackingRun) for d in drv.decisions)
    assert _start_env(drv) == {"A": "1"}
    d = drv(TrackingRunCreated(job_id="j1", run_id="abc"))
    assert isinstance(drv.job().tracking_run_id, msgspec.UnsetType) and not d.dirty
    assert b"tracking" not in state_to_records(drv.state)["job.j1"]
    assert drv.job().phase in (JobPhase.STARTING, JobPhase.RUNNING)
