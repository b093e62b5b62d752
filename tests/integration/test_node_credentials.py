"""Per-node NATS credentials end to end against a real nats-server with the rendered secure config.

Executor (with ``NodeCredentials``) launches on a FakeCloud -> the enrolment token is in the launch's
bootstrap and its user data -> a real ``Agent`` redeems it over NATS (enrol user, ``orch.enrol.<node>``)
for its own credential and heartbeats with it -> that credential cannot publish for another node, the
token cannot be used twice -> Terminate -> NodeGone -> the credential is revoked (live connection
closed, new connects refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import stat
import time
from pathlib import Path

import anyio
import nats
import pytest
from nats.errors import NoServersError

import wire as ev
from agent.config import AgentConfig
from agent.main import Agent
from orchestrator.core.commands import Launch, Terminate
from orchestrator.core.inputs import NodeGone, NodeLaunched
from orchestrator.daemon.executor import Executor
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.records import Result
from orchestrator.natsserver import NatsServer
from orchestrator.security.credentials import EnrollingIssuer, NodeCredentials, enrol_user
from orchestrator.security.nats_auth import (
    User,
    hash_password,
    node_user,
    orchd_permissions,
    render_server_config,
    signal_reload,
)
from orchestrator.settings import Settings
from providers.base import LaunchRequest
from providers.bootstrap import render_user_data
from simulations.fakecloud import FakeCloud

pytestmark = pytest.mark.anyio

ORCHD_PW = "orchd-test-password"
POOL = ev.PoolKey(cloud="fake", region="r1", zone="r1a", instance_type="gpu.x1", market=ev.Market.SPOT)


class RecordingCloud(FakeCloud):
    def __init__(self) -> None:
        super().__init__("fake")
        self.requests: list[LaunchRequest] = []

    def launch(self, request: LaunchRequest):  # type: ignore[override]
        self.requests.append(request)
        return super().launch(request)


class Server:
    """nats-server with render_server_config + the issuer's users include; reload = SIGHUP, awaited."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.server: NatsServer | None = None
        self.issuer = EnrollingIssuer(
            root / "auth.conf", reload=self.reload,
            static_users=[User(name="orchd", password_hash=hash_password(ORCHD_PW), permissions=orchd_permissions())])

    def reload(self) -> None:
        if self.server is None or self.server.proc is None:
            return
        before = self._reloads()
        signal_reload(self.server.proc.pid)
        deadline = time.monotonic() + 5
        while self._reloads() <= before:
            assert time.monotonic() < deadline, "nats-server did not reload"
            time.sleep(0.02)

    def _reloads(self) -> int:
        try:
            return self.server.log_path.read_text().count("Reloaded server configuration")
        except FileNotFoundError:
            return 0


@pytest.fixture
def secured(tmp_path: Path):
    s = Server(tmp_path)
    (tmp_path / "auth.conf").write_text(s.issuer.render())
    (tmp_path / "server.conf").write_text(render_server_config(host="127.0.0.1", port=-1, store_dir=None,
                                                               http_port=None, server_name="orch-embedded"))
    s.server = NatsServer(tmp_path / "srv", config_file=str(tmp_path / "server.conf")).start()
    yield s
    s.server.cleanup()


class Errors(list):
    """The client's errors as text (nats-py wants a coroutine function as error_cb)."""

    @property
    def cb(self):
        async def on_error(e: Exception) -> None:
            self.append(str(e))

        return on_error


async def _connect(url: str, user: str, password: str, inbox_prefix: str, errors: Errors) -> nats.NATS:
    return await nats.connect(url, user=user, password=password, inbox_prefix=inbox_prefix, error_cb=errors.cb,
                              allow_reconnect=False, max_reconnect_attempts=1, connect_timeout=2)


async def _wait_for(cond, timeout_s: float = 5.0) -> None:
    with anyio.fail_after(timeout_s):
        while not cond():
            await anyio.sleep(0.02)


def _user_data_env(script: str) -> dict[str, str]:
    body = script.split("<<'ORCH_ENV_EOF'\n", 1)[1].split("\nORCH_ENV_EOF", 1)[0]
    return dict(kv.split("=", 1) for kv in shlex.split(body))


async def test_node_credential_lifecycle_through_the_executor(secured: Server, tmp_path: Path) -> None:
    url = secured.server.url
    orchd_errors = Errors()
    orchd = await nats.connect(url, user="orchd", password=ORCHD_PW, error_cb=orchd_errors.cb, connect_timeout=2)
    creds = NodeCredentials(secured.issuer)
    enrol_sub = await creds.serve(orchd)
    hbs: asyncio.Queue = asyncio.Queue()
    await orchd.subscribe("orch.node.*.hb", cb=hbs.put)
    await orchd.flush()
    cloud = RecordingCloud()
    results: list[Result] = []
    executor = Executor(Settings(), {"fake": cloud}, orchd, results.append, Metrics(), nats_urls=(url,),
                        credentials=creds)
    launch = Launch(job_id=ev.JobId("job-1"), pool=POOL, node_ids=(ev.NodeId("n1"), ev.NodeId("n2")), token="tok-1")
    agent_dir = tmp_path / "agent-n1"
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(executor.run)

            # 1. Launch: one enrolment token per node in the bootstrap and in the rendered user data
            executor.submit("launch-1", launch)
            await _wait_for(lambda: len(results) == 1)
            launched = [e for e in results[0].events if isinstance(e, NodeLaunched)]
            assert {e.node_id for e in launched} == {"n1", "n2"}
            tokens = cloud.requests[0].bootstrap.node_credentials
            assert set(tokens) == {"n1", "n2"} and tokens["n1"] != tokens["n2"]
            env = _user_data_env(render_user_data("n1", cloud.requests[0].bootstrap, cloud="fake"))
            assert env["ORCH_AGENT_ENROL_TOKEN"] == tokens["n1"] and env["ORCH_AGENT_NODE_ID"] == "n1"
            auth = (tmp_path / "auth.conf").read_text()
            assert enrol_user("n1") in auth and tokens["n1"] not in auth  # only a bcrypt hash on disk
            assert node_user("n1") not in auth  # the real credential exists only once enrolled

            # the same Launch executed again (a restarted daemon's outbox): same tokens, same instances
            executor.submit("launch-1", launch)
            await _wait_for(lambda: len(results) == 2)
            assert cloud.requests[1].bootstrap.node_credentials == tokens
            assert {e.instance_id for e in results[1].events if isinstance(e, NodeLaunched)} == \
                {e.instance_id for e in launched}

            # 2. A real agent with only the token: enrols, then heartbeats as node-n1
            agent = Agent(AgentConfig(node_id="n1", nats_urls=(url,), enrol_token=env["ORCH_AGENT_ENROL_TOKEN"],
                                      work_dir=str(agent_dir), heartbeat_s=0.1, metadata="none"))
            agent_scope = anyio.CancelScope()

            async def run_agent() -> None:
                # ConnectionResetError: closing a connection the server dropped (revoked)
                with agent_scope, contextlib.suppress(ConnectionResetError):
                    await agent.run()

            tg.start_soon(run_agent)
            with anyio.fail_after(10):
                while True:
                    hb = await hbs.get()
                    if hb.subject == "orch.node.n1.hb":
                        break
            assert ev.decode(hb.data, ev.Heartbeat).node_id == "n1"
            stored_path = agent_dir / "nats-credential.json"
            stored = json.loads(stored_path.read_text())
            assert stored["user"] == node_user("n1") and stat.S_IMODE(stored_path.stat().st_mode) == 0o600
            assert secured.issuer.issued() == {"n1"}

            # the token is single use: a second redemption is refused ("reused")
            errs = Errors()
            thief = await _connect(url, enrol_user("n1"), tokens["n1"], "_INBOX.n1.enrol", errs)
            reply = await thief.request("orch.enrol.n1", tokens["n1"].encode(), timeout=5)
            assert json.loads(reply.data) == {"error": "reused"}
            # and an enrol user can ask for nothing but its own node's credential
            await thief.publish("orch.enrol.n2", tokens["n2"].encode())
            await _wait_for(lambda: any("permissions violation" in e.lower() and "orch.enrol.n2" in e
                                        for e in errs))
            await thief.close()

            # 3. The node credential is scoped to n1: another node's heartbeat is refused by the server
            errs = Errors()
            n1 = await _connect(url, stored["user"], stored["password"], "_INBOX.n1", errs)
            await n1.publish("orch.node.n2.hb", b"forged")
            await _wait_for(lambda: any("permissions violation" in e.lower() and "orch.node.n2.hb" in e
                                        for e in errs))
            await n1.publish("orch.node.n1.hb", b"ok-from-n1")
            await n1.flush()
            with anyio.fail_after(5):
                while (m := await hbs.get()).data != b"ok-from-n1":
                    assert m.subject != "orch.node.n2.hb"
            # ... and to the launch's job and cloud (the executor passed them at launch): its own log and
            # notice subjects work, another job's logs and another cloud's notices are refused
            auth = (tmp_path / "auth.conf").read_text()
            assert '"orch.logs.job-1.n1"' in auth and '"orch.notice.fake.n1"' in auth
            scoped: asyncio.Queue = asyncio.Queue()
            await orchd.subscribe("orch.logs.>", cb=scoped.put)
            await orchd.subscribe("orch.notice.>", cb=scoped.put)
            await orchd.flush()
            for subject in ("orch.logs.job-2.n1", "orch.notice.aws.n1"):
                await n1.publish(subject, b"forged")
                await _wait_for(lambda s=subject: any("permissions violation" in e.lower() and s in e for e in errs))
            await n1.publish("orch.logs.job-1.n1", b"own-log")
            await n1.publish("orch.notice.fake.n1", b"own-notice")
            await n1.flush()
            with anyio.fail_after(5):
                got = [(await scoped.get()).subject, (await scoped.get()).subject]
            assert got == ["orch.logs.job-1.n1", "orch.notice.fake.n1"]

            # 4. Terminate -> NodeGone -> revoked: live connections closed, new connects refused
            inst = next(e.instance_id for e in launched if e.node_id == "n1")
            executor.submit("term-1", Terminate(node_id=ev.NodeId("n1"), instance_id=inst, pool=POOL))
            await _wait_for(lambda: len(results) == 3)
            assert any(isinstance(e, NodeGone) and e.node_id == "n1" for e in results[2].events)
            assert secured.issuer.issued() == frozenset()
            auth = (tmp_path / "auth.conf").read_text()
            assert node_user("n1") not in auth and enrol_user("n1") not in auth
            assert enrol_user("n2") in auth  # n2 still waits for its agent
            await _wait_for(lambda: not n1.is_connected)
            await _wait_for(lambda: not agent.nc.is_connected)
            refused = Errors()
            with pytest.raises((NoServersError, nats.errors.Error, OSError)):
                await _connect(url, stored["user"], stored["password"], "_INBOX.n1", refused)
            assert any("authorization violation" in e.lower() for e in refused), refused
            agent_scope.cancel()
            tg.cancel_scope.cancel()
    finally:
        await enrol_sub.unsubscribe()
        await orchd.close()


async def test_executor_without_credentials_keeps_an_empty_bootstrap() -> None:
    """Default (no NodeCredentials): no token minted, no credential in the launch (behaviour unchanged)."""
    cloud = RecordingCloud()
    results: list[Result] = []
    executor = Executor(Settings(), {"fake": cloud}, None, results.append, Metrics(),  # type: ignore[arg-type]
                        nats_urls=("nats://127.0.0.1:4222",))
    async with anyio.create_task_group() as tg:
        await tg.start(executor.run)
        executor.submit("l", Launch(job_id=ev.JobId("j"), pool=POOL, node_ids=(ev.NodeId("a"),), token="t"))
        await _wait_for(lambda: len(results) == 1)
        tg.cancel_scope.cancel()
    assert cloud.requests[0].bootstrap.node_credentials == {}
    assert cloud.requests[0].bootstrap.credential == ""


async def test_orchd_with_credentials_enabled_enrols_a_real_agent_and_revokes_when_gone(tmp_path: Path) -> None:
    """The daemon wiring (settings.credentials): a job's launch carries an enrolment token, the real agent
    enrols through orchd's endpoint and registers with its own credential; the node dies (agent stops,
    instance preempted) -> heartbeat timeout -> CheckInstance -> NodeGone -> its NATS user is revoked."""
    from orchestrator.cli.client import AdminClient
    from orchestrator.daemon.run import run_daemon
    from orchestrator.jobspec import parse_jobspec
    from orchestrator.settings import load_settings
    from tests.integration import helpers as h

    pid_file = tmp_path / "nats.pid"
    users = tmp_path / "static-users.json"
    users.write_text(json.dumps([{"name": "orchd", "password_hash": hash_password(ORCHD_PW), "role": "orchd"}]))
    issuer0 = EnrollingIssuer(tmp_path / "auth.conf", reload=lambda: None, static_users=[
        User(name="orchd", password_hash=hash_password(ORCHD_PW), permissions=orchd_permissions())])
    (tmp_path / "auth.conf").write_text(issuer0.render())
    (tmp_path / "server.conf").write_text(render_server_config(host="127.0.0.1", port=-1, store_dir=None,
                                                               http_port=None, server_name="orch-embedded"))
    server = NatsServer(tmp_path / "srv", config_file=str(tmp_path / "server.conf"),
                        extra_args=("-P", str(pid_file))).start()
    try:
        url = server.url
        settings = load_settings(h.write_config(tmp_path, url), env={
            "ORCH_NATS__USER": "orchd", "ORCH_NATS__PASSWORD": ORCHD_PW,
            "ORCH_CREDENTIALS__ENABLED": "true", "ORCH_CREDENTIALS__AUTH_FILE": str(tmp_path / "auth.conf"),
            "ORCH_CREDENTIALS__STATIC_USERS_FILE": str(users), "ORCH_CREDENTIALS__SERVER_PID_FILE": str(pid_file)})
        cloud = RecordingCloud()
        observer = await nats.connect(url, user="orchd", password=ORCHD_PW, connect_timeout=2)
        js = observer.jetstream()
        async with anyio.create_task_group() as tg:
            d = await tg.start(lambda task_status: run_daemon(settings, {"fake": cloud}, feeds=False,
                                                              task_status=task_status))
            await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL, 1.0, 3.0))
            await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL_OD, 3.0, 3.0))
            await h.wait_for(lambda: len(d.state.pools) == 2)
            admin = await AdminClient.connect([url], nats_settings=settings.nats)
            spec = parse_jobspec(h.JOB_TOML.format(nodes=1))
            await admin.call("jobs", "submit", ev.SubmitJobRequest(spec=spec))
            await admin.close()
            (inst,) = await h.wait_for(lambda: cloud.all_instances())
            token = cloud.requests[0].bootstrap.node_credentials[inst.node_id]
            assert node_user(inst.node_id) not in (tmp_path / "auth.conf").read_text()

            agent_scope, stored = await h.start_enrolling_agent(tg, d, inst, token, url, tmp_path / "agent")
            assert node_user(inst.node_id) in (tmp_path / "auth.conf").read_text()

            # the node dies: its agent stops, the cloud reclaims the instance
            agent_scope.cancel()
            cloud.preempt(inst.instance_id)
            await h.wait_for(lambda: node_user(inst.node_id) not in (tmp_path / "auth.conf").read_text(),
                             timeout=20)
            # orchd's reload is a SIGHUP (not awaited): the server refuses the user once it has reloaded
            # (a connect that races the reload may also be lost: try until the refusal itself is seen)
            refused = Errors()
            with anyio.fail_after(5):
                while not any("authorization violation" in e.lower() for e in refused):
                    try:
                        nc = await _connect(url, stored["user"], stored["password"], f"_INBOX.{inst.node_id}",
                                            refused)
                    except (NoServersError, nats.errors.Error, OSError):
                        pass
                    else:
                        await nc.close()
                    await anyio.sleep(0.05)
            d.request_stop()
        await observer.close()
    finally:
        server.cleanup()
