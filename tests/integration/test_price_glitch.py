"""Two signals before a price moves money, on a real orchd (in-process, the real core) over a real
nats-server, with a fake cloud that has a configured catalog (one instance type, like a real provider).

- A glitch shorter than ``price_confirm_s`` - a 1000x-ish spike of the running pool, an on-demand price of
  0.0001 - moves nothing: no checkpoint, no launch, no terminate.
- A pool of an instance type no provider offers, quoted at 0.0001 and held, is never a launch target: a
  new job launches in the catalog's type (``known_instance_types`` from the providers).
- The same spike, held for longer than ``price_confirm_s``, pauses the job (a checkpoint ordered).
"""

from __future__ import annotations

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

CONFIRM_S = 1.5
UNKNOWN = ev.PoolKey(cloud="fake", region="r1", zone="r1a", instance_type="gpu.unknown", market=ev.Market.SPOT)


async def _ticks(js, pool: ev.PoolKey, usd: float, od: float, seconds: float, every: float = 0.25) -> None:
    end = time.monotonic() + seconds
    while True:
        await h.publish_js(js, ev.subject_price(pool.cloud, pool.region), h.price(pool, usd, od))
        if time.monotonic() >= end:
            return
        await anyio.sleep(every)


async def test_glitches_move_nothing_unknown_pools_are_never_targets_and_held_prices_act(server, tmp_path):
    url = server.url
    cfg = h.write_config(tmp_path, url)
    cfg.write_text(cfg.read_text().replace("price_confirm_s = 0.0", f"price_confirm_s = {CONFIRM_S}"))
    cloud = FakeCloud(pools=[h.POOL, h.POOL_OD])
    nc = await nats.connect(url)
    js = nc.jetstream()
    agent = await h.SimAgent(nc).start()
    async with anyio.create_task_group() as tg:
        d = await tg.start(lambda task_status: run_daemon(load_settings(cfg, env={}), {"fake": cloud},
                                                          task_status=task_status))
        assert d.state.config.known_instance_types == ("fake/gpu.small",)
        await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL, 1.0, 3.0))
        await h.wait_for(lambda: d.state.pools.get(h.POOL.name) is not None
                         and d.state.pools[h.POOL.name].price_usd_h == 1.0)
        job = await submit(url, tmp_path, "steady", f"file://{tmp_path}/a")
        (inst,) = await h.wait_for(lambda: cloud.all_instances())
        await h.publish_js(js, ev.subject_node_event(inst.node_id), ev.NodeRegistered(
            id="reg-1", node_id=inst.node_id, instance_id=inst.instance_id, pool=inst.pool, host="127.0.0.1",
            ts=time.time()))
        await h.wait_for(lambda: agent.of_kind(ev.StartGenerationCmd))
        await h.publish_js(js, ev.subject_node_event(inst.node_id), ev.GenerationStarted(
            id="gs-1", node_id=inst.node_id, job_id=job, generation=1, first_step=1, ts=time.time()))
        await h.wait_for(lambda: d.state.jobs[job].phase == "running")

        async def beat() -> None:  # the trainer is alive throughout
            seq = 0
            while True:
                seq += 1
                await nc.publish(ev.subject_heartbeat(inst.node_id), ev.encode(ev.Heartbeat(
                    node_id=inst.node_id, seq=seq, ts=time.time(), state=ev.AgentState.TRAINING, job_id=job,
                    generation=1, step=seq)))
                await anyio.sleep(0.3)

        tg.start_soon(beat)
        # glitches: the running pool at 0.98 of on-demand (above pause_above_ratio) for 0.5 s, an on-demand
        # price of 0.0001 for 0.5 s; and a pool of an unknown type at 0.0001, held for twice the confirmation
        await _ticks(js, h.POOL, 2.95, 3.0, 0.5)
        await _ticks(js, h.POOL, 1.0, 3.0, 0.0)
        await _ticks(js, h.POOL_OD, 0.0001, 0.0001, 0.5)
        await _ticks(js, h.POOL_OD, 3.0, 3.0, 0.0)
        await _ticks(js, UNKNOWN, 0.0001, 3.0, 2 * CONFIRM_S)
        await anyio.sleep(CONFIRM_S + 1.0)  # every glitch is long over; the unknown pool's price confirmed
        assert d.state.pools[UNKNOWN.name].price_usd_h == 0.0001
        assert not agent.of_kind(ev.CheckpointCmd) and d.state.jobs[job].phase == "running"
        assert (cloud.launch_calls, cloud.terminate_calls) == (1, 0)

        # a new job: the 0.0001 pool is cheaper, but no provider offers its type
        job2 = await submit(url, tmp_path, "new", f"file://{tmp_path}/b")
        await h.wait_for(lambda: len(cloud.all_instances()) == 2)
        assert {i.pool.instance_type for i in cloud.all_instances()} == {"gpu.small"}
        assert all(n.pool.instance_type == "gpu.small" for n in d.state.nodes.values() if n.job_id == job2)

        # the same spike, held: the running job pauses (checkpoint first)
        await _ticks(js, h.POOL, 2.95, 3.0, CONFIRM_S + 1.5)
        cps = await h.wait_for(lambda: [c for c in agent.of_kind(ev.CheckpointCmd) if c.node_id == inst.node_id])
        assert cps[0].reason == "price_pause"
        d.request_stop()
        tg.cancel_scope.cancel()
    await nc.close()
