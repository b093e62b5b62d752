"""Hostile numbers against a real nats-server and a real orchd (security issue items 3 and 7).

A 1e308 price tick once overflowed a job's ``cost_usd`` to inf, persisted as JSON null: no orchd could
load the state again, and the same tick hard-stopped a job with $1,000 of budget. A notice with
``deadline_ts`` = 1e300 closed its pool for good. Here: both go through JetStream into orchd, which
keeps running; the state it wrote loads in a fresh ``Store.load`` + ``state_from_records``; the budget
job is not stopped; the pool reopens after the (clamped) deadline + grace.
"""

from __future__ import annotations

import dataclasses
import math
import time

import anyio
import msgspec
import nats
import pytest

import wire as ev
from orchestrator import bus
from orchestrator.cli.client import AdminClient
from orchestrator.core import CoreConfig, JobPhase, State, state_from_records, state_to_records
from orchestrator.core.placement import ranked
from orchestrator.daemon.coreapi import default_core
from orchestrator.daemon.run import run_daemon
from orchestrator.daemon.store import Store
from orchestrator.jobspec import parse_jobspec
from simulations.fakecloud import FakeCloud
from tests.integration import helpers as h

pytestmark = pytest.mark.anyio
R = msgspec.structs.replace
WINDOW_S, GRACE_S = 2.0, 1.0  # the fake cloud's notice window and the skip grace, short for the test



def _core(settings):
    cfg = CoreConfig(heartbeat_timeout_s=settings.daemon.heartbeat_timeout_s, tick_s=settings.daemon.tick_s,
                     notice_window_default_s=WINDOW_S, notice_skip_grace_s=GRACE_S,
                     price_confirm_s=settings.daemon.price_confirm_s)
    return dataclasses.replace(default_core(settings), empty_state=lambda: State.empty(cfg),
                               configure=lambda s: R(s, meta=R(s.meta, config=cfg)))


def _rejected(d, reason: str) -> float:
    return sum(s.value for m in d.metrics.rejected.collect() for s in m.samples
               if s.name.endswith("_total") and s.labels.get("reason") == reason)


def _decided(d, event_type: str) -> float:
    return sum(s.value for m in d.metrics.events.collect() for s in m.samples
               if s.name.endswith("_total") and s.labels.get("type") == event_type)


async def _running_job(d, js, nc, cloud: FakeCloud) -> tuple[str, list[str]]:
    await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL, 1.0, 3.0))
    await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL_OD, 3.0, 3.0))
    await h.wait_for(lambda: len(d.state.pools) == 2)
    client = await AdminClient.connect([d.nats_url])
    reply = await client.submit(parse_jobspec("budget_usd = 1000.0\n" + h.JOB_TOML.format(nodes=2)))
    await client.close()
    job_id = reply.job_id
    await h.wait_for(lambda: len(cloud.all_instances()) == 2)
    for inst in cloud.all_instances():
        reg = ev.NodeRegistered(id=f"reg-{inst.node_id}", node_id=inst.node_id, instance_id=inst.instance_id,
                                pool=inst.pool, host="127.0.0.1", ts=time.time())
        await h.publish_js(js, ev.subject_node_event(inst.node_id), reg)
    await h.wait_for(lambda: d.state.jobs[job_id].phase == JobPhase.STARTING)
    nodes = list(d.state.jobs[job_id].gen_nodes)
    for nid in nodes:
        hb = ev.Heartbeat(node_id=nid, seq=1, ts=time.time(), state=ev.AgentState.TRAINING, job_id=job_id,
                          generation=d.state.jobs[job_id].generation, step=5)
        await nc.publish(ev.subject_heartbeat(nid), ev.encode(hb))
    await h.wait_for(lambda: d.state.jobs[job_id].phase == JobPhase.RUNNING)
    return job_id, nodes


async def test_absurd_tick_and_far_future_notice_orchd_survives_state_loads(server, tmp_path):
    url = server.url
    settings = h.settings_for(tmp_path, url)
    cloud = FakeCloud()
    nc = await nats.connect(url)
    js = nc.jetstream()
    agent = await h.SimAgent(nc).start()
    async with anyio.create_task_group() as tg:
        d = await tg.start(lambda task_status: run_daemon(settings, {"fake": cloud}, core=_core(settings),
                                                          task_status=task_status))
        job_id, nodes = await _running_job(d, js, nc, cloud)
        subject = ev.subject_price("fake", "r1")
        # 1e308 $/h: refused by the screen (bad_value), never reaches the core
        await h.publish_js(js, subject, h.price(h.POOL, 1e308, 1e308))
        await h.wait_for(lambda: _rejected(d, "bad_value") >= 1)
        # within the screen's ceiling but 100 x the pool's on-demand price: the core's band ignores it
        ticks = _decided(d, "PriceTick")
        await h.publish_js(js, subject, R(h.price(h.POOL, 300.0, 3.0), on_demand_usd_h=None, id="band"))
        await h.wait_for(lambda: _decided(d, "PriceTick") > ticks)
        assert d.state.pools[h.POOL.name].price_usd_h == 1.0
        await h.publish_js(js, subject, h.price(h.POOL, 1.5, 3.0))  # an honest tick after them: decided
        await h.wait_for(lambda: d.state.pools[h.POOL.name].price_usd_h == 1.5)
        assert d.state.pools[h.POOL.name].on_demand_usd_h == 3.0
        assert d.state.jobs[job_id].phase == JobPhase.RUNNING  # the budget job was not stopped

        # a notice far in the future (a wrong clock): clamped to the fake cloud's window, checkpoint sent
        t0 = time.time()
        notice = ev.PreemptionNotice(id="notice-far", node_id=nodes[0], cloud="fake", deadline_ts=1e300,
                                     observed_ts=1e300)
        await h.publish_js(js, ev.subject_notice("fake", nodes[0]), notice)
        ckpts = await h.wait_for(lambda: len(agent.of_kind(ev.CheckpointCmd)) == 2 and agent.of_kind(ev.CheckpointCmd))
        t1 = time.time()
        assert all(t0 <= c.deadline_ts <= t1 + WINDOW_S for c in ckpts)
        until = d.state.pools[h.POOL.name].noticed_until
        assert t0 + GRACE_S <= until <= t1 + WINDOW_S + GRACE_S
        job = d.state.jobs[job_id]
        assert job.phase != JobPhase.STOPPED and job.reason != "budget"

        def spot_open(now: float) -> bool:
            rank = ranked(d.state.pools, d.state.jobs[job_id], 1, 0, d.state.config, now,
                          markets=frozenset({ev.Market.SPOT}))
            return any(name == h.POOL.name for _, name, _ in rank)

        assert not spot_open(time.time())
        await anyio.sleep(max(0.0, until - time.time()) + 0.2)
        assert spot_open(time.time())  # reopened after deadline + grace
        await h.publish_js(js, subject, h.price(h.POOL, 1.6, 3.0))
        await h.wait_for(lambda: d.state.pools[h.POOL.name].price_usd_h == 1.6)  # orchd still deciding
        final = d.state
        d.request_stop()

    # a fresh load of what orchd wrote: every record decodes, no null where a float belongs
    nc2 = await nats.connect(url)
    try:
        records, _ = await Store(await bus.ensure_topology(nc2)).load()
    finally:
        await nc2.close()
    assert not any(b'_usd":null' in v for v in records.values())
    loaded = state_from_records(records)
    job = loaded.jobs[job_id]
    assert math.isfinite(job.cost_usd) and job.phase != JobPhase.STOPPED
    ps = loaded.pools[h.POOL.name]
    assert ps.noticed_until == final.pools[h.POOL.name].noticed_until <= t1 + WINDOW_S + GRACE_S
    assert ps.price_usd_h == 1.6
    assert state_from_records(state_to_records(loaded)) == loaded
    await nc.close()


# --- the screen's bounds (pure: no server) --------------------------------------------------------------


def _hb(**kw) -> ev.Heartbeat:
    return ev.Heartbeat(**{**dict(node_id="n", seq=1, ts=1.0, state=ev.AgentState.TRAINING), **kw})


@pytest.mark.parametrize("msg", [
    h.price(h.POOL, 1e308, 3.0), h.price(h.POOL, 1.0, 1e308), h.price(h.POOL_OD, 1001.0, 1001.0),
    h.price(h.POOL, 31.0, 3.0),  # spot above 10 x the tick's on-demand price
    h.price(h.POOL, 5e-324, 3.0), h.price(h.POOL, 1.0, 5e-324),  # a "free" pool by a denormal price
    msgspec.structs.replace(h.price(h.POOL, 1.0, 3.0), gpus_per_node=2**63),
])
def test_screen_refuses_prices_out_of_bounds(msg) -> None:
    from orchestrator.daemon.admit import screen

    assert screen("orch.price.fake.r1", msg) == "bad_value"
    assert screen("orch.price.fake.r1", h.price(h.POOL, 29.0, 3.0)) is None


def test_screen_bounds_agent_numbers_but_never_a_notices_timestamps() -> None:
    from orchestrator.daemon.admit import MAX_DURATION_S, MAX_STEP, screen
    from orchestrator.daemon.admit import screen_hb as screen_heartbeat

    subj = "orch.node.n.hb"
    assert screen_heartbeat(subj, _hb(step=MAX_STEP, step_time_s=MAX_DURATION_S)) is None
    for bad in (_hb(step=MAX_STEP + 1), _hb(generation=2**40), _hb(step_time_s=1e308), _hb(step_time_s=-1.0),
                _hb(step_time_s=math.nan)):
        assert screen_heartbeat(subj, bad) == "bad_value"
    c = ev.CheckpointCommitted(id="c", node_id="n", job_id="j", generation=1, step=1, checkpoint_id="s", url="u",
                               save_s=1e308, ts=1.0)
    assert screen("orch.node.n.event", c) == "bad_value"
    assert screen("orch.node.n.event", R(c, save_s=1.0, deadline_margin_s=-1e308)) == "bad_value"
    assert screen("orch.node.n.event", R(c, save_s=1.0, step=2**60)) == "bad_value"
    r = ev.RanksExited(id="r", node_id="n", job_id="j", generation=1, exit_code=0, reason="completed",
                       last_step=2**60, ts=1.0)
    assert screen("orch.node.n.event", r) == "bad_value"
    for deadline, observed in ((1e300, 1e300), (-1e300, -5.0), (None, 0.0)):
        n = ev.PreemptionNotice(id="x", node_id="n", cloud="fake", deadline_ts=deadline, observed_ts=observed)
        assert screen("orch.notice.fake.n", n) is None
