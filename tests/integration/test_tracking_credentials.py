"""orchd's MLflow credentials go only to the tracking servers its config lists.

A loopback HTTP server stands in for an attacker's host; orchd (in this process, the real core, on a real
nats-server) runs with canary credentials in its environment. A spec that names the attacker's URI is
refused at submit; a job stored before the list (its spec carries the URI, its run-creation command is in
the outbox, it even has a run id) runs untracked: the attacker gets no request at all, its trainer no
MLflow variables; the refusals are counted. A listed plain-http server gets the credentials only when its
entry allows it.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec
import nats
import pytest

import wire as ev
from orchestrator import bus, core
from orchestrator.core.inputs import JobSubmitted
from orchestrator.daemon.records import encode_command, outbox_key
from orchestrator.daemon.run import run_daemon
from orchestrator.daemon.tracking import TrackingGate
from orchestrator.settings import TrackingServer, TrackingSettings
from simulations.fakecloud import FakeCloud
from tests.integration import helpers as h

CANARY_USER, CANARY_PASSWORD = "canary-user-4821", "canary-password-7730"


class Attacker:
    """An HTTP server that records every request (path and Authorization header) and answers 404."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        seen = self.requests

        class Handler(http.server.BaseHTTPRequestHandler):
            def _any(self) -> None:
                seen.append((self.path, self.headers.get("Authorization", "")))
                self.send_response(404)
                self.end_headers()

            do_GET = do_POST = do_PATCH = do_DELETE = _any  # noqa: N815

            def log_message(self, *_a: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.uri = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()


@pytest.fixture
def attacker() -> Iterator[Attacker]:
    a = Attacker()
    yield a
    a.close()


@pytest.fixture
def canary_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", CANARY_USER)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", CANARY_PASSWORD)


def _stored_tracked_job(uri: str) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """The records and outbox an older orchd wrote for a job tracked at ``uri``, its run already created."""
    spec = msgspec.structs.replace(h_spec(), tracking=ev.TrackingSpec(uri=uri, experiment="loot"))
    d = core.decide(core.State.empty(), JobSubmitted(job_id=ev.JobId("old-tracked"), spec=spec), time.time())
    job = msgspec.structs.replace(d.state.jobs["old-tracked"], tracking_run_id="run-of-an-older-orchd")
    state = msgspec.structs.replace(d.state, jobs=d.state.jobs.set("old-tracked", job))
    records = core.state_to_records(state, core.records.all_keys(state))
    outbox = {outbox_key(c): encode_command(c) for c in d.commands if type(c).__name__ == "CreateTrackingRun"}
    assert outbox, "the submit decided a run-creation command"
    return records, outbox


def h_spec() -> ev.JobSpec:
    return ev.JobSpec(name="old-tracked", total_steps=1000, gpu_type="A100", gpus_per_node=1, nodes=1,
                      clouds=("fake",), checkpoint=ev.CheckpointPolicy(url="file:///tmp/orch-cred-ckpt"))


@pytest.mark.anyio
async def test_credentials_never_reach_an_unlisted_server(server, tmp_path: Path, attacker: Attacker,
                                                          canary_env: None) -> None:
    nc = await nats.connect(server.url)
    js = nc.jetstream()
    topo = await bus.ensure_topology(nc)
    records, outbox = _stored_tracked_job(attacker.uri)
    for key, value in records.items():
        await topo.state_kv.put(key, value)
    for key, value in outbox.items():
        await topo.outbox_kv.put(key, value)
    agent = await h.SimAgent(nc).start()
    settings = h.settings_for(tmp_path, server.url)
    cloud = FakeCloud()
    async with anyio.create_task_group() as tg:
        d = await tg.start(lambda task_status: run_daemon(settings, {"fake": cloud}, task_status=task_status))
        await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL, 1.0, 3.0))
        spec = tmp_path / "job.toml"
        spec.write_text(h.JOB_TOML.format(nodes=1) + f'[tracking]\nuri = "{attacker.uri}"\nexperiment = "x"\n')
        code, _out, err = await h.actl(server.url, "jobs", "submit", str(spec), "--id", "new-tracked")
        assert code == 2 or code == 1, err
        assert "tracking.uri" in err and "by name" in err
        # the stored job launches and starts: its trainer gets no MLflow variables
        await h.wait_for(lambda: cloud.all_instances(), timeout=15)
        inst = cloud.all_instances()[0]
        await h.publish_js(js, ev.subject_node_event(inst.node_id), ev.NodeRegistered(
            id="reg-1", node_id=inst.node_id, instance_id=inst.instance_id, pool=inst.pool, host="127.0.0.1",
            ts=time.time()))
        start = await h.wait_for(lambda: agent.of_kind(ev.StartGenerationCmd), timeout=15)
        assert not [k for k in start[0].trainer.env if k.startswith("MLFLOW_")], start[0].trainer.env
        await h.wait_for(lambda: _rejected(d, "tracking"), timeout=15)
        await anyio.sleep(1.0)  # time for a reporter's summary and a retried run creation to have gone out
        d.request_stop()
    await nc.close()
    assert attacker.requests == []  # not one request, so no credential
    assert d.state.jobs["old-tracked"].phase in ("starting", "running")


def _rejected(d, kind: str) -> float:
    return sum(s.value for m in d.metrics.registry.collect() for s in m.samples
               if s.name == "orchd_messages_rejected_total" and s.labels.get("kind") == kind)


def test_a_listed_plain_http_server_gets_credentials_only_when_its_entry_allows_it() -> None:
    env = {"MLFLOW_TRACKING_USERNAME": CANARY_USER, "MLFLOW_TRACKING_PASSWORD": CANARY_PASSWORD}
    plain = TrackingSettings(servers={"lab": TrackingServer(uri="http://mlflow.lab:5000/")}, default="lab")
    assert TrackingGate(plain, env).refusal("http://mlflow.lab:5000") == "plain_http_credentials"
    assert TrackingGate(plain, {}).refusal("http://mlflow.lab:5000") is None  # no credentials to leak
    allowed = TrackingSettings(servers={"lab": TrackingServer(uri="http://mlflow.lab:5000",
                                                              plain_http_credentials=True)})
    assert TrackingGate(allowed, env).refusal("http://mlflow.lab:5000") is None
    tls = TrackingSettings(servers={"prod": TrackingServer(uri="https://mlflow.example.com")}, default="prod")
    gate = TrackingGate(tls, env)
    assert gate.refusal("https://mlflow.example.com") is None
    assert gate.refusal("https://mlflow.example.com.attacker.net") == "server_not_listed"
    spec = msgspec.structs.replace(h_spec(), tracking=ev.TrackingSpec(experiment="e"))
    resolved, problems = gate.resolve(spec)
    assert problems == [] and resolved.tracking.uri == "https://mlflow.example.com"
    assert resolved.tracking.server == "prod"
    named = msgspec.structs.replace(spec, tracking=ev.TrackingSpec(experiment="e", server="nope"))
    assert "not a tracking server of this orchd (known: prod)" in gate.resolve(named)[1][0]
    listed_uri = msgspec.structs.replace(spec, tracking=ev.TrackingSpec(experiment="e", uri="https://mlflow.example.com/"))
    assert gate.resolve(listed_uri)[1] == []
    none = TrackingGate(TrackingSettings(), env)
    assert "no tracking.default" in none.resolve(spec)[1][0]
    assert json.dumps(gate.resolve(spec)[0].tracking.uri)  # a plain string, stored with the spec
