"""orchd with the real core, in-process, driven through orchctl (main(argv)) and a simulated agent.

Covers: submit via orchctl, prices and node events on JetStream, commands at the simulated agent,
a preemption notice -> CheckpointCmd to every node of the job (with the fencing token) and a
replacement launch, every orchctl verb in table/json/yaml, malformed messages counted and terminated.
"""

from __future__ import annotations

import json
import time

import anyio
import nats
import pytest
import yaml

import wire as ev
from orchestrator import bus
from orchestrator.cli.client import AdminClient
from orchestrator.daemon.run import run_daemon
from orchestrator.daemon.store import Store
from orchestrator.jobspec import parse_jobspec
from orchestrator.settings import load_settings
from providers.base import LaunchRequest
from simulations.fakecloud import FakeCloud
from tests.integration import helpers as h
from tests.integration.helpers import actl

pytestmark = pytest.mark.anyio




async def register_all(js, cloud: FakeCloud, seen: set[str]) -> None:
    for inst in cloud.all_instances():
        if inst.node_id in seen:
            continue
        seen.add(inst.node_id)
        reg = ev.NodeRegistered(id=f"reg-{inst.node_id}", node_id=inst.node_id, instance_id=inst.instance_id,
                                pool=inst.pool, host="127.0.0.1", ts=time.time())
        await h.publish_js(js, ev.subject_node_event(inst.node_id), reg)


async def test_submit_notice_commands_and_every_verb(server, tmp_path):
    url = server.url
    settings = h.settings_for(tmp_path, url)
    cloud = FakeCloud()
    nc = await nats.connect(url)
    js = nc.jetstream()
    agent = await h.SimAgent(nc).start()
    spec_file = tmp_path / "job.toml"
    spec_file.write_text(h.JOB_TOML.format(nodes=2))
    async with anyio.create_task_group() as tg:
        d = await tg.start(lambda task_status: run_daemon(settings, {"fake": cloud}, task_status=task_status))
        await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL, 1.0, 3.0))
        await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL_OD, 3.0, 3.0))
        await h.wait_for(lambda: len(d.state.pools) == 2)

        code, out, err = await actl(url, "jobs", "submit", str(spec_file), "-o", "json")
        assert code == 0, err
        job_id = json.loads(out)["job_id"]
        await h.wait_for(lambda: len(cloud.all_instances()) == 2)
        seen: set[str] = set()
        await register_all(js, cloud, seen)
        starts = await h.wait_for(lambda: len(agent.of_kind(ev.StartGenerationCmd)) == 2 and
                                  agent.of_kind(ev.StartGenerationCmd))
        assert {c.nnodes for c in starts} == {2}
        assert all(c.fencing_token == d.fencing_token > 0 for c in starts)
        for c in starts:  # the agents report training
            hb = ev.Heartbeat(node_id=c.node_id, seq=1, ts=time.time(), state=ev.AgentState.TRAINING,
                              job_id=c.job_id, generation=c.generation, step=5)
            await nc.publish(ev.subject_heartbeat(c.node_id), ev.encode(hb))
        await h.wait_for(lambda: d.state.jobs[job_id].phase == "running")

        victim = starts[0].node_id
        notice = ev.PreemptionNotice(id="notice-1", node_id=victim, cloud="fake", deadline_ts=time.time() + 120,
                                     observed_ts=time.time())
        await h.publish_js(js, ev.subject_notice("fake", victim), notice)
        ckpts = await h.wait_for(lambda: len(agent.of_kind(ev.CheckpointCmd)) == 2 and agent.of_kind(ev.CheckpointCmd))
        assert {c.node_id for c in ckpts} == {c.node_id for c in starts}
        assert all(c.reason and c.deadline_ts for c in ckpts)
        await h.wait_for(lambda: len(cloud.all_instances()) == 3)  # a replacement, in another pool
        repl = [i for i in cloud.all_instances() if i.node_id not in seen][0]
        assert repl.pool != h.POOL

        # /metrics: the Prometheus exposition of this daemon
        import urllib.request

        def scrape() -> str:
            with urllib.request.urlopen(d.metrics_url, timeout=5) as r:
                return r.read().decode()

        text = await anyio.to_thread.run_sync(scrape)
        assert 'orchd_events_total{type="PreemptionNotice"} 1.0' in text
        assert "orchd_notice_to_command_seconds_count 2.0" in text  # both checkpoint commands, timed
        assert 'orchd_decisions_total{kind="Launch"}' in text and "orchd_nats_connected 1.0" in text
        assert 'orchd_preemptions_total{cloud="fake"' in text

        # every verb, every format
        for fmt in ("table", "json", "yaml"):
            for argv in (["status"], ["jobs", "list"], ["jobs", "show", job_id], ["nodes", "list"],
                         ["nodes", "list", "--job", job_id], ["prices"], ["events"], ["explain", job_id],
                         ["reap", "--dry-run"]):
                code, out, err = await actl(url, *argv, "-o", fmt)
                assert code == 0, (argv, err)
                if fmt == "json":
                    json.loads(out)
                elif fmt == "yaml":
                    yaml.safe_load(out)
        code, out, _ = await actl(url, "explain", job_id, "-o", "json")
        actions = [e.get("action") for e in json.loads(out)["entries"]]
        assert {"submit", "launch", "start_generation", "checkpoint"} <= set(actions)
        code, out, _ = await actl(url, "events", "-o", "json")
        assert any(e["command"] == "SendToAgent" for e in json.loads(out)["events"])
        code, out, _ = await actl(url, "reap", "--dry-run", "-o", "json")
        assert json.loads(out)["report"]["dry_run"] is True
        code, _, err = await actl(url, "jobs", "show", "no-such-job")
        assert code == 66 and "no job" in err  # EXIT_NOT_FOUND
        code, out, err = await actl(url, "nodes", "drain", victim, "-o", "json")
        assert code == 0, err
        code, out, err = await actl(url, "jobs", "cancel", job_id, "-o", "json")
        assert code == 0, err
        await h.wait_for(lambda: d.state.jobs[job_id].phase in ("cancelled", "checkpointing"))
        d.request_stop()
    await nc.close()


async def test_malformed_messages_counted_terminated_daemon_stays_up(server, tmp_path):
    url = server.url
    settings = h.settings_for(tmp_path, url)
    nc = await nats.connect(url)
    js = nc.jetstream()
    async with anyio.create_task_group() as tg:
        d = await tg.start(lambda task_status: run_daemon(settings, {}, task_status=task_status))
        bad = [
            ("orch.notice.fake.n1", b"{not json"),
            ("orch.notice.fake.n1", b'{"type":"preemption_notice","v":1}'),  # missing fields
            ("orch.price.fake.r1", ev.encode(h.price()).replace(b'"v":1', b'"v":99')),
            ("orch.node.n1.event", b'{"type":"launch_the_missiles","v":1}'),
            ("orch.price.fake.r1", b"\x00\xff" * 10),
        ]
        for i, (subject, data) in enumerate(bad):
            await js.publish(subject, data, headers={"Nats-Msg-Id": f"bad-{i}"})
        await nc.publish("orch.node.n1.hb", b"garbage")
        await nc.publish("orch.node.n1.hb", b'{"type":"heartbeat","v":1}')
        await h.publish_js(js, ev.subject_price("fake", "r1"), h.price())  # a good one after the bad ones

        def rejected() -> float:
            return sum(s.value for m in d.metrics.rejected.collect() for s in m.samples if s.name.endswith("_total"))

        await h.wait_for(lambda: rejected() >= 7 and len(d.state.pools) >= 1)
        reasons = {s.labels["reason"] for m in d.metrics.rejected.collect() for s in m.samples}
        assert {"bad_json", "bad_schema", "bad_version", "unknown_type"} <= reasons
        for durable, stream in ((bus.CONSUMER_EVENTS, bus.STREAM_EVENTS), (bus.CONSUMER_MARKET, bus.STREAM_MARKET)):
            info = await js.consumer_info(stream, durable)
            assert info.num_ack_pending == 0 and info.num_pending == 0  # terminated, not left to redeliver
        code, out, err = await actl(url, "status", "-o", "json")
        assert code == 0 and json.loads(out)["nats_connected"] is True
        d.request_stop()
    await nc.close()


async def test_outbox_agent_command_reexecuted_after_restart_with_new_token(server, tmp_path):
    """A command decided and persisted but never acknowledged (agent away) is executed again by the
    next daemon: same cmd_id, the new daemon's (greater) fencing token, accepted by a fencing agent."""
    url = server.url
    settings = h.settings_for(tmp_path, url)
    cloud = FakeCloud()
    nc = await nats.connect(url)
    js = nc.jetstream()
    mute = await h.SimAgent(nc, ack=False).start()  # receives, never answers
    spec = h.JOB_TOML.format(nodes=1)
    async with anyio.create_task_group() as tg:
        d1 = await tg.start(lambda task_status: run_daemon(settings, {"fake": cloud}, task_status=task_status))
        await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL, 1.0, 3.0))
        await h.wait_for(lambda: len(d1.state.pools) >= 1)
        client = await AdminClient.connect([url])
        await client.submit(parse_jobspec(spec))
        await client.close()
        await h.wait_for(lambda: len(cloud.all_instances()) == 1)
        await register_all(js, cloud, set())
        first = await h.wait_for(lambda: mute.of_kind(ev.StartGenerationCmd))
        d1.request_stop()  # the command is in flight: it stays in the outbox
    await mute.sub.unsubscribe()
    agent = await h.SimAgent(nc, fencing=True).start()
    async with anyio.create_task_group() as tg:
        d2 = await tg.start(lambda task_status: run_daemon(settings, {"fake": cloud}, task_status=task_status))
        assert d2.fencing_token > d1.fencing_token
        again = await h.wait_for(lambda: agent.of_kind(ev.StartGenerationCmd))
        assert again[0].cmd_id == first[0].cmd_id
        assert again[0].fencing_token == d2.fencing_token
        assert not agent.refused
        await h.wait_for(lambda: not d2.executor.in_flight)
        d2.request_stop()
    records, outbox = await _load(url)
    assert not outbox  # acknowledged: its outbox entry was deleted with the ack's batch
    await nc.close()


async def _load(url: str):
    nc = await nats.connect(url)
    try:
        return await Store(await bus.ensure_topology(nc)).load()
    finally:
        await nc.close()


async def test_periodic_reaper_terminates_orphans_only(server, tmp_path):
    """With daemon.reap_interval_s set, an instance carrying this deployment's tag but unknown to the
    state is terminated after the grace period; the instances of a live job are left alone."""
    cfg = h.write_config(tmp_path, server.url)
    cfg.write_text(cfg.read_text().replace(
        "[daemon]\n", '[daemon]\ncluster_id = "reap-test"\nreap_interval_s = 0.3\nreap_grace_s = 0.5\n'))
    settings = load_settings(cfg, env={})
    cloud = FakeCloud()
    orphan = cloud.launch(LaunchRequest(pool=h.POOL, node_ids=("ghost-1",), idempotency_token="ghost",
                                        cluster_id=settings.daemon.cluster_id, job_id="gone-job"))
    nc = await nats.connect(server.url)
    js = nc.jetstream()
    async with anyio.create_task_group() as tg:
        d = await tg.start(lambda task_status: run_daemon(settings, {"fake": cloud}, task_status=task_status))
        await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL, 1.0, 3.0))
        await h.wait_for(lambda: len(d.state.pools) >= 1)
        client = await AdminClient.connect([server.url])
        await client.submit(parse_jobspec(h.JOB_TOML.format(nodes=2)))
        await client.close()
        ghost = orphan.instances[0].instance_id
        await h.wait_for(lambda: not [i for i in cloud.all_instances() if i.instance_id == ghost and i.alive],
                         timeout=10)
        alive = [i for i in cloud.all_instances() if i.alive]
        assert len(alive) == 2 and all(i.node_id != "ghost-1" for i in alive)
        d.request_stop()
    await nc.close()
