"""A sweep on local nodes: orchd in-process with the local provider (each node an ``orch-agent`` process
running ``simulations.sweep_trainer`` ranks), embedded NATS, Optuna's storage in a SQLite file and the
controller service; preemptions injected with ``nodes.preempt`` (a notice from the node's metadata service,
then the kill at the deadline), as a cloud announces a spot reclaim.

Node time is sampled from orchd's node list (every node that has an instance: booting, registered,
running, noticed or draining). Used by benchmarks/sweep.py.

Concurrency contract: ``run_local`` is async (anyio on asyncio); orchd and the controller are tasks of it.
"""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from orchestrator.cli.client import AdminClient
from orchestrator.cli.demo import DemoOptions, demo_core, demo_provider, demo_settings
from orchestrator.cli.sweep import serve
from orchestrator.sweeps.spec import parse_sweepspec
from orchestrator.sweeps.store import SweepStore
from simulations.sweeps import SWEEP_ID, sweep_file
from wire.admin import PreemptNodeRequest

HOSTED = ("booting", "registered", "running", "noticed", "draining")
"""Node phases in which the node's host exists (and costs)."""


@dataclass
class LocalResult:
    trials: int = 0
    complete: int = 0
    pruned: int = 0
    failed: int = 0
    resumed: int = 0  # trials whose job ran more than one generation and ended succeeded or pruned
    preemptions: int = 0
    node_seconds: float = 0.0
    steps_run: int = 0  # the trials' steps, as far as each got (the job's step when it ended)
    best_value: float | None = None
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


def local_sweep_file(work: Path, *, trials: int, parallelism: int, nodes: int, steps: int, pruner: str,
                     seed: int) -> str:
    text = sweep_file(trials=trials, parallelism=parallelism, nodes=nodes, total_steps=steps, pruner=pruner,
                      seed=seed, checkpoint_root=f"file://{work / 'ckpt'}", every=10)
    text = text.replace('gpu_type = "A100"', 'gpu_type = "cpu"').replace('clouds = ["fake"]', 'clouds = ["local"]')
    text = text.replace('command = ["sim-trainer"]',
                        f'command = ["{sys.executable}", "-m", "simulations.sweep_trainer"]\n'
                        'args = { step_time_s = 0.1 }')
    return text.replace("interval_s = 1.0", "interval_s = 3.0")


async def run_local(work: Path, *, trials: int = 8, parallelism: int = 2, nodes: int = 2, steps: int = 100,
                    pruner: str = "median", seed: int = 7, preemptions: int = 3, timeout_s: float = 600.0
                    ) -> LocalResult:
    from orchestrator.daemon.run import run_daemon
    from wire.logs import configure

    t0 = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "orchd.log", "a") as log_stream:
        configure("warning", "json", stream=log_stream)
        settings = demo_settings(work)
        provider = demo_provider(work, DemoOptions(prices="fixed"))
        storage = f"sqlite:///{work / 'sweeps.db'}"
        res = LocalResult()
        text = local_sweep_file(work, trials=trials, parallelism=parallelism, nodes=nodes, steps=steps,
                                pruner=pruner, seed=seed)
        SweepStore(storage).create(SWEEP_ID, parse_sweepspec(text), text, time.time())
        async with anyio.create_task_group() as tg:
            d = await tg.start(functools.partial(run_daemon, core=demo_core(settings)), settings, {"local": provider})
            urls = d.nats_url.split(",")
            client = await AdminClient.connect(urls, timeout_s=10.0)
            try:
                with anyio.move_on_after(30):
                    while not (await client.prices()).pools:
                        await anyio.sleep(0.2)
                tg.start_soon(functools.partial(serve, storage, urls, None, interval_s=0.5, timeout_s=10.0))
                done = anyio.Event()
                tg.start_soon(_sample, client, res, done)
                tg.start_soon(_preempt, client, res, preemptions, steps, done)
                await _wait(storage, client, res, timeout_s)
                done.set()
                await _collect(storage, client, res)
            finally:
                await client.close()
                tg.cancel_scope.cancel()
    res.seconds = round(time.monotonic() - t0, 1)
    res.node_seconds = round(res.node_seconds, 1)
    return res


async def _sample(client: AdminClient, res: LocalResult, done: anyio.Event) -> None:
    last = time.monotonic()
    while not done.is_set():
        await anyio.sleep(0.5)
        try:
            n = sum(1 for x in (await client.nodes()).nodes if x["phase"] in HOSTED)
        except Exception:  # orchd busy: the next sample covers the gap
            continue
        now = time.monotonic()
        res.node_seconds += (now - last) * n
        last = now


async def _preempt(client: AdminClient, res: LocalResult, count: int, steps: int, done: anyio.Event) -> None:
    """A reclaim with a 5 s notice into a node of a running trial between 15% and 50% of its steps, each
    in a different trial."""
    hit: set[str] = set()
    while res.preemptions < count and not done.is_set():
        await anyio.sleep(0.5)
        try:
            nodes = (await client.nodes()).nodes
        except Exception:
            continue
        for n in sorted(nodes, key=lambda n: n["node_id"]):
            if (n["phase"] == "running" and n["job_id"] not in hit and steps * 0.15 <= (n["step"] or 0) <= steps * 0.5):
                try:
                    await client.call("nodes", "preempt", PreemptNodeRequest(node_id=n["node_id"], notice_s=5.0))
                except Exception as e:  # the node went meanwhile
                    res.problems.append(f"preempt {n['node_id']}: {e}")
                    continue
                hit.add(n["job_id"])
                res.preemptions += 1
                break


async def _wait(storage: str, client: AdminClient, res: LocalResult, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        attrs = SweepStore(storage).open(SWEEP_ID).attrs
        if attrs.get("orch.reason") is not None:
            with anyio.move_on_after(60):
                while any(x["phase"] in HOSTED for x in (await client.nodes()).nodes):
                    await anyio.sleep(0.5)
            return
        await anyio.sleep(0.5)
    res.problems.append(f"the sweep did not finish in {timeout_s} s")


async def _collect(storage: str, client: AdminClient, res: LocalResult) -> None:
    sw = SweepStore(storage).open(SWEEP_ID)
    rows = sw.trial_rows()
    res.trials = len(rows)
    res.complete = sum(1 for r in rows if r["state"] == "complete")
    res.pruned = sum(1 for r in rows if r["state"] == "pruned")
    res.failed = sum(1 for r in rows if r["state"] == "fail")
    res.best_value = sw.summary()["best_value"]
    res.steps_run = sum(int(r["step"] or 0) for r in rows)
    jobs: dict[str, Any] = {j["job_id"]: j for j in (await client.jobs()).jobs}
    res.resumed = sum(1 for r in rows if (jobs.get(r["job_id"]) or {}).get("generation", 0) > 1
                      and r["state"] in ("complete", "pruned"))
