"""MLflow tracking with a real ``mlflow server`` (SQLite backend, on loopback, started here).

- the trainer's logger (trainer/tracking.py) across generations: a resumed generation's re-run steps log
  nothing, each step is in the run once and in order; a tracking outage (the connection to the server cut by
  a proxy) never blocks the hand-over, and the metrics arrive when it is back;
- orchd creates one run per job, idempotently (a re-executed command finds the run it created);
- the final checkpoint is the run's output: one external LoggedModel (READY, its URL a tag) logged with
  ``log_outputs``, once however often the end is sent, also after a crash between the model and the output;
- the whole loop: orchd (subprocess) with local nodes runs a tracked job of a trainer-library script; a node
  vanishes (kill) and another is preempted with a notice mid-run; MLflow holds every step once and in order,
  and orchd's own tags and figures, the final checkpoint and the run's end.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from orchestrator.core.commands import CreateTrackingRun
from orchestrator.daemon.tracking import (
    CHECKPOINT_URL_TAG,
    LocalMlflowServer,
    Summary,
    create_run,
    log_final_checkpoint,
    send_summary,
)
from tests.conftest import IN_CI
from tests.integration.local_orchd import LocalOrchd, wait_until
from trainer.tracking import STEP_KEY, MetricsLogger

if not IN_CI:  # in CI (ORCH_CI=1) a missing mlflow fails the collection instead
    pytest.importorskip("mlflow.server", reason="the tracking tests need the full mlflow package (the dev extra)")
from mlflow.entities import LoggedModelStatus  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

TRAINER = Path(__file__).with_name("tracked_trainer.py")
TOTAL = 400  # steps of the tracked job (0.1 s each): long enough for two faults mid-run


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMlflowServer]:
    s = LocalMlflowServer(tmp_path_factory.mktemp("mlflow")).start()
    yield s
    s.stop()


class Proxy:
    """A TCP forwarder to the server that can be cut (``down``: listener and connections closed) and restored."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._lsock: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self.up()

    def up(self) -> None:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", self.port))
        ls.listen(16)
        self._lsock = ls
        threading.Thread(target=self._accept, args=(ls,), daemon=True).start()

    def down(self) -> None:
        assert self._lsock is not None
        with contextlib.suppress(OSError):
            self._lsock.shutdown(socket.SHUT_RDWR)
        self._lsock.close()
        for c in self._conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()
        self._conns.clear()

    def _accept(self, ls: socket.socket) -> None:
        while True:
            try:
                client, _ = ls.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


def _points(client: Any, run_id: str, key: str) -> list[tuple[int, float, int]]:
    """(step, value, timestamp) of every point of ``key``, in the order the server stored them."""
    return [(m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, key)]


def _assert_once_in_order(points: list[tuple[int, float, int]], steps: range) -> None:
    assert sorted(p[0] for p in points) == list(steps), "each step exactly once"
    by_time = [p[0] for p in sorted(points, key=lambda p: (p[2], p[0]))]
    assert by_time == list(steps), "logged in step order"


def test_logger_exactly_once_across_generations_and_through_an_outage(mlflow_server: LocalMlflowServer) -> None:
    cmd = CreateTrackingRun(job_id="j-log", uri=mlflow_server.uri, experiment="logger", run_name="r")
    run_id = create_run(cmd)
    assert create_run(cmd) == run_id  # re-executed after a crash: the same run, never a second one
    client = MlflowClient(mlflow_server.uri)

    # generation 1 logs steps 1..30 (its checkpoint is at 20), then its node vanishes
    gen1 = MetricsLogger(mlflow_server.uri, run_id=run_id, batch_wait_s=0.1)
    for step in range(1, 31):
        gen1.put(step, {"loss": 1.0, "generation": 1.0})
    c1 = gen1.close(60)
    assert (c1.logged, c1.skipped, c1.lost) == (30, 0, 0)

    # generation 2 resumes at 21 without the run id (found by the job's tag): 21..30 are re-runs, never logged
    gen2 = MetricsLogger(mlflow_server.uri, experiment="logger", job_id="j-log", batch_wait_s=0.1)
    for step in range(21, 61):
        gen2.put(step, {"loss": 2.0, "generation": 2.0})
    c2 = gen2.close(60)
    assert (c2.logged, c2.skipped, c2.lost) == (30, 10, 0)

    # generation 3 starts while the server is unreachable: the hand-over goes on, nothing is sent yet
    proxy = Proxy(mlflow_server.port)
    proxy.down()
    gen3 = MetricsLogger(f"http://127.0.0.1:{proxy.port}", run_id=run_id, batch_wait_s=0.1, retry_max_s=0.5)
    for step in range(61, 261):
        gen3.put(step, {"loss": 3.0, "generation": 3.0})
    time.sleep(1.0)
    assert gen3.counts.logged == 0 and gen3.failures >= 1 and gen3.counts.lost == 0
    proxy.up()  # the server is back: the queued steps arrive, without waiting for close()
    wait_until(lambda: gen3.counts.logged == 200, 120, "the queued steps to arrive", every_s=0.2)
    c3 = gen3.close(5)
    assert (c3.logged, c3.skipped, c3.lost) == (200, 0, 0)
    proxy.down()

    loss = _points(client, run_id, "loss")
    _assert_once_in_order(loss, range(1, 261))
    _assert_once_in_order(_points(client, run_id, STEP_KEY), range(1, 261))
    values = {s: v for s, v, _ in _points(client, run_id, "generation")}
    assert [values[s] for s in (1, 20, 30, 31, 60, 61, 260)] == [1.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]  # first final


def test_full_queue_counts_lost_steps_never_blocks(mlflow_server: LocalMlflowServer) -> None:
    proxy = Proxy(mlflow_server.port)
    proxy.down()
    run_id = create_run(CreateTrackingRun(job_id="j-full", uri=mlflow_server.uri, experiment="logger", run_name="f"))
    lg = MetricsLogger(f"http://127.0.0.1:{proxy.port}", run_id=run_id, max_queue_steps=10, retry_max_s=0.2)
    for step in range(1, 101):
        lg.put(step, {"loss": 1.0})
    c = lg.close(1.0)
    assert c.logged == 0 and c.lost == 100  # 90 over the bound, 10 unsent at close


# --- the whole loop -------------------------------------------------------------------------------------


def _tracked_job(tmp: Path, uri: str, trace: Path) -> Path:
    path = tmp / "job.toml"
    path.write_text(f"""
name = "tracked"
total_steps = {TOTAL}
gpu_type = "cpu"
gpus_per_node = 1
nodes = 1
clouds = ["local"]
market = "spot_with_fallback"
[checkpoint]
url = "file://{tmp / 'ckpt'}"
interval_s = 2
[trainer]
command = ["{sys.executable}", "{TRAINER}"]
args = {{ step_time_s = 0.1, trace = "{trace}" }}
[tracking]
server = "e2e"
experiment = "e2e"
""")
    return path


def _job(orchd: LocalOrchd) -> dict[str, Any]:
    return orchd.ctl_json("jobs", "show", "jt")["summary"]


def _running_node(orchd: LocalOrchd, after_generation: int) -> str | None:
    nodes = orchd.ctl_json("nodes", "list", "--job", "jt")["nodes"]
    ids = [n["node_id"] for n in nodes if n["phase"] == "running" and n["generation"] > after_generation]
    return ids[0] if ids else None


def _last_logged(client: Any, run_id: str) -> int:
    return int(client.get_run(run_id).data.metrics.get(STEP_KEY, 0))


@pytest.mark.slow
@pytest.mark.anyio
async def test_tracked_job_vanished_and_preempted_nodes_each_step_once(
        server: Any, tmp_path: Path, mlflow_server: LocalMlflowServer) -> None:
    orchd = LocalOrchd(tmp_path, server.url, extra=f'[tracking.servers.e2e]\nuri = "{mlflow_server.uri}"\n')
    await anyio.to_thread.run_sync(orchd.start)
    try:
        await anyio.to_thread.run_sync(lambda: _run_tracked(orchd, tmp_path, mlflow_server.uri))
    finally:
        await anyio.to_thread.run_sync(orchd.stop)
        await anyio.to_thread.run_sync(orchd.kill_all)


def _run_tracked(orchd: LocalOrchd, tmp: Path, uri: str) -> None:
    trace = tmp / "steps.txt"
    code, out, err = orchd.ctl("jobs", "submit", str(_tracked_job(tmp, uri, trace)), "--id", "jt")
    assert code == 0, (out, err)
    client = MlflowClient(uri)
    run_id = wait_until(lambda: orchd.ctl_json("jobs", "show", "jt")["job"].get("tracking_run_id"), 60,
                        "orchd to create the run")

    # a node vanishes (no notice) once steps after the last periodic checkpoint are logged: they run again
    node = wait_until(lambda: _running_node(orchd, 0), 90, "generation 1 training")
    wait_until(lambda: _last_logged(client, run_id) > _job(orchd)["committed_step"] + 2 > 2, 240,
               "steps logged past a committed checkpoint")
    code, out, err = orchd.ctl("nodes", "kill", node)
    assert code == 0, (out, err)

    # a preemption with a notice in a later generation: emergency checkpoint, queued metrics flushed at exit
    node = wait_until(lambda: _running_node(orchd, 1), 120, "a generation after the kill")
    gen = _job(orchd)["generation"]
    wait_until(lambda: _last_logged(client, run_id) > _job(orchd)["committed_step"] + 2, 90, "training again", 1.0)
    code, out, err = orchd.ctl("nodes", "preempt", node, "--notice", "5")
    assert code == 0, (out, err)
    wait_until(lambda: _running_node(orchd, gen), 120, "a generation after the preemption")
    wait_until(lambda: _job(orchd)["phase"] == "succeeded", 180, "the job to finish")

    # the trace: the steps each generation executed; a re-run happened (else this test proves nothing)
    ran: dict[int, list[int]] = {}
    pairs = [tuple(map(int, ln.split())) for ln in trace.read_text().splitlines() if ln.strip()]
    for g, s in pairs:
        ran.setdefault(s, []).append(g)
    assert sorted(ran) == list(range(1, TOTAL + 1))
    assert any(len(gs) > 1 for gs in ran.values()), "no step ran twice: the kill did not force a re-run"

    # MLflow: each step once, in order; each step's value from the first generation that logged it
    _assert_once_in_order(_points(client, run_id, "loss"), range(1, TOTAL + 1))
    _assert_once_in_order(_points(client, run_id, STEP_KEY), range(1, TOTAL + 1))
    logged_gen = {s: int(v) for s, v, _ in _points(client, run_id, "generation")}
    assert all(logged_gen[s] in ran[s] for s in ran)
    assert [logged_gen[s] for s in range(1, TOTAL + 1)] == sorted(logged_gen.values())  # generations in order

    # orchd's figures, the final checkpoint and the run's end
    def ended() -> Any:
        run = client.get_run(run_id)
        return run if run.info.status == "FINISHED" and "orch.final_checkpoint" in run.data.tags else None

    run = wait_until(ended, 60, "orchd's final summary")
    tags, metrics = run.data.tags, run.data.metrics
    job = _job(orchd)
    assert tags["orch.job_id"] == "jt" and tags["orch.phase"] == "succeeded"
    assert int(tags["orch.generations"]) == job["generation"] >= 3
    assert int(tags["orch.preemptions"]) >= 2 and metrics["orchd/preemptions"] >= 2
    assert tags["orch.final_checkpoint"].endswith(f"step_{TOTAL:09d}") and tags["orch.pools"].startswith("local/")
    assert metrics["orchd/committed_step"] == TOTAL and metrics["orchd/cost_usd"] >= 0
    (out,) = run.outputs.model_outputs  # the final checkpoint is the run's output (an external model)
    model = client.get_logged_model(out.model_id)
    assert out.step == TOTAL and model.tags[CHECKPOINT_URL_TAG] == tags["orch.final_checkpoint"]


def test_final_checkpoint_is_the_runs_output_once(mlflow_server: LocalMlflowServer) -> None:
    uri = mlflow_server.uri
    client = MlflowClient(tracking_uri=uri)
    run_id = create_run(CreateTrackingRun(job_id="jo", uri=uri, experiment="outputs", run_name="jo"))
    url = "s3://bucket/ckpt/jo/step_000000120"
    end = Summary(uri=uri, run_id=run_id, step=120, ts_ms=int(time.time() * 1000),
                  tags=(("orch.final_checkpoint", url),), metrics=(), status="FINISHED", job_id="jo",
                  final_checkpoint=url, final_step=120)
    send_summary(end)
    send_summary(end)  # sent again (a retry after a lost reply, a new leader): nothing more
    run = client.get_run(run_id)
    (out,) = run.outputs.model_outputs
    model = client.get_logged_model(out.model_id)
    assert out.step == 120 and model.source_run_id == run_id and model.status == LoggedModelStatus.READY
    assert model.tags[CHECKPOINT_URL_TAG] == url and model.tags["mlflow.model.isExternal"] == "true"
    assert model.tags["orch.job_id"] == "jo" and model.params == {"step": "120"}
    assert run.data.tags["orch.final_checkpoint"] == url and run.info.status == "FINISHED"  # the tag stays

    # a crash after the model was created, before it was finalized and logged: the next send reuses it
    run2 = create_run(CreateTrackingRun(job_id="jp", uri=uri, experiment="outputs", run_name="jp"))
    pending = client.create_logged_model(run.info.experiment_id, name="final_checkpoint", source_run_id=run2,
                                         tags={CHECKPOINT_URL_TAG: url + "x"})
    assert log_final_checkpoint(client, run2, "jp", url + "x", 7) == pending.model_id
    assert log_final_checkpoint(client, run2, "jp", url + "x", 7) == pending.model_id
    (out2,) = client.get_run(run2).outputs.model_outputs
    assert out2.model_id == pending.model_id
    assert client.get_logged_model(pending.model_id).status == LoggedModelStatus.READY
    found = client.search_logged_models(experiment_ids=[run.info.experiment_id],
                                        filter_string=f"source_run_id = '{run2}'")
    assert len(found) == 1


def test_the_run_lookup_never_adopts_another_clusters_run(mlflow_server: LocalMlflowServer) -> None:
    """Two clusters on one tracking server, a job of the same id on each: each gets its own run; each finds
    its own again after a crash (the lookup filters by the job and the cluster)."""
    cmd = CreateTrackingRun(job_id="shared-id", uri=mlflow_server.uri, experiment="clusters", run_name="s")
    theirs = create_run(cmd, "orch-other-cluster")
    ours = create_run(cmd, "orch-this-cluster")
    assert ours != theirs
    assert create_run(cmd, "orch-this-cluster") == ours and create_run(cmd, "orch-other-cluster") == theirs
    tags = MlflowClient(mlflow_server.uri).get_run(ours).data.tags
    assert tags["orch.cluster"] == "orch-this-cluster" and tags["orch.job_id"] == "shared-id"
