"""A sweep drill: an Optuna sweep run by the real controller against a real orchd, with faults injected.

Role: everything is real except the GPU hosts - a ``nats-server``, orchd as a subprocess on the fake cloud
(``simulations.chaos.harness.Orchd``: kill -9 and restart like a process manager), Optuna's storage in a
SQLite file, the controller service ``orchestrator.cli.sweep.serve`` - and the nodes are simulated agents
(``LossFleet``: ``SimFleet`` whose trainers report a loss that depends on the trial's parameter ``x`` and
the step). During the sweep the drill injects preemption notices into running trials (checkpoint and
resume in a new generation), a vanished node while orchd is down (kill -9, the instance terminated in the
cloud, orchd restarted) and a restart of the controller. It measures node-seconds by sampling the live
simulated nodes. Used by tests/sweeps/test_sweep_drill.py and benchmarks/sweep.py.

Concurrency contract: ``run_drill`` is async (anyio on asyncio); the process helpers run in threads.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio

import wire as ev
from orchestrator.cli.sweep import serve
from orchestrator.natsserver import NatsServer
from orchestrator.sweeps.spec import parse_sweepspec, trial_job_id
from orchestrator.sweeps.store import SweepStore
from simulations.chaos import common
from simulations.chaos.agents import SimFleet, SimNode
from simulations.chaos.harness import Orchd, count_cloud
from simulations.fakecloud import FileFakeCloud
from wire import InstanceId

SWEEP_ID = "drill"
TERMINAL = ("succeeded", "failed", "cancelled", "stopped")


def trial_loss(args: dict[str, Any], step: int) -> float:
    """The simulated trainer's loss: a floor set by the parameter ``x`` (best at 0.25) plus a decay."""
    x = float(args.get("x", 0.5))
    return round(4.0 * (x - 0.25) ** 2 + 2.0 * math.exp(-step / 20.0), 9)


class LossFleet(SimFleet):
    """SimFleet whose heartbeats and exits carry ``trial_loss`` of the node's job and step (``_loss``)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.job_args: dict[str, dict[str, Any]] = {}

    def _loss(self, node: SimNode, step: int) -> float | None:
        args = self.job_args.get(str(node.job_id))
        return None if args is None or step <= 0 else trial_loss(args, step)

    def _execute(self, node: SimNode, cmd: Any) -> str | None:
        if isinstance(cmd, ev.StartGenerationCmd):
            self.job_args[str(cmd.job_id)] = dict(cmd.trainer.args)
        return super()._execute(node, cmd)


def sweep_file(*, trials: int, parallelism: int, nodes: int, total_steps: int, pruner: str, seed: int,
               checkpoint_root: str, every: int, budget_usd: float | None = None,
               deadline_in_s: float | None = None) -> str:
    extra = "" if budget_usd is None else f"budget_usd = {budget_usd}\n"
    extra += "" if deadline_in_s is None else f"deadline_in_s = {deadline_in_s}\n"
    return f"""name = "drill"
trials = {trials}
parallelism = {parallelism}
{extra}
[objective]
direction = "minimize"
report_every_steps = {every}

[sampler]
kind = "random"
seed = {seed}

[pruner]
kind = "{pruner}"
startup_trials = 1
warmup_steps = {every}

[space.x]
type = "float"
low = 0.0
high = 1.0

[job]
name = "drill"
total_steps = {total_steps}
step_time_s_estimate = 0.1
gpu_type = "A100"
nodes = {nodes}
nodes_min = 1
nodes_max = {nodes}
clouds = ["fake"]
market = "spot_with_fallback"

[job.trainer]
command = ["sim-trainer"]

[job.checkpoint]
url = "{checkpoint_root}"
interval_s = 1.0
save_s_estimate = 0.5
"""


@dataclass
class DrillConfig:
    trials: int = 8
    parallelism: int = 2
    nodes: int = 2
    total_steps: int = 100
    every: int = 10
    pruner: str = "median"
    seed: int = 7
    notices: int = 3  # preemption notices into running trials (each in a different trial)
    kill_orchd: bool = True  # kill -9 orchd once mid-sweep, a trial's node vanishes while it is down
    restart_controller: bool = True
    step_s: float = 0.1
    budget_usd: float | None = 50.0
    timeout_s: float = 240.0


@dataclass
class DrillResult:
    trials: int = 0
    states: dict[str, int] = field(default_factory=dict)  # Optuna trial states
    complete: int = 0
    pruned: int = 0
    failed: int = 0
    resumed: int = 0  # trials whose job continued from a committed checkpoint in a later generation
    notices: int = 0
    vanished: int = 0
    orchd_kills: int = 0
    controller_restarts: int = 0
    node_seconds: float = 0.0
    steps_run: int = 0  # the trials' steps, as far as each got (the job's step when it ended)
    best_value: float | None = None
    best_x: float | None = None
    jobs: int = 0  # the sweep's jobs as orchd lists them
    alive_instances: int = 0  # in the cloud after the sweep
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)  # orchctl sweep show's trial rows
    jobs_final: dict[str, dict[str, Any]] = field(default_factory=dict)  # job id -> phase, generation, reason
    starts: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # job id -> (generation, first step)
    noticed_jobs: list[str] = field(default_factory=list)  # jobs that got a notice or lost a node


class _Run:
    def __init__(self, cfg: DrillConfig, work: Path, server: NatsServer, orchd: Orchd, fleet: LossFleet,
                 storage: str) -> None:
        self.cfg, self.work, self.server, self.orchd, self.fleet = cfg, work, server, orchd, fleet
        self.storage = storage
        self.res = DrillResult()
        self.done = False
        self.noticed: set[str] = set()

    def running_trial_nodes(self, min_frac: float, max_frac: float = 0.6) -> list[SimNode]:
        """Nodes training a trial not hit yet, between ``min_frac`` and ``max_frac`` of its steps (a hit
        later may land after the trial's end when orchd lags on a loaded machine)."""
        now = time.time()
        return sorted((n for n in self.fleet.nodes.values()
                       if n.alive and n.training and n.job_id and n.job_id not in self.noticed
                       and n.total_steps * min_frac <= n.step(now, self.fleet.step_s) <= n.total_steps * max_frac),
                      key=lambda n: (str(n.job_id), n.node_id))

    async def sampler(self) -> None:
        last = time.monotonic()
        while not self.done:
            await anyio.sleep(0.1)
            now = time.monotonic()
            self.res.node_seconds += (now - last) * sum(1 for n in self.fleet.nodes.values() if n.alive)
            last = now

    async def noticer(self) -> None:
        while not self.done and self.res.notices < self.cfg.notices:
            victims = self.running_trial_nodes(0.15, 0.4)
            if victims:
                v = victims[0]
                self.noticed.add(str(v.job_id))
                self.fleet.publish_notice(v.node_id, deadline_s=30.0)
                self.res.notices += 1
                await anyio.sleep(1.0)
            await anyio.sleep(0.1)

    async def killer(self) -> None:
        """Once two trials have ended: kill -9 orchd, terminate a running trial's node in the cloud while
        orchd is down (the VM vanishes: no notice), restart orchd."""
        while not self.done:
            ended = sum(1 for t in self.store.open(SWEEP_ID).study.get_trials(deepcopy=False)
                        if t.state.name != "RUNNING")
            victims = self.running_trial_nodes(0.15, 0.5)
            if ended >= 2 and victims:
                await anyio.to_thread.run_sync(self.orchd.kill9)
                self.res.orchd_kills += 1
                v = victims[-1]
                cloud = FileFakeCloud(self.orchd.fake_file)  # orchd is down: nobody else writes the file
                await anyio.to_thread.run_sync(cloud.preempt, InstanceId(v.instance_id))
                self.noticed.add(str(v.job_id))
                self.res.vanished += 1
                await anyio.sleep(1.0)
                await anyio.to_thread.run_sync(self.orchd.start)
                return
            await anyio.sleep(0.2)

    @property
    def store(self) -> SweepStore:
        return SweepStore(self.storage)

    async def controller(self) -> None:
        """The controller service; restarted once when the third trial has started."""
        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()

            async def one(scope: anyio.CancelScope) -> None:
                with scope:
                    await serve(self.storage, [self.server.url], None, interval_s=0.25, timeout_s=5.0)

            tg.start_soon(one, scope)
            if self.cfg.restart_controller:
                while len(self.store.open(SWEEP_ID).study.get_trials(deepcopy=False)) < 3 and not self.done:
                    await anyio.sleep(0.2)
                scope.cancel()
                self.res.controller_restarts += 1
                await anyio.sleep(0.5)
                tg.start_soon(one, anyio.CancelScope())
            while not self.done:
                await anyio.sleep(0.2)
            tg.cancel_scope.cancel()

    async def wait_finished(self) -> None:
        deadline = time.monotonic() + self.cfg.timeout_s
        while time.monotonic() < deadline:
            sw = self.store.open(SWEEP_ID)
            if self.orchd.crashed():
                self.res.problems.append("orchd died on its own: " + self.orchd.tail(500))
                await anyio.to_thread.run_sync(self.orchd.start)
            if sw.attrs.get("orch.reason") is not None and count_cloud(self.orchd.fake_file).alive == 0:
                return
            await anyio.sleep(0.3)
        self.res.problems.append(f"the sweep did not finish in {self.cfg.timeout_s} s")


async def run_drill(cfg: DrillConfig, work: Path) -> DrillResult:
    t0 = time.monotonic()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    server = NatsServer(work / "nats").start()
    orchd = Orchd(work, server.url)
    storage = f"sqlite:///{work / 'sweeps.db'}"
    nc = None
    try:
        await anyio.to_thread.run_sync(orchd.start)
        nc = await common.connect(server.url, "sweep-agents")
        fleet = LossFleet(nc, orchd.fake_file, step_s=cfg.step_s, hb_s=0.2)
        run = _Run(cfg, work, server, orchd, fleet, storage)
        text = sweep_file(trials=cfg.trials, parallelism=cfg.parallelism, nodes=cfg.nodes,
                          total_steps=cfg.total_steps, pruner=cfg.pruner, seed=cfg.seed,
                          checkpoint_root=f"file://{work / 'ckpt'}", every=cfg.every, budget_usd=cfg.budget_usd)
        SweepStore(storage).create(SWEEP_ID, parse_sweepspec(text), text, time.time())
        async with anyio.create_task_group() as tg:
            await tg.start(fleet.run)
            await common.publish_prices(fleet.js, "sweep")
            tg.start_soon(run.sampler)
            tg.start_soon(run.controller)
            if cfg.notices:
                tg.start_soon(run.noticer)
            if cfg.kill_orchd:
                tg.start_soon(run.killer)
            await run.wait_finished()
            run.done = True
            tg.cancel_scope.cancel()
        await _collect(run, server.url)
        await anyio.to_thread.run_sync(orchd.stop)
        run.res.alive_instances = count_cloud(orchd.fake_file).alive
        run.res.seconds = round(time.monotonic() - t0, 2)
        run.res.node_seconds = round(run.res.node_seconds, 1)
        return run.res
    finally:
        await common.shutdown(orchd, server, nc)


async def _collect(run: _Run, url: str) -> None:
    res = run.res
    sw = run.store.open(SWEEP_ID)
    trials = sw.study.get_trials(deepcopy=False)
    res.trials = len(trials)
    for t in trials:
        res.states[t.state.name.lower()] = res.states.get(t.state.name.lower(), 0) + 1
    res.complete, res.pruned = res.states.get("complete", 0), res.states.get("pruned", 0)
    res.failed = res.states.get("fail", 0)
    res.rows = sw.trial_rows()
    res.steps_run = sum(int(r["step"] or 0) for r in res.rows)
    summary = sw.summary()
    res.best_value = summary["best_value"]
    if summary["best_trial"] is not None:
        res.best_x = float(trials[summary["best_trial"]].params["x"])
    client = await common.admin(url)
    try:
        jobs = (await common.call(client, "jobs")).jobs
    finally:
        await client.close()
    mine = {j["job_id"]: j for j in jobs if j.get("sweep_id") == SWEEP_ID}
    res.jobs = len(mine)
    res.jobs_final = {k: {"phase": j["phase"], "generation": j["generation"], "reason": j["reason"],
                          "nodes": j["nodes"], "final_loss": j.get("final_loss")} for k, j in mine.items()}
    started = run.fleet.events_of(ev.GenerationStarted)
    for g in started:
        pair = (g.generation, g.first_step)
        if pair not in res.starts.setdefault(str(g.job_id), []):
            res.starts[str(g.job_id)].append(pair)
    res.noticed_jobs = sorted(run.noticed)
    resumed = {str(g.job_id) for g in started if g.first_step > 0}
    res.resumed = sum(1 for t in trials if trial_job_id(SWEEP_ID, t.number) in resumed)


def as_dict(r: DrillResult) -> dict[str, Any]:
    return asdict(r)
