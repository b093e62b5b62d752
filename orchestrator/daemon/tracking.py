"""orchd's side of MLflow tracking: create each tracked job's run once, and log orchd's own figures to it.

Role (docs/tracking.md):

- ``create_run`` (blocking; the executor runs it in a worker thread for the core's ``CreateTrackingRun``
  and feeds back ``TrackingRunCreated``): finds the experiment (creates it when missing), then the run
  tagged with the job's id - one created before a crash - or creates it. So re-executing the command
  after a restart never makes a second run.
- ``TrackingReporter``: after each decided batch, a tracked job whose figures changed gets its newest
  summary queued (latest wins, one per job); a background task sends them: tags ``orch.phase``,
  ``orch.generations``, ``orch.pools``, ``orch.preemptions``, ``orch.final_checkpoint``; metrics
  ``orchd/cost_usd``, ``orchd/goodput``, ``orchd/generations``, ``orchd/preemptions``,
  ``orchd/committed_step`` at the job's step; at the end the final checkpoint as the run's output (an
  external LoggedModel, ``log_final_checkpoint``) and the run's status (FINISHED, FAILED, KILLED).
  A tracking outage delays them (retried with backoff, the newest summary only) and never blocks the
  decide loop. Pools and preemptions are counted from what this orchd saw since it started leading.

Credentials: never in a spec or the state. The MLflow client reads MLFLOW_TRACKING_USERNAME/PASSWORD or
MLFLOW_TRACKING_TOKEN from orchd's own environment; nothing here logs a URI's user part or a header. They go
only to the servers orchd's config lists (``TrackingGate``): a spec names one (``tracking.server``) or
inherits the default, and orchd sets its URI at submit; a URI no listed server has (a job stored before the
list, a sweep template) is never contacted - not by ``create_run``, not by the reporter, not by the
trainer (its MLflow variables are left out of the start command) - and the job runs untracked, with a
warning and a count (``orchd_messages_rejected_total{kind="tracking"}``). A plain-http server gets orchd's
credentials only when its entry says ``plain_http_credentials = true``.

Concurrency contract: ``after_batch`` runs on the decide loop's task (no I/O, no waiting); ``run`` is a task
of its own whose MLflow calls run in worker threads; ``create_run`` is called in a worker thread.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec
import structlog

import wire as ev
from orchestrator.core import Job, JobPhase, State, job_cost_usd, job_step
from orchestrator.core.commands import CreateTrackingRun
from orchestrator.core.inputs import NodeGone
from orchestrator.core.tracking import JOB_TAG
from orchestrator.daemon.observe import MetricsObserver
from orchestrator.daemon.records import Decided
from orchestrator.settings import TrackingSettings

log = structlog.get_logger("orchd.tracking")

CLUSTER_TAG = "orch.cluster"

PACKAGE_HINT = "pip install 'spot-orchestrator[tracking]' (the mlflow-skinny package)"
_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
                  "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}
"""MLflow's client retries each request for minutes by default: orchd retries on its own terms instead; and
it would print a link to stdout when a run ends (``orchctl demo --json`` owns stdout). Set only where the
operator did not set them."""
_END_STATUS = {JobPhase.SUCCEEDED: "FINISHED", JobPhase.FAILED: "FAILED", JobPhase.CANCELLED: "KILLED"}
_LOST_REASONS = ("provider_missing", "provider_terminated", "agent_disconnected")


CREDENTIAL_ENV = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
TRAINER_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID", "ORCH_TRACKING")
"""The variables that make a trainer log to a tracking server (``orchestrator.core.tracking.trainer_spec``)."""


class TrackingGate:
    """Where orchd may use its MLflow credentials: the servers of ``[tracking.servers]``, by URI."""

    def __init__(self, settings: TrackingSettings, env: Mapping[str, str] | None = None) -> None:
        self.settings = settings
        self.by_uri = {_norm(s.uri): name for name, s in settings.servers.items()}
        env = os.environ if env is None else env
        self.credentials = any(env.get(k) for k in CREDENTIAL_ENV)

    def resolve(self, spec: ev.JobSpec) -> tuple[ev.JobSpec, list[str]]:
        """``spec`` with its tracking server's name and URI set (from its ``server``, its ``uri`` when that
        is a listed server's, or the default), or the problems that keep it from being tracked."""
        t = spec.tracking
        if isinstance(t, msgspec.UnsetType):
            return spec, []
        servers = self.settings.servers
        known = ", ".join(sorted(servers)) or "none: this orchd's config lists no [tracking.servers]"
        if isinstance(t.server, str) and t.server:
            name = t.server if t.server in servers else None
            if name is None:
                return spec, [f"tracking.server: {t.server[:64]!r} is not a tracking server of this orchd "
                              f"(known: {known})"]
        elif t.uri:
            name = self.by_uri.get(_norm(t.uri))
            if name is None:
                return spec, ["tracking.uri: a job names its tracking server by name (tracking.server = one of "
                              f"{known}), never by a URI of its own: orchd would send it its credentials"]
        else:
            name = self.settings.default or None
            if name is None:
                return spec, [f"tracking: names no server and this orchd has no tracking.default (known: {known})"]
        resolved = msgspec.structs.replace(t, server=name, uri=servers[name].uri)
        return msgspec.structs.replace(spec, tracking=resolved), []

    def refusal(self, uri: str) -> str | None:
        """Why orchd may not talk to ``uri`` with its credentials (``server_not_listed``,
        ``plain_http_credentials``), or None."""
        name = self.by_uri.get(_norm(uri))
        if name is None:
            return "server_not_listed"
        server = self.settings.servers[name]
        if self.credentials and server.uri.startswith("http://") and not server.plain_http_credentials:
            return "plain_http_credentials"
        return None


def _norm(uri: str) -> str:
    return uri.strip().rstrip("/")


def mlflow_available() -> bool:
    return importlib.util.find_spec("mlflow") is not None


def submit_problems(spec: ev.JobSpec) -> list[str]:
    """What keeps this orchd from tracking a job: the MLflow client package missing on its host."""
    if isinstance(spec.tracking, msgspec.UnsetType) or mlflow_available():
        return []
    return [f"tracking: this orchd cannot create MLflow runs, its host lacks the mlflow client: {PACKAGE_HINT}"]


def _client(uri: str) -> Any:
    for key, value in _HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def create_run(cmd: CreateTrackingRun, cluster_id: str = "") -> str:
    """The job's run id: the run tagged with its job id (and this cluster's id: a server shared with
    another cluster may hold a run of a job of the same id) in the experiment, else a new one (blocking)."""
    from mlflow.exceptions import MlflowException

    client = _client(cmd.uri)
    exp = client.get_experiment_by_name(cmd.experiment)
    if exp is None:
        try:
            exp_id = client.create_experiment(cmd.experiment)
        except MlflowException:  # created meanwhile by another job's run
            exp = client.get_experiment_by_name(cmd.experiment)
            if exp is None:
                raise
            exp_id = exp.experiment_id
    else:
        exp_id = exp.experiment_id
    job_id = str(cmd.job_id)
    if "'" not in job_id and "'" not in cluster_id:
        where = f"tags.`{JOB_TAG}` = '{job_id}'" + (f" and tags.`{CLUSTER_TAG}` = '{cluster_id}'" if cluster_id else "")
        found = client.search_runs([exp_id], filter_string=where, max_results=1)
        if found:
            return str(found[0].info.run_id)
    tags = {JOB_TAG: job_id}
    if cluster_id:
        tags[CLUSTER_TAG] = cluster_id
    run = client.create_run(exp_id, run_name=cmd.run_name, tags=tags)
    return str(run.info.run_id)


@dataclass(frozen=True, slots=True)
class Summary:
    """orchd's figures of one tracked job at one moment (what is logged to its run)."""

    uri: str
    run_id: str
    step: int
    ts_ms: int
    tags: tuple[tuple[str, str], ...]
    metrics: tuple[tuple[str, float], ...]
    status: str | None  # FINISHED | FAILED | KILLED once the job ended
    job_id: str = ""
    final_checkpoint: str | None = None  # the last committed checkpoint's URL once the job ended
    final_step: int = 0  # its step

    def same_figures(self, other: Summary | None) -> bool:
        return (other is not None and other.tags == self.tags and other.metrics == self.metrics
                and other.status == self.status and other.step == self.step)


@dataclass(slots=True)
class _Seen:
    pools: set[str] = field(default_factory=set)
    preemptions: int = 0


def summarize(state: State, job: Job, seen: _Seen, goodput: float | None, now: float) -> Summary | None:
    """The summary of a tracked job whose run exists (None otherwise). Pure."""
    t = job.spec.tracking
    if isinstance(t, msgspec.UnsetType) or isinstance(job.tracking_run_id, msgspec.UnsetType):
        return None
    for nid in job.nodes:
        node = state.nodes.get(nid)
        if node is not None:
            seen.pools.add(node.pool_name)
    tags = [("orch.phase", str(job.phase)), ("orch.generations", str(job.generation)),
            ("orch.pools", ",".join(sorted(seen.pools))[:4000]), ("orch.preemptions", str(seen.preemptions))]
    status = _END_STATUS.get(job.phase)
    if status is not None and job.committed_url is not None:
        tags.append(("orch.final_checkpoint", job.committed_url))
    cost = job_cost_usd(state, job.job_id, now)
    metrics = [("orchd/generations", float(job.generation)), ("orchd/preemptions", float(seen.preemptions)),
               ("orchd/committed_step", float(job.committed_step))]
    if math.isfinite(cost):
        metrics.append(("orchd/cost_usd", round(cost, 6)))
    if goodput is not None and math.isfinite(goodput):
        metrics.append(("orchd/goodput", round(goodput, 6)))
    final = job.committed_url if status is not None else None
    return Summary(uri=t.uri, run_id=job.tracking_run_id, step=job_step(state, job.job_id), ts_ms=int(now * 1000),
                   tags=tuple(tags), metrics=tuple(metrics), status=status, job_id=job.job_id,
                   final_checkpoint=final, final_step=job.committed_step)


def send_summary(s: Summary) -> None:
    """Log one summary to its run (blocking). Same timestamps on a retry: the server keeps one point."""
    from mlflow.entities import Metric, RunTag

    client = _client(s.uri)
    client.log_batch(s.run_id, metrics=[Metric(k, v, s.ts_ms, s.step) for k, v in s.metrics],
                     tags=[RunTag(k, v) for k, v in s.tags])
    if s.final_checkpoint is not None:
        log_final_checkpoint(client, s.run_id, s.job_id, s.final_checkpoint, s.final_step)
    if s.status is not None:
        client.set_terminated(s.run_id, status=s.status, end_time=s.ts_ms)


CHECKPOINT_URL_TAG = "orch.checkpoint_url"
FINAL_MODEL_NAME = "final_checkpoint"


def log_final_checkpoint(client: Any, run_id: str, job_id: str, url: str, step: int) -> str:
    """The job's final checkpoint as its run's output (blocking): an external LoggedModel - MLflow 3's
    model entity whose weights live outside MLflow (``mlflow.model.isExternal``), here at ``url`` (tag
    ``orch.checkpoint_url``) - finalized READY and logged with ``log_outputs`` at the checkpoint's step.
    Idempotent, so a retried or re-sent summary adds nothing: a model of this run with this URL is
    reused (also one created before a crash and not yet finalized or logged as the output). Returns its
    model id."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_IS_EXTERNAL

    run = client.get_run(run_id)
    mine = [m for m in client.search_logged_models(experiment_ids=[run.info.experiment_id],
                                                   filter_string=f"source_run_id = '{run_id}'")
            if m.tags.get(CHECKPOINT_URL_TAG) == url]
    if mine:
        model = min(mine, key=lambda m: (m.creation_timestamp, m.model_id))
    else:
        model = client.create_logged_model(
            run.info.experiment_id, name=FINAL_MODEL_NAME, source_run_id=run_id, model_type="checkpoint",
            tags={CHECKPOINT_URL_TAG: url, JOB_TAG: job_id, MLFLOW_MODEL_IS_EXTERNAL: "true"},
            params={"step": str(step)})
    if model.status != LoggedModelStatus.READY:
        model = client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    outputs = run.outputs.model_outputs if run.outputs is not None else []
    if not any(o.model_id == model.model_id for o in outputs):
        client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step)])
    return str(model.model_id)


class TrackingReporter:
    """Queue the newest summary of each tracked job after every batch; send them from ``run``."""

    def __init__(self, observer: MetricsObserver | None = None, *, retry_max_s: float = 60.0,
                 refusal: Callable[[str], str | None] | None = None,
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.observer = observer
        self.refusal = refusal  # ``TrackingGate.refusal``: a summary for a server it refuses is never sent
        self.on_refused = on_refused  # counted once per job (reason)
        self.refused: set[str] = set()
        self.retry_max_s = retry_max_s
        self.pending: dict[str, Summary] = {}
        self.sent: dict[str, Summary] = {}
        self.seen: dict[str, _Seen] = {}
        self.failures = 0
        self._wake: anyio.Event | None = None  # made by run() (an event needs the running loop)

    def after_batch(self, before: State, decided: Decided, now: float) -> None:
        after = decided.state
        touched: set[str] = set()
        notice, gone = ev.PreemptionNotice, NodeGone
        for e in decided.seen:  # heartbeats are most of them: two type checks each
            if type(e) is not notice and type(e) is not gone:
                continue
            node = before.nodes.get(e.node_id)
            if node is None or node.job_id not in after.jobs:
                continue
            lost = ((isinstance(e, ev.PreemptionNotice) and e.kind == ev.NoticeKind.TERMINATE)
                    or (isinstance(e, NodeGone) and e.reason in _LOST_REASONS
                        and node.pool.market == ev.Market.SPOT and e.node_id not in after.nodes))
            if lost:
                self.seen.setdefault(node.job_id, _Seen()).preemptions += 1
                touched.add(node.job_id)
        for key in decided.dirty:
            if key.startswith("job."):
                touched.add(key[4:])
        for jid in touched:
            job = after.jobs.get(jid)
            if job is None or isinstance(job.tracking_run_id, msgspec.UnsetType):
                continue
            track = self.observer.jobs.get(jid) if self.observer is not None else None
            goodput = track.goodput(job_step(after, jid)) if track is not None else None
            s = summarize(after, job, self.seen.setdefault(jid, _Seen()), goodput, now)
            if s is not None and self._refused(s):
                continue
            if s is not None and not s.same_figures(self.pending.get(jid) or self.sent.get(jid)):
                self.pending[jid] = s
                if self._wake is not None:
                    self._wake.set()

    def _refused(self, s: Summary) -> bool:
        why = self.refusal(s.uri) if self.refusal is not None else None
        if why is None:
            return False
        if s.job_id not in self.refused:
            self.refused.add(s.job_id)
            log.warning("tracking_server_refused", job=s.job_id, reason=why,
                        hint="the job runs untracked: its server is not one of [tracking.servers]")
            if self.on_refused is not None:
                self.on_refused(why)
        return True

    async def run(self) -> None:
        """Send pending summaries, the newest of each job; back off while the server is unreachable."""
        delay = 1.0
        self._wake = anyio.Event()
        while True:
            if not self.pending:
                await self._wake.wait()
            self._wake = anyio.Event()
            while self.pending:
                jid, s = next(iter(self.pending.items()))
                try:
                    await anyio.to_thread.run_sync(send_summary, s, abandon_on_cancel=True)
                except Exception as e:  # an outage, a deleted run: retried later (after the other jobs'), never fatal
                    self.failures += 1
                    log.warning("tracking_summary_failed", job=jid, error=type(e).__name__, retry_s=delay)
                    if self.pending.get(jid) is s:
                        del self.pending[jid]
                        self.pending[jid] = s  # to the end of the line
                    await anyio.sleep(delay)
                    delay = min(delay * 2, self.retry_max_s)
                    continue
                delay = 1.0
                if self.pending.get(jid) is s:
                    del self.pending[jid]
                self.sent[jid] = s
                if s.status is not None:  # the job ended: nothing more to send for it
                    self.seen.pop(jid, None)


class LocalMlflowServer:
    """``mlflow server`` with a SQLite backend on loopback (the full ``mlflow`` package): for ``orchctl demo
    --tracking``, the benchmark and the tests. Not for production: run MLflow the way its docs say there."""

    def __init__(self, work_dir: Path, *, port: int = 0, host: str = "127.0.0.1") -> None:
        self.work_dir = work_dir
        self.host = host
        self.port = port or _free_port(host)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def uri(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 300.0) -> LocalMlflowServer:
        """Start it and wait until ``/health`` answers (an existing database is kept: a restart)."""
        if importlib.util.find_spec("mlflow.server") is None:
            raise RuntimeError("mlflow server needs the full mlflow package: pip install mlflow")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.work_dir / "server.log", "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", self.host, "--port", str(self.port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{self.work_dir / 'mlflow.db'}",
             "--default-artifact-root", (self.work_dir / "artifacts").as_uri()],
            stdout=log, stderr=log, start_new_session=True,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})  # no job runner processes
        log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.proc.returncode}: see {self.work_dir}/server.log")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mlflow server did not answer within {timeout_s:.0f} s")
            time.sleep(0.25)

    def stop(self) -> None:
        """Stop the server and its workers (its own process group)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
