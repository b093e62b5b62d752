"""The trust gate through the wire: a real nats-server, a real orchd (in-process, the real core) and a
fake cloud. A node of job A attacks job B from its own subject (``orch.node.<A's node>.event``):

- attack 4: a ``CheckpointCommitted`` naming job B, step 999999 and a URL outside B's root (and the
  same URL with A's own job id): B's committed step and URL stay as B's own node committed them;
- attack 5: a ``NodeRegistered`` naming A's own node with B's instance id: no Terminate reaches the
  cloud, both instances keep running.

Both are refused: counted in ``orchd_messages_rejected_total{kind,reason}``, terminated in JetStream
(nothing left pending), shown in ``orchctl events``.
"""

from __future__ import annotations

import json
import time

import anyio
import nats
import pytest
from prometheus_client import generate_latest

import wire as ev
from orchestrator import bus
from orchestrator.daemon.run import run_daemon
from providers.base import InstanceState
from simulations.fakecloud import FakeCloud
from tests.integration import helpers as h
from tests.integration.helpers import ctl

pytestmark = pytest.mark.anyio



def rejected(text: str, kind: str, reason: str) -> float:
    key = f'orchd_messages_rejected_total{{kind="{kind}",reason="{reason}"}} '
    for line in text.splitlines():
        if line.startswith(key):
            return float(line[len(key):])
    return 0.0


async def submit(url: str, tmp_path, name: str, root: str) -> str:
    spec = tmp_path / f"{name}.toml"
    spec.write_text(h.JOB_TOML.format(nodes=1).replace('name = "itest"', f'name = "{name}"')
                    .replace("file:///tmp/orch-itest-ckpt", root))
    code, out, err = await anyio.to_thread.run_sync(lambda: ctl(url, "jobs", "submit", str(spec), "-o", "json"))
    assert code == 0, err
    return str(json.loads(out)["job_id"])


async def attack(js, node_a: str, gen_a: int, job_a: str, job_b: str, victim: str) -> None:
    """Attacks 4 (three commits: B's job id; A's own with an impossible step; A's own with a foreign URL)
    and 5 (A's node registering with B's instance), all on A's node's own subject."""
    for i, (job, step) in enumerate(((job_b, 999_999), (job_a, 999_999), (job_a, 20))):
        await h.publish_js(js, ev.subject_node_event(node_a), ev.CheckpointCommitted(
            id=f"evil-{i}", node_id=node_a, job_id=job, generation=gen_a, step=step, checkpoint_id="x",
            url="file:///tmp/evil", save_s=1.0, ts=time.time()))
    await h.publish_js(js, ev.subject_node_event(node_a), ev.NodeRegistered(
        id="evil-reg", node_id=node_a, instance_id=victim, pool=h.POOL, host="127.0.0.1", ts=time.time()))


async def test_a_node_cannot_touch_another_jobs_checkpoint_or_instance(server, tmp_path):
    url = server.url
    cloud = FakeCloud()
    nc = await nats.connect(url)
    js = nc.jetstream()
    agent = await h.SimAgent(nc).start()
    root_a, root_b = f"file://{tmp_path}/ckpt-a", f"file://{tmp_path}/ckpt-b"
    async with anyio.create_task_group() as tg:
        d = await tg.start(lambda task_status: run_daemon(h.settings_for(tmp_path, url), {"fake": cloud},
                                                          task_status=task_status))
        await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL, 1.0, 3.0))
        await h.wait_for(lambda: h.POOL.name in d.state.pools)
        job_a = await submit(url, tmp_path, "job-a", root_a)
        job_b = await submit(url, tmp_path, "job-b", root_b)
        await h.wait_for(lambda: len(cloud.all_instances()) == 2)
        inst = {i.node_id: i for i in cloud.all_instances()}
        for i in inst.values():  # each agent registers with its own instance id
            await h.publish_js(js, ev.subject_node_event(i.node_id), ev.NodeRegistered(
                id=f"reg-{i.node_id}", node_id=i.node_id, instance_id=i.instance_id, pool=i.pool, host="127.0.0.1",
                ts=time.time()))
        starts = await h.wait_for(lambda: len(agent.of_kind(ev.StartGenerationCmd)) == 2
                                  and agent.of_kind(ev.StartGenerationCmd))
        node = {c.job_id: c.node_id for c in starts}
        node_a, node_b = node[job_a], node[job_b]
        gen_b = next(c.generation for c in starts if c.job_id == job_b)

        # B's own node commits legitimately: stored
        good = f"{root_b}/step-00000010"
        await h.publish_js(js, ev.subject_node_event(node_b), ev.CheckpointCommitted(
            id="c-b-10", node_id=node_b, job_id=job_b, generation=gen_b, step=10, checkpoint_id="step-00000010",
            url=good, save_s=1.0, ts=time.time()))
        await h.wait_for(lambda: d.state.jobs[job_b].committed_url == good)

        # attack 4, on A's node's own subject (the subject matches: screen passes it to the gate)
        gen_a = d.state.nodes[node_a].generation
        victim = inst[node_b].instance_id
        await attack(js, node_a, gen_a, job_a, job_b, victim)

        def counts() -> tuple[float, ...]:
            text = generate_latest(d.metrics.registry).decode()  # what /metrics serves
            return (rejected(text, "CheckpointCommitted", "wrong_job"),
                    rejected(text, "CheckpointCommitted", "bad_step"),
                    rejected(text, "CheckpointCommitted", "foreign_checkpoint"),
                    rejected(text, "NodeRegistered", "wrong_instance"))

        async def all_counted() -> tuple[float, ...]:
            while True:
                c = counts()
                if c == (1.0, 1.0, 1.0, 1.0):
                    return c
                await anyio.sleep(0.1)

        with anyio.fail_after(15):
            await all_counted()
        await anyio.sleep(1.0)  # let any command a refused event might have caused reach the cloud

        job = d.state.jobs[job_b]
        assert (job.committed_step, job.committed_url) == (10, good)  # attack 4 changed nothing
        assert d.state.jobs[job_a].committed_url is None
        by_id = {i.instance_id: i for i in cloud.all_instances()}
        assert cloud.terminate_calls == 0  # attack 5: no Terminate at all
        assert by_id[victim].state != InstanceState.TERMINATED
        assert by_id[inst[node_a].instance_id].state != InstanceState.TERMINATED
        assert d.state.nodes[node_a].instance_id == inst[node_a].instance_id

        # the refused messages are terminated: nothing pending, nothing redelivered
        info = await js.consumer_info(bus.STREAM_EVENTS, bus.CONSUMER_EVENTS)
        assert info.num_ack_pending == 0 and info.num_redelivered == 0

        code, out, err = await anyio.to_thread.run_sync(lambda: ctl(url, "events", "-o", "json"))
        assert code == 0, err
        shown = [(e.get("node"), e.get("reason")) for e in json.loads(out)["events"] if e["command"] == "rejected"]
        assert {(node_a, "wrong_job"), (node_a, "bad_step"), (node_a, "foreign_checkpoint"),
                (node_a, "wrong_instance")} <= set(shown)
        d.request_stop()
    await nc.close()


# --- the shell's side without NATS: Decider and the rate-limited log of `orchctl events` ---------------


def test_decider_gates_every_event_before_the_core() -> None:
    from orchestrator import core
    from orchestrator.daemon.coreapi import CoreApi
    from orchestrator.daemon.metrics import Metrics
    from orchestrator.daemon.pipeline import Decider
    from tests.core.test_gate import commit, hb, two_jobs

    drv, j1, j2 = two_jobs()
    seen: list[object] = []

    def spy(state, event, now):  # the core: records what reaches it
        seen.append(event)
        return core.decide(state, event, now)

    api = CoreApi(decide=spy, state_to_records=core.state_to_records, state_from_records=core.state_from_records,
                  empty_state=core.State.empty)
    metrics, refusals = Metrics(), []
    decider = Decider(api, drv.state, metrics=metrics, on_decision=lambda e, d: None,
                      on_reject=lambda e, r: refusals.append((e.node_id, r)), clock=lambda: drv.now)
    evil = commit(j1[0], "j2", 1, 999_999, "file:///tmp/evil")
    good = hb(drv, j1[0], 3)
    ghost = ev.Heartbeat(node_id="ghost", seq=1, ts=drv.now, state=ev.AgentState.IDLE)
    outcome = decider.decide([evil, good, ghost], clock_every=1)
    assert outcome.failed == [0, 2]
    assert outcome.refused == [0, 2] and seen == [good]
    assert refusals == [(j1[0], "wrong_job"), ("ghost", "unknown_node")]
    assert decider.out.state.jobs["j2"] == drv.state.jobs["j2"] and decider.out.decided == 1
    text = generate_latest(metrics.registry).decode()
    assert 'orchd_messages_rejected_total{kind="CheckpointCommitted",reason="wrong_job"} 1.0' in text
    assert 'orchd_messages_rejected_total{kind="Heartbeat",reason="unknown_node"} 1.0' in text


def test_rejection_log_one_entry_per_sender_and_reason_per_window() -> None:
    from orchestrator.daemon.eventlog import RejectionLog

    log = RejectionLog(window_s=10.0)
    a = ev.NodeLeaving(id="l", node_id="n-a", reason="x", ts=0.0)
    b = ev.NodeLeaving(id="l", node_id="n-b", reason="x", ts=0.0)
    first = log.entry(a, "unknown_node", 100.0)
    assert first is not None and first["count"] == 1 and first["node"] == "n-a" and first["command"] == "rejected"
    assert all(log.entry(a, "unknown_node", 100.0 + i) is None for i in range(1, 10))  # folded
    assert log.entry(a, "wrong_job", 101.0) is not None  # another reason: its own entry
    assert log.entry(b, "unknown_node", 101.0) is not None  # another sender: not delayed by a's noise
    later = log.entry(a, "unknown_node", 110.0)
    assert later is not None and later["count"] == 10  # this one and the 9 folded
    small = RejectionLog(window_s=10.0, max_keys=4)
    for i in range(20):  # bounded memory
        small.entry(ev.NodeLeaving(id="l", node_id=f"n{i}", reason="x", ts=0.0), "unknown_node", 200.0)
    assert len(small._shown) <= 4
