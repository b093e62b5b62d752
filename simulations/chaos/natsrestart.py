"""NATS restart drill: the nats-server is stopped and started again (same port, same store) mid-training.

A job of 2 nodes trains on simulated agents; once it is 30% through, a publisher starts sending price
ticks for ``n_events`` new pools (one every 50 ms, each retried with its own Nats-Msg-Id until the stream
acknowledges it), and the server goes down for a seeded 1-4 s (longer than orchd's 3 s heartbeat timeout)
while they are being sent.

  lost_events          ticks acknowledged by the stream but absent from orchd's state (prices.list) after
                       reconnection, plus node events the agents published that the job does not reflect
                       (the job must still finish: its completion is a node event published after the outage)
  spurious_recoveries  what the outage caused that a real failure would: a new generation, an abandon or
                       checkpoint command, a launch (an instance beyond the job's nodes) before completion
"""

from __future__ import annotations

import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio

import wire as ev
from orchestrator.natsserver import NatsServer
from simulations.chaos import common
from simulations.chaos.agents import SimFleet
from simulations.chaos.harness import Orchd, count_cloud, job_spec


@dataclass
class NatsResult:
    seed: str
    outage_s: float = 0.0
    events_published: int = 0
    lost_events: int = 0
    spurious_recoveries: int = 0
    job_phase: str = ""
    generation_before: int = 0
    generation_after: int = 0
    daemon_crashes: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


async def run(seed: int, root: Path, *, n_events: int = 40, step_s: float = 0.04, total_steps: int = 400,
              converge_s: float = 90.0) -> NatsResult:
    tag = f"{seed}-nats"
    rng = random.Random(tag)
    res = NatsResult(seed=tag)
    t_begin = time.monotonic()
    work = root / "nats-restart"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    server = NatsServer(work / "nats").start()
    server.port = int(server.url.rsplit(":", 1)[1])  # come back on the same port
    orchd = Orchd(work, server.url)
    nc = None
    job_id = "chaos-nats-j0"
    try:
        await anyio.to_thread.run_sync(orchd.start)
        nc = await common.connect(server.url, "chaos-agents")
        fleet = SimFleet(nc, orchd.fake_file, step_s=step_s)
        pools = [ev.PoolKey(cloud="fake", region="r1", zone=f"outage{k}", instance_type="gpu.small",
                            market=ev.Market.SPOT) for k in range(n_events)]
        sent: dict[str, float] = {}
        async with anyio.create_task_group() as tg:
            await tg.start(fleet.run)
            await common.publish_prices(fleet.js, tag)
            client = await common.admin(server.url)
            await common.call(client, "submit", job_spec(job_id, nodes=2, total_steps=total_steps), job_id=job_id)
            with anyio.fail_after(60):
                while not any(n.training and n.step(time.time(), step_s) >= total_steps * 0.3
                              for n in fleet.nodes.values()):
                    await anyio.sleep(0.05)
            await client.close()  # a fail-fast client does not survive the outage; a new one after
            job0 = {c.generation for c in fleet.of_kind(ev.StartGenerationCmd)}
            res.generation_before = max(job0)
            instances_before = count_cloud(orchd.fake_file).instances
            t_outage = time.time()

            async def publisher() -> None:
                for k, pool in enumerate(pools):
                    t = ev.PriceTick(id=f"outage-{k}", pool=pool, gpu_type="A100", gpus_per_node=1,
                                     price_usd_h=1.0 + k / 1000, on_demand_usd_h=3.0, ts=time.time())
                    await common.publish_until_stored(fleet.js, ev.subject_price("fake", "r1"), t, t.id)
                    sent[pool.zone] = t.price_usd_h
                    await anyio.sleep(0.05)

            tg.start_soon(publisher)
            await anyio.sleep(0.3)
            res.outage_s = round(rng.uniform(1.0, 4.0), 2)
            await anyio.to_thread.run_sync(server.stop)
            await anyio.sleep(res.outage_s)
            await anyio.to_thread.run_sync(server.start)
            client = await common.admin(server.url)
            deadline = time.monotonic() + converge_s
            phase = ""
            while time.monotonic() < deadline:
                if orchd.crashed():
                    res.problems.append("orchd died: " + orchd.tail(500))
                    break
                try:
                    jobs = {j["job_id"]: j for j in (await client.jobs()).jobs}
                    phase = jobs[job_id]["phase"]
                except Exception:
                    phase = ""
                if phase in ("succeeded", "failed", "cancelled", "stopped") and len(sent) == len(pools):
                    break
                await anyio.sleep(0.3)
            res.job_phase = phase
            prices = {p["pool"]: p["price_usd_h"] for p in (await common.call(client, "prices")).pools}
            job = (await common.call(client, "job", job_id)).summary
            await client.close()
            tg.cancel_scope.cancel()
        res.events_published = len(sent) + len(fleet.events)
        for pool in pools:
            if pool.zone not in sent or abs(prices.get(pool.name, -1.0) - sent[pool.zone]) > 1e-9:
                res.lost_events += 1
        if res.job_phase != "succeeded":  # its completion is a node event: not reflected = lost
            res.lost_events += 1
            res.problems.append(f"job {job_id} {res.job_phase} step {job.get('step')}")
        res.generation_after = job["generation"]
        after = [c for c in fleet.of_kind(ev.AbandonGenerationCmd, since=t_outage)]
        after += [c for c in fleet.of_kind(ev.CheckpointCmd, since=t_outage)]
        after += [c for c in fleet.of_kind(ev.StartGenerationCmd, since=t_outage)]
        extra = count_cloud(orchd.fake_file).instances - instances_before
        res.spurious_recoveries = len(after) + max(0, extra)
        if after or extra:
            res.problems.append(f"after the outage: {[type(c).__name__ for c in after]}, {extra} new instance(s)")
        await anyio.to_thread.run_sync(orchd.stop)
    finally:
        await common.shutdown(orchd, server, nc)
    res.daemon_crashes = orchd.crashes
    res.seconds = round(time.monotonic() - t_begin, 2)
    return res


def as_dict(r: NatsResult) -> dict[str, Any]:
    return asdict(r)
