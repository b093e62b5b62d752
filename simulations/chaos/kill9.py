"""kill -9 drill: orchd SIGKILLed at seeded random points of a job's life, restarted, left to converge.

One iteration: a fresh nats-server and state, orchd as a subprocess with the file-backed fake cloud,
simulated agents, prices for two spot pools of one zone; 1-2 jobs of 1-3 nodes are submitted (with
explicit job ids, so a submit cut by a kill is retried idempotently); the first job gets a preemption
notice once it is a quarter through (emergency checkpoint + replacement from the other pool + a new
generation). 1..``max_kills`` kill points are drawn (seeded) from ``KILL_POINTS``; at each, after a
random 0-0.4 s, orchd gets SIGKILL, stays dead 0-1 s, and is started again on the same state.

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
from orchestrator.natsserver import NatsServer
from simulations.fakecloud import FileFakeCloud
from providers.reaper import Reaper
from simulations.chaos import common
from simulations.chaos.agents import SimFleet
from simulations.chaos.harness import CLUSTER_ID, Orchd, count_cloud, job_spec

KILL_POINTS = ("placement", "mid_launch", "registration", "generation_start", "mid_generation",
               "emergency_checkpoint", "checkpoint_commit", "regrow", "completion")
"""In the order they happen in a job's life; a drawn point that never comes (e.g. no regrow) is skipped."""

TERMINAL = {"succeeded", "failed", "cancelled", "stopped"}


@dataclass
class KillResult:
    iteration: int
    seed: str
    kills: int = 0
    kill_points: list[str] = field(default_factory=list)
    skipped_points: list[str] = field(default_factory=list)
    notices: int = 0
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
        case "emergency_checkpoint":
            return bool(f.events_of(ev.PreemptionNotice))
        case "checkpoint_commit":
            return bool(f.events_of(ev.CheckpointCommitted))
        case "regrow":
            return any(c.generation >= 2 for c in f.of_kind(ev.StartGenerationCmd))
        case "completion":
            return any(e.reason == "completed" for e in f.events_of(ev.RanksExited))
    raise ValueError(name)


async def run_iteration(i: int, seed: int, root: Path, *, max_kills: int = 3, converge_s: float = 90.0,
                        step_s: float = 0.03) -> KillResult:
    tag = f"{seed}-kill-{i}"
    rng = random.Random(tag)
    res = KillResult(iteration=i, seed=tag)
    t_begin = time.monotonic()
    work = root / f"kill-{i}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    server = NatsServer(work / "nats").start()
    orchd = Orchd(work, server.url)
    nc = None
    try:
        await anyio.to_thread.run_sync(orchd.start)
        nc = await common.connect(server.url, "chaos-agents")
        fleet = SimFleet(nc, orchd.fake_file, step_s=step_s)
        n_jobs = rng.choice((1, 1, 2))
        specs = {f"chaos{i}-j{k}": job_spec(f"chaos{i}-j{k}", nodes=rng.randint(1, 3),
                                            total_steps=rng.randint(80, 160)) for k in range(n_jobs)}
        res.jobs = n_jobs
        points = sorted(rng.sample(KILL_POINTS, rng.randint(1, max_kills)), key=KILL_POINTS.index)
        plan = [(p, rng.uniform(0.0, 0.4), rng.uniform(0.0, 1.0)) for p in points]
        state = {"submitting": False, "done": False}
        first_job = next(iter(specs))
        client = await common.admin(server.url)

        async def injector() -> None:
            for point, delay, down in plan:
                while not _trigger(point, fleet, orchd, state):
                    if state["done"]:
                        res.skipped_points.append(point)
                        break
                    await anyio.sleep(0.02)
                else:
                    await anyio.sleep(delay)
                    if state["done"]:
                        res.skipped_points.append(point)
                        continue
                    await anyio.to_thread.run_sync(orchd.kill9)
                    res.kills += 1
                    res.kill_points.append(point)
                    await anyio.sleep(down)
                    await anyio.to_thread.run_sync(orchd.start)

        async def noticer() -> None:
            while not state["done"]:
                now = time.time()
                victims = [n for n in fleet.nodes.values() if n.training and n.job_id == first_job
                           and n.step(now, fleet.step_s) >= n.total_steps * 0.25]
                if victims:
                    fleet.publish_notice(rng.choice(sorted(victims, key=lambda n: n.node_id)).node_id)
                    res.notices += 1
                    return
                await anyio.sleep(0.05)

        async with anyio.create_task_group() as tg:
            await tg.start(fleet.run)
            await common.publish_prices(fleet.js, tag)
            tg.start_soon(injector)
            tg.start_soon(noticer)
            state["submitting"] = True
            for job_id, spec in specs.items():
                while True:  # a submit cut by a kill: the same job id again (idempotent)
                    try:
                        await common.call(client, "submit", spec, job_id=job_id)
                        break
                    except Exception:
                        await anyio.sleep(0.2)
            deadline = time.monotonic() + converge_s
            while time.monotonic() < deadline:
                if orchd.crashed():  # died without our SIGKILL: counted, and restarted like systemd would
                    res.problems.append("orchd died on its own: " + orchd.tail(500))
                    await anyio.to_thread.run_sync(orchd.start)
                try:
                    jobs = (await client.jobs()).jobs
                except Exception:
                    jobs = None
                if jobs is not None:
                    phases = {j["job_id"]: j["phase"] for j in jobs}
                    if all(phases.get(j) in TERMINAL for j in specs) and count_cloud(orchd.fake_file).alive == 0:
                        break
                await anyio.sleep(0.3)
            state["done"] = True
            tg.cancel_scope.cancel()
        # the final word of orchd (it may be restarting after the last kill)
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
        await anyio.to_thread.run_sync(orchd.stop)
        # the reaper, with its grace elapsed, over the cloud as orchd left it
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
    finally:
        await common.shutdown(orchd, server, nc)
    res.daemon_crashes = orchd.crashes
    res.seconds = round(time.monotonic() - t_begin, 2)
    return res


def as_dict(r: KillResult) -> dict[str, Any]:
    return asdict(r)
