"""``orchctl demo --tracking``: the demo's job tracked in MLflow (docs/tracking.md).

Role: start a local ``mlflow server`` under the demo's state directory (SQLite; the full ``mlflow`` package),
or use the server ``--tracking-uri`` names; add ``[tracking]`` to the demo's job; at the end, say what the
job's run holds (step points, distinct steps, order, status, orchd's tags) and how to open the MLflow UI on it.

Concurrency contract: ``Tracked.start``/``stop``/``report`` block (the demo runs them in worker threads).
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

EXPERIMENT = "orch-demo"


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def refuse_without_package(tracking: str) -> bool:
    """True (and why, on stderr) when ``--tracking`` (a local server: the full mlflow) or ``--tracking-uri``
    (the client) cannot run here."""
    if not tracking or importable("mlflow.server" if tracking == "local" else "mlflow"):
        return False
    sys.stderr.write("orchctl demo --tracking needs MLflow: pip install mlflow (the server, for --tracking) or "
                     "pip install 'spot-orchestrator[tracking]' (the client, for --tracking-uri)\n")
    return True


def add_arguments(s: Any) -> None:
    s.add_argument("--tracking", action="store_true",
                   help="track the job in MLflow: a local mlflow server under the state directory (needs mlflow)")
    s.add_argument("--tracking-uri", default=None, help="track the job in this MLflow server instead")


class Tracked:
    """The demo's tracking: nothing when ``tracking`` is ""; "local" runs a server; else a URI to log to."""

    def __init__(self, tracking: str, state_dir: Path) -> None:
        self.tracking = tracking
        self.state_dir = state_dir
        self.uri = "" if tracking == "local" else tracking
        self.server: Any = None

    def start(self, spec: Any) -> Any:
        """The demo's job spec, with ``[tracking]`` when asked (after starting the local server)."""
        if not self.tracking:
            return spec
        if self.tracking == "local":
            from orchestrator.daemon.tracking import LocalMlflowServer

            self.server = LocalMlflowServer(self.state_dir / "mlflow").start()
            self.uri = self.server.uri
        import msgspec

        from wire import TrackingSpec

        return msgspec.structs.replace(spec, tracking=TrackingSpec(uri=self.uri, experiment=EXPERIMENT))

    def settings(self, settings: Any) -> Any:
        """orchd's settings with the demo's tracking server listed as its default ([tracking.servers]): the
        only server orchd sends its MLflow credentials to (none over plain http)."""
        if not self.tracking:
            return settings
        import dataclasses

        from orchestrator.settings import TrackingServer, TrackingSettings

        return dataclasses.replace(settings, tracking=TrackingSettings(
            servers={"demo": TrackingServer(uri=self.uri)}, default="demo"))

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def report(self, job_id: str, wait_s: float = 30.0) -> dict[str, Any]:
        """``{"tracking": ...}``: what the job's run holds at the end ({} without tracking). orchd's final
        summary may take a moment to arrive."""
        if not self.tracking:
            return {}
        from mlflow.tracking import MlflowClient

        out: dict[str, Any] = {"uri": self.uri, "experiment": EXPERIMENT, "run_id": None}
        if self.server is not None:
            db = self.state_dir / "mlflow" / "mlflow.db"
            out["ui"] = f"mlflow ui --backend-store-uri sqlite:///{db} --port 5000"
        client = MlflowClient(self.uri)
        exp = client.get_experiment_by_name(EXPERIMENT)
        runs = [] if exp is None else client.search_runs(
            [exp.experiment_id], filter_string=f"tags.`orch.job_id` = '{job_id}'",
            order_by=["attributes.start_time DESC"], max_results=1)
        if not runs:
            return {"tracking": out}
        run_id = out["run_id"] = runs[0].info.run_id
        deadline = time.time() + wait_s
        while (run := client.get_run(run_id)).info.status == "RUNNING" and time.time() < deadline:
            time.sleep(1.0)
        steps = [m.step for m in client.get_metric_history(run_id, "orch/step")]
        out.update(status=run.info.status, steps_logged=len(steps), steps_distinct=len(set(steps)),
                   steps_in_order=steps == sorted(steps),
                   tags={k: v for k, v in run.data.tags.items() if k.startswith("orch.")})
        return {"tracking": out}


def format_lines(t: dict[str, Any] | None) -> list[str]:
    if not t:
        return []
    lines = [f"MLflow run {t.get('run_id')} ({t['uri']}, experiment {t['experiment']}): {t.get('steps_logged')} "
             f"step points, {t.get('steps_distinct')} distinct steps, in order: {t.get('steps_in_order')}; "
             f"status {t.get('status')}"]
    if t.get("ui"):
        lines.append(f"  open it: {t['ui']}  (then http://127.0.0.1:5000)")
    return lines
