"""Step metrics to the job's MLflow run, off the training step, each step exactly once.

Role: ``MetricsLogger`` is what ``trainer.lib.Session`` hands each step's metrics to (rank 0 only). The
training thread only appends to a bounded queue (``put``: no I/O, no waiting); a background thread sends
whole steps in batches (``log_batch``, at most 1000 values each) and retries with backoff while the
tracking server is unreachable. A full queue drops the newest step and counts it lost; so does a batch the
server refuses for good (4xx other than 429), and what is still queued when ``close`` runs out of time.

Exactly once (docs/tracking.md): every step's values are logged with a marker metric ``orch/step`` (value
= the step) in the same batch. Before sending anything, the thread reads the run's latest ``orch/step``
(``get_run``: MLflow keeps the latest value of each metric by step) and skips every step up to it: the
steps a resumed generation runs again after a vanished node, whose first values are already logged, log
nothing. A batch that is retried keeps its timestamps, so a retry after a lost reply adds no second point
(the server keeps one row per key, step, timestamp and value).

Which run: ``MLFLOW_RUN_ID`` (set by orchd once it created the run). A generation started before that
(a tracking outage at submit) finds the run by its ``orch.job_id`` tag in ``MLFLOW_EXPERIMENT_NAME``
(never creates one: orchd does), queueing meanwhile.

Torch-free; mlflow (``mlflow-skinny``, the ``tracking`` extra) is imported in the logger's thread (its import
takes seconds: never on the training thread); ``from_env`` fails fast with a clear message when a tracked
job's host lacks it. Concurrency contract: ``put`` and ``close`` are called by
the training thread only; everything else runs on the logger's own daemon thread.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

STEP_KEY: Final = "orch/step"
JOB_TAG: Final = "orch.job_id"
ENV_TRACKING: Final = "ORCH_TRACKING"
"""Set to ``mlflow`` by orchd for a job with ``[tracking]`` (with MLflow's own MLFLOW_TRACKING_URI,
MLFLOW_EXPERIMENT_NAME and, once known, MLFLOW_RUN_ID)."""
ENV_FLUSH_S: Final = "ORCH_TRACKING_FLUSH_S"
ENV_QUEUE_STEPS: Final = "ORCH_TRACKING_QUEUE_STEPS"
DEFAULT_FLUSH_S: Final = 5.0
DEFAULT_QUEUE_STEPS: Final = 100_000
MAX_BATCH_VALUES: Final = 1000  # MLflow's limit of metrics per log_batch
PACKAGE_HINT: Final = "pip install 'spot-orchestrator[tracking]' (the mlflow-skinny package)"
_HTTP_DEFAULTS: Final = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


class TrackingUnavailable(RuntimeError):
    """A tracked job on a host without the MLflow client."""


@dataclass(slots=True)
class Counts:
    logged: int = 0  # steps the server accepted
    skipped: int = 0  # steps already logged by an earlier generation
    lost: int = 0  # steps dropped: queue full, refused by the server, or unsent at close


_Record = tuple[int, int, dict[str, float]]  # (step, timestamp ms, metrics)


class MetricsLogger:
    def __init__(self, uri: str, *, run_id: str | None = None, experiment: str | None = None,
                 job_id: str | None = None, max_queue_steps: int = DEFAULT_QUEUE_STEPS, retry_max_s: float = 10.0,
                 batch_wait_s: float = 0.5, client_factory: Callable[[str], Any] | None = None) -> None:
        if not run_id and not (experiment and job_id):
            raise ValueError("MetricsLogger needs a run id, or an experiment and a job id to find the run by")
        self.uri = uri
        self.run_id = run_id or None
        self.experiment = experiment
        self.job_id = job_id
        self.retry_max_s = retry_max_s
        self.batch_wait_s = batch_wait_s
        self.counts = Counts()
        self.last_logged: int | None = None  # the run's latest logged step, once read
        self.failures = 0  # failed calls to the server (retried)
        self.healthy = True  # the last call to the server succeeded (or none was made yet)
        self._client_factory = client_factory or _mlflow_client
        self._q: queue.Queue[_Record | None] = queue.Queue(maxsize=max_queue_steps)
        self._held: list[_Record] = []  # taken from the queue, not yet accepted by the server
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlflow-metrics", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> MetricsLogger | None:
        """The logger of a tracked job (``ORCH_TRACKING=mlflow``), None for an untracked one. Raises
        ``TrackingUnavailable`` when the job is tracked but the mlflow client is not installed."""
        env = os.environ if env is None else env
        if env.get(ENV_TRACKING) != "mlflow" or not env.get("MLFLOW_TRACKING_URI"):
            return None
        if importlib.util.find_spec("mlflow") is None:  # fail here, clearly (the import itself is the thread's)
            raise TrackingUnavailable(f"this job asks for MLflow tracking but the trainer's host lacks the mlflow "
                                      f"client: {PACKAGE_HINT}")
        return cls(env["MLFLOW_TRACKING_URI"], run_id=env.get("MLFLOW_RUN_ID") or None,
                   experiment=env.get("MLFLOW_EXPERIMENT_NAME") or None, job_id=env.get("ORCH_JOB_ID") or None,
                   max_queue_steps=int(env.get(ENV_QUEUE_STEPS) or DEFAULT_QUEUE_STEPS))

    # --- the training thread ----------------------------------------------------------------------------

    def put(self, step: int, metrics: Mapping[str, float]) -> None:
        """Hand one step's metrics over (never blocks; a full queue counts the step lost)."""
        try:
            self._q.put_nowait((step, int(time.time() * 1000), dict(metrics)))
        except queue.Full:
            self.counts.lost += 1

    def close(self, timeout_s: float = DEFAULT_FLUSH_S) -> Counts:
        """Send what is queued for at most ``timeout_s`` (0.5 s while the server is failing: an outage never
        holds a generation's end); what is left is counted lost."""
        self._closing.set()
        with contextlib.suppress(queue.Full):
            self._q.put_nowait(None)  # wake the thread
        self._thread.join(max(0.0, timeout_s if self.healthy else min(timeout_s, 0.5)))
        if self._thread.is_alive():
            left = len(self._held) + sum(1 for r in list(self._q.queue) if r is not None)
            self.counts.lost += left
        return self.counts

    # --- the logger's thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        client = None
        delay = 0.2
        while True:
            try:
                if client is None:
                    client = self._client_factory(self.uri)
                if self.run_id is None:
                    self.run_id = self._find_run(client)
                    if self.run_id is None:  # orchd has not created it yet
                        raise LookupError("run not created yet")
                if self.last_logged is None:
                    self.last_logged = _last_step(client, self.run_id)
                if not self._send_held(client):
                    return  # closing and nothing left
                self.healthy = True
                delay = 0.2
            except Exception as e:  # an outage, a run not yet there: retry (the queue keeps filling)
                self.failures += 1
                self.healthy = False
                if _permanent(e) and self.last_logged is not None and self._held:
                    self.counts.lost += len(self._held)  # refused for good: never block the steps behind it
                    self._held = []
                    continue
                if self._closing.wait(delay):
                    if self._nothing_left():
                        return
                    time.sleep(min(delay, 0.5))  # closing: keep trying until close() stops waiting, not in a spin
                delay = min(delay * 2, self.retry_max_s)

    def _nothing_left(self) -> bool:
        return not self._held and all(r is None for r in list(self._q.queue))

    def _send_held(self, client: Any) -> bool:
        """Take whole steps up to the batch limit, skip those already logged, send. False: closed and done."""
        if not self._held:
            self._fill()
            if not self._held:
                return not self._closing.is_set()
        from mlflow.entities import Metric

        metrics: list[Any] = []
        for step, ts, values in self._held:
            metrics += [Metric(k, v, ts, step) for k, v in values.items()]
            metrics.append(Metric(STEP_KEY, float(step), ts, step))  # last: the step is complete
        client.log_batch(self.run_id, metrics=metrics)
        self.counts.logged += len(self._held)
        self.last_logged = self._held[-1][0]
        self._held = []
        return True

    def _fill(self) -> None:
        """Move queued steps (newer than the last logged one) into ``_held``, up to MAX_BATCH_VALUES values,
        collecting for at most ``batch_wait_s`` (none once closing)."""
        n = 0
        deadline = time.monotonic() + self.batch_wait_s
        assert self.last_logged is not None
        while n < MAX_BATCH_VALUES:
            wait = 0.0 if self._closing.is_set() else deadline - time.monotonic()
            try:
                rec = self._q.get(timeout=wait) if wait > 0 else self._q.get_nowait()
            except queue.Empty:
                return
            if rec is None:
                continue  # close()'s wake-up
            step, ts, values = rec
            if step <= self.last_logged or (self._held and step <= self._held[-1][0]):
                self.counts.skipped += 1
                continue
            clean = {k: float(v) for k, v in values.items() if _finite(v)}
            if self._held and n + len(clean) + 1 > MAX_BATCH_VALUES:
                self._requeue_front(rec)  # the next batch's first step
                return
            self._held.append((step, ts, clean))
            n += len(clean) + 1

    def _requeue_front(self, rec: _Record) -> None:
        with self._q.mutex:
            self._q.queue.appendleft(rec)
            self._q.unfinished_tasks += 1
            self._q.not_empty.notify()

    def _find_run(self, client: Any) -> str | None:
        exp = client.get_experiment_by_name(self.experiment)
        if exp is None or self.job_id is None or "'" in self.job_id:
            return None
        runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`{JOB_TAG}` = '{self.job_id}'",
                                  max_results=1)
        return str(runs[0].info.run_id) if runs else None


def _mlflow_client(uri: str) -> Any:
    for key, value in _HTTP_DEFAULTS.items():  # retries are ours; MLflow's own would block for minutes
        os.environ.setdefault(key, value)
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _last_step(client: Any, run_id: str) -> int:
    """The run's latest logged step (0 when none): MLflow keeps each metric's value at its highest step."""
    value = client.get_run(run_id).data.metrics.get(STEP_KEY)
    return int(value) if value is not None else 0


def _finite(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _permanent(e: Exception) -> bool:
    """A refusal that retrying cannot fix (a 4xx other than 429)."""
    status = getattr(e, "get_http_status_code", None)
    if status is None:
        return False
    try:
        code = int(status())
    except (TypeError, ValueError):
        return False
    return 400 <= code < 500 and code != 429
