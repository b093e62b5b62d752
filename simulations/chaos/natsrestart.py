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
from orchestrator.cli.client import AdminClient
from orchestrator.natsserver import NatsServer
from simulations.chaos import common
from simulations.chaos.agents import SimFleet
from simulations.chaos.harness import Orchd, count_cloud, job_spec

JOB_ID = "chaos-nats-j0"


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
    try:
        await anyio.to_thread.run_sync(orchd.start)
        nc = await common.connect(server.url, "chaos-agents")
        drill = _Drill(server, orchd, SimFleet(nc, orchd.fake_file, step_s=step_s), res, n_events)
        async with anyio.create_task_group() as tg:
            await tg.start(drill.fleet.run)
            await common.publish_prices(drill.fleet.js, tag)
            await drill.train_to(0.3, total_steps, step_s)
            tg.start_soon(drill.publisher)
            await anyio.sleep(0.3)
            await drill.outage(round(rng.uniform(1.0, 4.0), 2))
            client = await common.admin(server.url)
            res.job_phase = await drill.converge(client, converge_s)
            prices = {p["pool"]: p["price_usd_h"] for p in (await common.call(client, "prices")).pools}
            job = (await common.call(client, "job", JOB_ID)).summary
            await client.close()
            tg.cancel_scope.cancel()
        drill.score(prices, job)
        await anyio.to_thread.run_sync(orchd.stop)
    finally:
        await common.shutdown(orchd, server, nc)
    res.daemon_crashes = orchd.crashes
    res.seconds = round(time.monotonic() - t_begin, 2)
    return res


class _Drill:
    """The job, the price ticks sent across the outage, the outage itself, and the scoring."""

    def __init__(self, server: NatsServer, orchd: Orchd, fleet: SimFleet, res: NatsResult, n_events: int) -> None:
        self.server, self.orchd, self.fleet, self.res = server, orchd, fleet, res
        self.pools = [ev.PoolKey(cloud="fake", region="r1", zone=f"outage{k}", instance_type="gpu.small",
                                 market=ev.Market.SPOT) for k in range(n_events)]
        self.sent: dict[str, float] = {}  # zone -> the price acknowledged by the stream
        self.instances_before = 0
        self.t_outage = 0.0

    async def train_to(self, fraction: float, total_steps: int, step_s: float) -> None:
        """Submit the job and wait until a node is ``fraction`` through; note what exists before the outage."""
        client = await common.admin(self.server.url)
        await common.call(client, "submit", job_spec(JOB_ID, nodes=2, total_steps=total_steps), job_id=JOB_ID)
        with anyio.fail_after(60):
            while not any(n.training and n.step(time.time(), step_s) >= total_steps * fraction
                          for n in self.fleet.nodes.values()):
                await anyio.sleep(0.05)
        await client.close()  # a fail-fast client does not survive the outage; a new one after
        self.res.generation_before = max({c.generation for c in self.fleet.of_kind(ev.StartGenerationCmd)})
        self.instances_before = count_cloud(self.orchd.fake_file).instances
        self.t_outage = time.time()

    async def publisher(self) -> None:
        for k, pool in enumerate(self.pools):
            t = ev.PriceTick(id=f"outage-{k}", pool=pool, gpu_type="A100", gpus_per_node=1,
                             price_usd_h=1.0 + k / 1000, on_demand_usd_h=3.0, ts=time.time())
            await common.publish_until_stored(self.fleet.js, ev.subject_price("fake", "r1"), t, t.id)
            self.sent[pool.zone] = t.price_usd_h
            await anyio.sleep(0.05)

    async def outage(self, seconds: float) -> None:
        self.res.outage_s = seconds
        await anyio.to_thread.run_sync(self.server.stop)
        await anyio.sleep(seconds)
        await anyio.to_thread.run_sync(self.server.start)

    async def converge(self, client: AdminClient, converge_s: float) -> str:
        """The job's phase once it is terminal and every tick was sent (or ``converge_s`` passed)."""
        deadline = time.monotonic() + converge_s
        phase = ""
        while time.monotonic() < deadline:
            if self.orchd.crashed():
                self.res.problems.append("orchd died: " + self.orchd.tail(500))
                break
            try:
                jobs = {j["job_id"]: j for j in (await client.jobs()).jobs}
                phase = jobs[JOB_ID]["phase"]
            except Exception:
                phase = ""
            if phase in ("succeeded", "failed", "cancelled", "stopped") and len(self.sent) == len(self.pools):
                break
            await anyio.sleep(0.3)
        return phase

    def score(self, prices: dict[str, float], job: dict[str, Any]) -> None:
        res, fleet, t_outage = self.res, self.fleet, self.t_outage
        res.events_published = len(self.sent) + len(fleet.events)
        for pool in self.pools:
            if pool.zone not in self.sent or abs(prices.get(pool.name, -1.0) - self.sent[pool.zone]) > 1e-9:
                res.lost_events += 1
        if res.job_phase != "succeeded":  # its completion is a node event: not reflected = lost
            res.lost_events += 1
            res.problems.append(f"job {JOB_ID} {res.job_phase} step {job.get('step')}")
        res.generation_after = job["generation"]
        after = [c for c in fleet.of_kind(ev.AbandonGenerationCmd, since=t_outage)]
        after += [c for c in fleet.of_kind(ev.CheckpointCmd, since=t_outage)]
        after += [c for c in fleet.of_kind(ev.StartGenerationCmd, since=t_outage)]
        extra = count_cloud(self.orchd.fake_file).instances - self.instances_before
        res.spurious_recoveries = len(after) + max(0, extra)
        if after or extra:
            res.problems.append(f"after the outage: {[type(c).__name__ for c in after]}, {extra} new instance(s)")


def as_dict(r: NatsResult) -> dict[str, Any]:
    return asdict(r)
