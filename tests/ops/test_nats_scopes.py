"""The agent role scoped to its own job and cloud, the log shipper under it, and the price-feed role.

Against a real nats-server with the rendered config (the ``secured`` server of test_nats_security: n1 is
issued for job j1 on aws, n2 for job j2 on gcp; the static user ``feed`` has ``feed_permissions("aws")``).
A refusal is the server's permissions-violation error AND the message not arriving.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import anyio
import pytest
from nats.errors import TimeoutError as NatsTimeoutError

from agent.config import AgentConfig
from agent.logship import LOGS_STREAM, LogShipper, creates_logs_stream, ensure_logs_stream
from orchestrator.security.nats_auth import FEED_INBOX, agent_permissions, feed_permissions, role_permissions
from tests.ops.test_nats_security import FEED_PW, Client, Secured, _agent, _orchd
from tests.ops.test_nats_security import secured as secured  # noqa: F401 - the module's server fixture
from wire import LogLine, decode

pytestmark = pytest.mark.anyio


def test_agent_permissions_name_only_its_job_and_cloud() -> None:
    p = agent_permissions("n1", job_id="j1", cloud="aws")
    assert p.publish == ("orch.node.n1.hb", "orch.node.n1.event", "orch.notice.aws.n1", "orch.logs.j1.n1")
    assert not any("*" in s or ">" in s for s in p.publish)
    assert agent_permissions("n1").publish == ("orch.node.n1.hb", "orch.node.n1.event")  # no scope: neither
    with pytest.raises(ValueError):
        agent_permissions("n1", job_id="j.*", cloud="aws")
    assert feed_permissions().publish == ("orch.price.>",)
    assert role_permissions("feed:gcp") == feed_permissions("gcp")
    assert role_permissions("feed") == feed_permissions()
    for bad in ("feed:", "admin", "feed:a.b"):
        with pytest.raises(ValueError):
            role_permissions(bad)


def test_static_users_accept_feed_roles(tmp_path: Path) -> None:
    import dataclasses
    import json

    from orchestrator.daemon.startup import StartupError, node_credentials, static_users
    from orchestrator.settings import Settings

    users = tmp_path / "users.json"
    s = Settings()
    s = dataclasses.replace(s, credentials=dataclasses.replace(
        s.credentials, static_users_file=str(users), auth_file=str(tmp_path / "auth.conf")))
    users.write_text(json.dumps([{"name": "feed", "password_hash": "$2b$10$x", "role": "feed:aws"},
                                 {"name": "all", "password_hash": "$2b$10$y", "role": "feed"}]))
    assert [u["role"] for u in static_users(s)] == ["feed:aws", "feed"]
    render = node_credentials(s).issuer.render()
    assert '"orch.price.aws.>"' in render and '"orch.price.>"' in render
    users.write_text(json.dumps([{"name": "x", "password_hash": "$2b$10$x", "role": "admin"}]))
    with pytest.raises(StartupError, match="unknown role"):
        static_users(s)


async def test_agent_writes_only_its_own_jobs_logs_and_its_own_clouds_notices(secured: Secured) -> None:
    orchd, agent = await _orchd(secured), await _agent(secured, "n1")
    try:
        js = orchd.nc.jetstream()
        await js.add_stream(name="ORCH_EVENTS", subjects=["orch.node.*.event", "orch.notice.>"])
        await ensure_logs_stream(orchd.nc)
        seen: asyncio.Queue = asyncio.Queue()
        await orchd.nc.subscribe("orch.>", cb=seen.put)
        await orchd.nc.flush()
        ajs = agent.nc.jetstream()
        assert (await ajs.publish("orch.logs.j1.n1", b"mine")).stream == LOGS_STREAM
        assert (await ajs.publish("orch.notice.aws.n1", b"mine")).stream == "ORCH_EVENTS"
        assert agent.errors == []
        # another job's log subject (same node and another node's), another cloud's notice subject
        for subject in ("orch.logs.j2.n1", "orch.logs.j2.n2", "orch.notice.gcp.n1", "orch.notice.aws.n2"):
            await agent.nc.publish(subject, b"forged")
            await agent.violation(f'"{subject}"')
        await orchd.nc.flush()
        got: list[str] = []
        want = ["orch.logs.j1.n1", "orch.notice.aws.n1"]
        with anyio.move_on_after(5.0):  # a loaded machine delivers late; then any forged one had time too
            while not set(want) <= set(got):
                got.append((await seen.get()).subject)
        await asyncio.sleep(0.2)
        got += [seen.get_nowait().subject for _ in range(seen.qsize())]
        assert sorted(s for s in got if s.startswith(("orch.logs.", "orch.notice."))) == want, got
    finally:
        await agent.nc.close()
        await orchd.nc.close()


async def test_log_shipper_ships_under_the_agent_role(secured: Secured, tmp_path: Path) -> None:
    """orchd creates ORCH_LOGS; the shipper of an agent with a credential never asks the JetStream
    API (which its role refuses: shown below) and its line is stored, with no error on its connection."""
    orchd, agent = await _orchd(secured), await _agent(secured, "n1")
    try:
        await ensure_logs_stream(orchd.nc)  # what bus.ensure_topology does at orchd's start-up
        assert not creates_logs_stream(AgentConfig(node_id="n1", enrol_token="t"))
        assert creates_logs_stream(AgentConfig(node_id="n1"))  # an open server only
        shipper = LogShipper(agent.nc, "n1", tmp_path)
        async with anyio.create_task_group() as tg:
            tg.start_soon(shipper.run)
            shipper.ship("j1", 1, 0, "stdout", "hello from rank 0")
            await shipper.flush(2.0)
            tg.cancel_scope.cancel()
        shipper.close()
        assert shipper.shipped == 1 and agent.errors == []
        msg = await orchd.nc.jetstream().get_last_msg(LOGS_STREAM, "orch.logs.j1.n1")
        line = decode(msg.data, LogLine)
        assert (line.line, line.node_id, line.job_id) == ("hello from rank 0", "n1", "j1")
        assert "hello from rank 0" in (tmp_path / "logs" / "j1" / "gen1-rank0.log").read_text()
        # what the agent used to do: the stream check is a permissions violation under its role
        with pytest.raises(NatsTimeoutError):
            await ensure_logs_stream(agent.nc)
        await agent.violation(f'"$JS.API.STREAM.INFO.{LOGS_STREAM}"')
    finally:
        await agent.nc.close()
        await orchd.nc.close()


async def test_feed_role_publishes_prices_of_its_cloud_only(secured: Secured) -> None:
    orchd = await _orchd(secured)
    feed = await Client().connect(secured.server.url, "feed", FEED_PW, inbox_prefix=FEED_INBOX)
    try:
        await orchd.nc.jetstream().add_stream(name="ORCH_MARKET", subjects=["orch.price.>"])
        seen: asyncio.Queue = asyncio.Queue()
        await orchd.nc.subscribe("orch.>", cb=seen.put)
        await orchd.nc.flush()
        ack = await feed.nc.jetstream().publish("orch.price.aws.us-east-1", b"tick")  # PubAck to its inbox
        assert ack.stream == "ORCH_MARKET" and feed.errors == []
        for subject in ("orch.price.gcp.us-central1", "orch.node.n1.hb", "orch.notice.aws.n1", "orch.logs.j1.n1",
                        "orch.cmd.n1"):
            await feed.nc.publish(subject, b"forged")
            await feed.violation(f'"{subject}"')
        for subject in ("orch.>", "_INBOX.>"):
            await feed.nc.subscribe(subject)
            await feed.violation(f'"{subject}"')
        for subject in ("$JS.API.STREAM.INFO.ORCH_MARKET", "orch.admin.v1.jobs.list"):
            with pytest.raises(NatsTimeoutError):
                await feed.nc.request(subject, b"{}", timeout=0.3)
            await feed.violation(f'"{subject}"')
        await orchd.nc.flush()
        await asyncio.sleep(0.1)
        got = [seen.get_nowait().subject for _ in range(seen.qsize())]
        assert got == ["orch.price.aws.us-east-1"], got
    finally:
        await feed.nc.close()
        await orchd.nc.close()
