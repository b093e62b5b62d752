"""kill -9 drill: orchd SIGKILLed at seeded random points of a job's life, restarted, left to converge.

One iteration: a fresh nats-server and state, orchd as a subprocess with the file-backed fake cloud,
simulated agents, prices for two spot pools of one zone; 1-2 jobs of 1-3 nodes are submitted (with
explicit job ids, so a submit cut by a kill is retried idempotently); the first job gets a preemption
notice once it is a quarter through (emergency checkpoint + replacement from the other pool + a new
generation). 1..``max_kills`` kill points are drawn (seeded) from ``KILL_POINTS``; at each, after a
random 0-0.4 s, orchd gets SIGKILL, stays dead 0-1 s, and is started again on the same state.

A burst iteration (``burst=True``) is a zone going away: 3-4 jobs of 2-3 nodes, and once every job is
training and the first is a quarter through, every training node gets a notice, spread over
``BURST_S``; the first kill lands inside the burst (0-``BURST_S`` after its first notice: checkpoint
commands sent, maybe not yet stored), then up to ``max_kills`` - 1 more at later points of
``KILL_POINTS``.

Counted on the provider side (the fake cloud's file), never from orchd's state:
  duplicate_launches  instances beyond the first for one node id (each node id is launched once; a retried
                      launch must reuse its idempotency token)
  leaked_instances    instances still alive after every job finished, orchd stopped, and the reaper ran with
                      its grace elapsed (``orphans_reaped`` says how many only the reaper caught)
and from the admin API: lost_jobs (a submitted job unknown after the restarts), unfinished_jobs (not
succeeded within ``converge_s``).
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
from providers.reaper import Reaper
from simulations.chaos import common
from simulations.chaos.agents import SimFleet
from simulations.chaos.harness import CLUSTER_ID, Orchd, count_cloud, job_spec
from simulations.fakecloud import FileFakeCloud

KILL_POINTS = ("placement", "mid_launch", "registration", "generation_start", "mid_generation",
               "emergency_checkpoint", "checkpoint_commit", "regrow", "completion")
"""In the order they happen in a job's life; a drawn point that never comes (e.g. no regrow) is skipped."""

TERMINAL = {"succeeded", "failed", "cancelled", "stopped"}

BURST_S = 0.5
"""A burst iteration's notices are spread over this long (the zone's nodes noticed one after another)."""
AFTER_BURST = ("checkpoint_commit", "regrow", "completion")


@dataclass
class KillResult:
    iteration: int
    seed: str
    kills: int = 0
    kill_points: list[str] = field(default_factory=list)
    skipped_points: list[str] = field(default_factory=list)
    notices: int = 0
    burst: bool = False
    jobs: int = 0
    lost_jobs: int = 0
    unfinished_jobs: int = 0
    duplicate_launches: int = 0
    alive_duplicates: int = 0
    leaked_instances: int = 0
    orphans_reaped: int = 0
    instances: int = 0
    generations: dict[str, int] = field(default_factory=dict)
    daemon_crashes: int = 0
    cmd_id_reused: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


def _trigger(name: str, fleet: SimFleet, orchd: Orchd, state: dict) -> bool:
    f = fleet
    match name:
        case "placement":
            return state["submitting"]
        case "mid_launch":
            return count_cloud(orchd.fake_file).instances > 0
        case "registration":
            return bool(f.events_of(ev.NodeRegistered))
        case "generation_start":
            return bool(f.of_kind(ev.StartGenerationCmd))
        case "mid_generation":
            now = time.time()
            return any(n.training and n.step(now, f.step_s) >= n.total_steps * 0.3 for n in f.nodes.values())
        case "emergency_checkpoint" | "notice_burst":
            return bool(f.events_of(ev.PreemptionNotice))
        case "checkpoint_commit":
            return bool(f.events_of(ev.CheckpointCommitted))
        case "regrow":
            return any(c.generation >= 2 for c in f.of_kind(ev.StartGenerationCmd))
        case "completion":
            return any(e.reason == "completed" for e in f.events_of(ev.RanksExited))
    raise ValueError(name)


async def run_iteration(i: int, seed: int, root: Path, *, max_kills: int = 3, converge_s: float = 90.0,
                        step_s: float = 0.03, burst: bool = False) -> KillResult:
    tag = f"{seed}-{'burst' if burst else 'kill'}-{i}"
    rng = random.Random(tag)
    res = KillResult(iteration=i, seed=tag, burst=burst)
    t_begin = time.monotonic()
    work = root / f"{'burst' if burst else 'kill'}-{i}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    server = NatsServer(work / "nats").start()
    orchd = Orchd(work, server.url)
    nc = None
    try:
        await anyio.to_thread.run_sync(orchd.start)
        nc = await common.connect(server.url, "chaos-agents")
        drill = _Drill(i, rng, res, orchd, SimFleet(nc, orchd.fake_file, step_s=step_s), max_kills, burst)
        client = await common.admin(server.url)
        await drill.run(client, tag, converge_s)
        res.cmd_id_reused = drill.fleet.cmd_id_reused
        jobs, nodes = await _final_word(client, drill.specs, res)
        await anyio.to_thread.run_sync(orchd.stop)
        _reap(orchd, jobs, nodes, res)
    finally:
        await common.shutdown(orchd, server, nc)
    res.daemon_crashes = orchd.crashes
    res.seconds = round(time.monotonic() - t_begin, 2)
    return res


class _Drill:
    """One iteration on a running orchd: the jobs, the kill plan and the notice (all drawn from ``rng``
    here, in this order), then submissions, kills and the notice concurrently until the jobs converge."""

    def __init__(self, i: int, rng: random.Random, res: KillResult, orchd: Orchd, fleet: SimFleet,
                 max_kills: int, burst: bool = False) -> None:
        self.rng, self.res, self.orchd, self.fleet, self.burst = rng, res, orchd, fleet, burst
        n_jobs = rng.choice((3, 4)) if burst else rng.choice((1, 1, 2))
        low = 2 if burst else 1
        self.specs = {f"chaos{i}-j{k}": job_spec(f"chaos{i}-j{k}", nodes=rng.randint(low, 3),
                                                 total_steps=rng.randint(80, 160)) for k in range(n_jobs)}
        res.jobs = n_jobs
        if burst:
            later = sorted(rng.sample(AFTER_BURST, rng.randint(0, max_kills - 1)), key=AFTER_BURST.index)
            self.plan = [("notice_burst", rng.uniform(0.0, BURST_S), rng.uniform(0.0, 1.0)),
                         *((p, rng.uniform(0.0, 0.4), rng.uniform(0.0, 1.0)) for p in later)]
        else:
            points = sorted(rng.sample(KILL_POINTS, rng.randint(1, max_kills)), key=KILL_POINTS.index)
            self.plan = [(p, rng.uniform(0.0, 0.4), rng.uniform(0.0, 1.0)) for p in points]
        self.state = {"submitting": False, "done": False}
        self.first_job = next(iter(self.specs))

    async def run(self, client: AdminClient, tag: str, converge_s: float) -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(self.fleet.run)
            await common.publish_prices(self.fleet.js, tag)
            tg.start_soon(self.injector)
            tg.start_soon(self.zone_goes_away if self.burst else self.noticer)
            self.state["submitting"] = True
            await self.submit_all(client)
            await self.converge(client, converge_s)
            self.state["done"] = True
            tg.cancel_scope.cancel()

    async def injector(self) -> None:
        """At each planned point: wait for it (skipped if it never comes), then kill -9, stay down, restart."""
        res, orchd = self.res, self.orchd
        for point, delay, down in self.plan:
            while not _trigger(point, self.fleet, orchd, self.state):
                if self.state["done"]:
                    res.skipped_points.append(point)
                    break
                await anyio.sleep(0.02)
            else:
                await anyio.sleep(delay)
                if self.state["done"]:
                    res.skipped_points.append(point)
                    continue
                await anyio.to_thread.run_sync(orchd.kill9)
                res.kills += 1
                res.kill_points.append(point)
                await anyio.sleep(down)
                await anyio.to_thread.run_sync(orchd.start)

    async def noticer(self) -> None:
        """One preemption notice to a node of the first job, once it is a quarter through."""
        fleet = self.fleet
        while not self.state["done"]:
            now = time.time()
            victims = [n for n in fleet.nodes.values() if n.training and n.job_id == self.first_job
                       and n.step(now, fleet.step_s) >= n.total_steps * 0.25]
            if victims:
                fleet.publish_notice(self.rng.choice(sorted(victims, key=lambda n: n.node_id)).node_id)
                self.res.notices += 1
                return
            await anyio.sleep(0.05)

    async def zone_goes_away(self) -> None:
        """Once every job trains and the first is a quarter through: a notice to every training node,
        one after another over ``BURST_S``."""
        fleet = self.fleet
        while not self.state["done"]:
            now = time.time()
            training = sorted((n for n in fleet.nodes.values() if n.training), key=lambda n: (n.job_id, n.node_id))
            first = [n for n in training if n.job_id == self.first_job]
            if ({n.job_id for n in training} >= set(self.specs)
                    and any(n.step(now, fleet.step_s) >= n.total_steps * 0.25 for n in first)):
                for node in training:
                    fleet.publish_notice(node.node_id)
                    self.res.notices += 1
                    await anyio.sleep(BURST_S / len(training))
                return
            await anyio.sleep(0.05)

    async def submit_all(self, client: AdminClient) -> None:
        for job_id, spec in self.specs.items():
            while True:  # a submit cut by a kill: the same job id again (idempotent)
                try:
                    await common.call(client, "submit", spec, job_id=job_id)
                    break
                except Exception:
                    await anyio.sleep(0.2)

    async def converge(self, client: AdminClient, converge_s: float) -> None:
        """Until every job is terminal and no instance is alive (or ``converge_s`` passed)."""
        orchd = self.orchd
        deadline = time.monotonic() + converge_s
        while time.monotonic() < deadline:
            if orchd.crashed():  # died without our SIGKILL: counted, and restarted like systemd would
                self.res.problems.append("orchd died on its own: " + orchd.tail(500))
                await anyio.to_thread.run_sync(orchd.start)
            try:
                jobs = (await client.jobs()).jobs
            except Exception:
                jobs = None
            if jobs is not None:
                phases = {j["job_id"]: j["phase"] for j in jobs}
                if all(phases.get(j) in TERMINAL for j in self.specs) and count_cloud(orchd.fake_file).alive == 0:
                    return
            await anyio.sleep(0.3)


async def _final_word(client: AdminClient, specs: dict[str, ev.JobSpec],
                      res: KillResult) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """The jobs and nodes as orchd (maybe restarting after the last kill) reports them; lost and
    unfinished jobs counted."""
    jobs = {j["job_id"]: j for j in (await common.call(client, "jobs")).jobs}
    nodes = (await common.call(client, "nodes")).nodes
    await client.close()
    for job_id in specs:
        if job_id not in jobs:
            res.lost_jobs += 1
            res.problems.append(f"lost {job_id}")
        elif jobs[job_id]["phase"] != "succeeded":
            res.unfinished_jobs += 1
            res.problems.append(f"{job_id} {jobs[job_id]['phase']} ({jobs[job_id]['reason']}) "
                                f"step {jobs[job_id]['step']}/{jobs[job_id]['total_steps']}")
        if job_id in jobs:
            res.generations[job_id] = jobs[job_id]["generation"]
    return jobs, nodes


def _reap(orchd: Orchd, jobs: dict[str, dict[str, Any]], nodes: list[dict[str, Any]], res: KillResult) -> None:
    """The reaper, with its grace elapsed, over the cloud as the stopped orchd left it; then the count."""
    before = count_cloud(orchd.fake_file)
    cloud = FileFakeCloud(orchd.fake_file)
    known = {n["node_id"]: (jobs.get(n["job_id"], {}).get("phase", "deleted"), n["instance_id"]) for n in nodes}
    reaper = Reaper({"fake": cloud}, cluster_id=CLUSTER_ID, grace_s=0.0)
    report = reaper.reconcile(known, state_ok=True, allow_empty_state=True)
    res.orphans_reaped = sum(len(v) for v in report.terminated.values())
    if before.alive:
        res.problems.append(f"{before.alive} instance(s) alive after convergence, before the reaper")
    after = count_cloud(orchd.fake_file)
    res.leaked_instances = after.alive
    res.duplicate_launches = after.duplicate_launches
    res.alive_duplicates = after.alive_duplicates
    res.instances = after.instances


def as_dict(r: KillResult) -> dict[str, Any]:
    return asdict(r)
