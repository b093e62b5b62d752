"""The shell's plumbing with a tiny stand-in core: admin submit -> Launch on the fake cloud ->
persisted state; a notice -> CheckpointCmd at the simulated agent; state survives a daemon restart."""

from __future__ import annotations

import anyio
import nats
import pytest

from orchestrator import events as ev
from orchestrator.client import AdminClient
from orchestrator.daemon import run_daemon
from orchestrator.jobspec import parse_jobspec
from providers.fake import FakeCloud
from tests.integration import helpers as h
from tests.integration.standin_core import CORE

pytestmark = pytest.mark.anyio


async def test_plumbing_with_standin_core(nats_server, tmp_path):
    settings = h.settings_for(tmp_path, nats_server.url)
    cloud = FakeCloud()
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    agent = await h.SimAgent(nc).start()
    async with anyio.create_task_group() as tg:
        d = await tg.start(lambda task_status: run_daemon(settings, {"fake": cloud}, core=CORE,
                                                          task_status=task_status))
        await h.publish_js(js, ev.subject_price("fake", "r1"), h.price())
        await h.wait_for(lambda: len(d.state.pools) == 1)
        client = await AdminClient.connect([nats_server.url])
        spec = parse_jobspec(h.JOB_TOML.format(nodes=2))
        reply = await client.submit(spec)
        assert reply.created
        await h.wait_for(lambda: len(cloud.all_instances()) == 2)
        await h.wait_for(lambda: all(n.instance_id for n in d.state.nodes.values()))
        node = next(iter(d.state.nodes))
        notice = ev.PreemptionNotice(id="n1", node_id=node, cloud="fake", deadline_ts=0.0, observed_ts=0.0)
        await h.publish_js(js, ev.subject_notice("fake", node), notice)
        await h.wait_for(lambda: len(agent.of_kind(ev.CheckpointCmd)) == 2)
        st = await client.status()
        assert st.jobs and st.events_decided > 0
        await client.close()
        d.request_stop()
    # restart: same state from KV, no new launch
    async with anyio.create_task_group() as tg:
        d2 = await tg.start(lambda task_status: run_daemon(settings, {"fake": cloud}, core=CORE,
                                                           task_status=task_status))
        assert set(d2.state.nodes) == set(d.state.nodes)
        assert all(n.instance_id for n in d2.state.nodes.values())
        d2.request_stop()
    assert cloud.launch_calls == 1
    await nc.close()
