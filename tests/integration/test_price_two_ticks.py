"""A price moves only after two observations, on a real orchd (in-process, the real core) over a real
nats-server: one tick for a known pool at 0.01 $/h (from 1.3) and silence after it is never confirmed -
the running job is not moved, nothing is launched, ``orchctl prices`` keeps 1.3 - however many Ticks pass;
a second tick that agrees confirms it."""

from __future__ import annotations

import json
import time

import anyio
import nats
import pytest

import wire as ev
from orchestrator.daemon.run import run_daemon
from orchestrator.settings import load_settings
from simulations.fakecloud import FakeCloud
from tests.integration import helpers as h
from tests.integration.test_trust_gate import submit

pytestmark = pytest.mark.anyio

CONFIRM_S = 1.0
POOL_B = ev.PoolKey(cloud="fake", region="r1", zone="r1b", instance_type="gpu.small", market=ev.Market.SPOT)


async def _price_of(url: str, pool: ev.PoolKey) -> float:
    code, out, err = await h.actl(url, "prices", "-o", "json")
    assert code == 0, err
    data = json.loads(out)
    rows = data["pools"] if isinstance(data, dict) else data
    (row,) = [r for r in rows if pool.name in (r.get("pool"), r.get("name"))]
    return float(row["price_usd_h"])


async def test_one_tick_and_silence_moves_nothing_a_second_tick_does(server, tmp_path):
    url = server.url
    cfg = h.write_config(tmp_path, url)
    cfg.write_text(cfg.read_text().replace("price_confirm_s = 0.0", f"price_confirm_s = {CONFIRM_S}"))
    cloud = FakeCloud(pools=[h.POOL, h.POOL_OD, POOL_B])
    nc = await nats.connect(url)
    js = nc.jetstream()
    agent = await h.SimAgent(nc).start()
    subject = ev.subject_price("fake", "r1")
    async with anyio.create_task_group() as tg:
        d = await tg.start(lambda task_status: run_daemon(load_settings(cfg, env={}), {"fake": cloud},
                                                          task_status=task_status))
        for pool in (h.POOL, POOL_B):
            await h.publish_js(js, subject, h.price(pool, 1.3, 3.0))
        await h.wait_for(lambda: all(d.state.pools.get(p.name) and d.state.pools[p.name].price_usd_h == 1.3
                                     for p in (h.POOL, POOL_B)))
        job = await submit(url, tmp_path, "steady", f"file://{tmp_path}/a")
        (inst,) = await h.wait_for(lambda: cloud.all_instances())
        await h.publish_js(js, ev.subject_node_event(inst.node_id), ev.NodeRegistered(
            id="reg-1", node_id=inst.node_id, instance_id=inst.instance_id, pool=inst.pool, host="127.0.0.1",
            ts=time.time()))
        await h.wait_for(lambda: agent.of_kind(ev.StartGenerationCmd))
        await h.publish_js(js, ev.subject_node_event(inst.node_id), ev.GenerationStarted(
            id="gs-1", node_id=inst.node_id, job_id=job, generation=1, first_step=1, ts=time.time()))
        await h.wait_for(lambda: d.state.jobs[job].phase == "running")
        launches = cloud.launch_calls

        await h.publish_js(js, subject, h.price(POOL_B, 0.01, 3.0))  # one tick, then silence
        await h.wait_for(lambda: d.state.pools[POOL_B.name].seen_usd_h == 0.01)  # pending
        await anyio.sleep(6 * CONFIRM_S)  # a dozen Ticks, six times price_confirm_s
        assert d.state.pools[POOL_B.name].price_usd_h == 1.3 and await _price_of(url, POOL_B) == 1.3
        assert not agent.of_kind(ev.CheckpointCmd) and cloud.launch_calls == launches
        assert d.state.jobs[job].phase == "running"

        await h.publish_js(js, subject, h.price(POOL_B, 0.01, 3.0))  # the second observation
        await h.wait_for(lambda: d.state.pools[POOL_B.name].price_usd_h == 0.01)
        assert await _price_of(url, POOL_B) == 0.01
        d.request_stop()
        tg.cancel_scope.cancel()
    await nc.close()
