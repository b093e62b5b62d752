"""The per-sender rate limit (orchestrator/daemon/ratelimit.py), as a unit and on a real orchd.

On a real nats-server with a real orchd (in-process, the real core) and the fake cloud: job A's node
floods its own subjects (heartbeats and node events, each valid) while job B's node is noticed. The flood
is refused at intake and counted (``rate_limited``), never decided beyond the node's burst; B's notice
still becomes a CheckpointCmd, and nothing is left pending in the events consumer.
"""

from __future__ import annotations

import time

import anyio
import nats
import pytest
from prometheus_client import generate_latest

import wire as ev
from orchestrator import bus
from orchestrator.daemon.ratelimit import SenderLimiter, sender_of
from orchestrator.daemon.run import run_daemon
from orchestrator.settings import load_settings
from simulations.fakecloud import FakeCloud
from tests.integration import helpers as h
from tests.integration.test_trust_gate import rejected, submit

RATE, BURST, FLOOD = 5.0, 20, 1500


def test_sender_of_names_the_node_of_its_own_subjects_only() -> None:
    assert sender_of("orch.node.n1.hb") == ("hb", "n1")
    assert sender_of("orch.node.n1.event") == ("event", "n1")
    assert sender_of("orch.notice.aws.n1") == ("notice", "n1")
    assert sender_of("orch.price.aws.us-east-1") is None and sender_of("orch.node.n1") is None


def test_buckets_refill_at_the_rate_and_are_separate_per_kind_and_node() -> None:
    lim = SenderLimiter(rate=2.0, burst=3)
    assert [lim.allow("orch.node.a.event", 0.0) for _ in range(4)] == [True, True, True, False]
    assert lim.allow("orch.node.a.hb", 0.0) and lim.allow("orch.notice.aws.a", 0.0)  # own buckets
    assert lim.allow("orch.node.b.event", 0.0)  # another node
    assert not lim.allow("orch.node.a.event", 0.4)  # 0.8 token
    assert lim.allow("orch.node.a.event", 0.5) and not lim.allow("orch.node.a.event", 0.5)
    assert all(lim.allow("orch.price.aws.r", 0.0) for _ in range(100))  # feeds are not limited here
    assert all(SenderLimiter(rate=0.0, burst=1).allow("orch.node.a.hb", 0.0) for _ in range(10))


def test_memory_is_bounded_and_full_buckets_go_first() -> None:
    lim = SenderLimiter(rate=1.0, burst=2, max_senders=100)
    for _ in range(3):
        lim.allow("orch.node.noisy.event", 0.0)
    for i in range(1000):
        lim.allow(f"orch.node.n{i}.hb", 1000.0 + i)
    assert len(lim) <= 100  # never unbounded


@pytest.mark.anyio
async def test_a_flooding_node_is_refused_at_intake_and_another_jobs_notice_goes_through(server, tmp_path):
    url = server.url
    cfg = h.write_config(tmp_path, url)
    cfg.write_text(cfg.read_text().replace("[daemon]\n", f"[daemon]\nsender_rate_per_s = {RATE}\n"
                                                         f"sender_burst = {BURST}\n"))
    cloud = FakeCloud()
    nc = await nats.connect(url)
    js = nc.jetstream()
    agent = await h.SimAgent(nc).start()
    async with anyio.create_task_group() as tg:
        d = await tg.start(lambda task_status: run_daemon(load_settings(cfg, env={}), {"fake": cloud},
                                                          task_status=task_status))
        await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL, 1.0, 3.0))
        await h.wait_for(lambda: h.POOL.name in d.state.pools)
        job_a = await submit(url, tmp_path, "noisy", f"file://{tmp_path}/a")
        job_b = await submit(url, tmp_path, "quiet", f"file://{tmp_path}/b")
        await h.wait_for(lambda: len(cloud.all_instances()) == 2)
        for i in cloud.all_instances():
            await h.publish_js(js, ev.subject_node_event(i.node_id), ev.NodeRegistered(
                id=f"reg-{i.node_id}", node_id=i.node_id, instance_id=i.instance_id, pool=i.pool,
                host="127.0.0.1", ts=time.time()))
        starts = await h.wait_for(lambda: len(agent.of_kind(ev.StartGenerationCmd)) == 2
                                  and agent.of_kind(ev.StartGenerationCmd))
        node = {c.job_id: c for c in starts}
        noisy, quiet = node[job_a], node[job_b]
        decided_before = d.events_decided

        for k in range(FLOOD):  # A's node floods its own subjects with valid messages
            await nc.publish(ev.subject_heartbeat(noisy.node_id), ev.encode(ev.Heartbeat(
                node_id=noisy.node_id, seq=10 + k, ts=time.time(), state=ev.AgentState.TRAINING, job_id=job_a,
                generation=noisy.generation, step=1)))
            await js.publish(ev.subject_node_event(noisy.node_id), ev.encode(ev.GenerationStarted(
                id=f"flood-{k}", node_id=noisy.node_id, job_id=job_a, generation=noisy.generation, first_step=1,
                ts=time.time())), headers={"Nats-Msg-Id": f"flood-{k}"})
        await h.publish_js(js, ev.subject_notice("fake", quiet.node_id), ev.PreemptionNotice(
            id="notice-b", node_id=quiet.node_id, cloud="fake", deadline_ts=time.time() + 120,
            observed_ts=time.time()))
        await h.wait_for(lambda: any(c.node_id == quiet.node_id for c in agent.of_kind(ev.CheckpointCmd)),
                         timeout=30)

        def refused() -> tuple[float, float]:
            text = generate_latest(d.metrics.registry).decode()
            return rejected(text, "node_event", "rate_limited"), rejected(text, "heartbeat", "rate_limited")

        await h.wait_for(lambda: refused()[0] >= FLOOD - BURST - RATE * 60, timeout=30)
        ev_refused, hb_refused = refused()
        assert hb_refused >= FLOOD - BURST - RATE * 60
        # what reached the core from A's flood: at most its burst plus what the rate refilled meanwhile
        assert d.events_decided - decided_before <= 2 * (FLOOD - ev_refused) + FLOOD - hb_refused + 10

        async def drained() -> bool:
            info = await js.consumer_info(bus.STREAM_EVENTS, bus.CONSUMER_EVENTS)
            return info.num_ack_pending == 0 and info.num_pending == 0

        with anyio.fail_after(15):
            while not await drained():
                await anyio.sleep(0.1)
        d.request_stop()
    await nc.close()
