"""A sweep survives a leader takeover: two real orchd processes with ``daemon.ha`` (a 3 s lease) on one real
nats-server, sharing a file-backed fake cloud; the real controller service on a SQLite Optuna storage;
simulated agents whose trainers report a loss that depends on the trial's parameter.

Mid-sweep, while trials run, the leading orchd is killed (-9: no release, no last write). The standby takes
the lease, continues from the shared state, and the controller - whose admin calls fail until then - goes
on. The sweep completes with each trial once in Optuna (numbers 0..3, COMPLETE with the trainer's exact
final loss) and once in orchd (one job per trial, succeeded), nothing left alive in the cloud.
"""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest

from orchestrator.cli.sweep import serve
from orchestrator.sweeps import store as st
from orchestrator.sweeps.spec import parse_sweepspec, trial_job_id
from orchestrator.sweeps.store import SweepStore
from simulations.chaos import common
from simulations.chaos.harness import CLUSTER_ID, CONFIG, count_cloud
from simulations.sweeps import LossFleet, sweep_file, trial_loss
from tests.integration.test_ha_cluster_orchd import Orchd, roles

pytestmark = pytest.mark.timeout(240)
TTL = 3.0
TRIALS, STEPS = 4, 80


def _orchd(tmp: Path, name: str, url: str, fake_file: Path) -> Orchd:
    d = tmp / name
    d.mkdir()
    cfg = d / "orchd.toml"
    cfg.write_text(CONFIG.format(url=url, state=d / "state", cluster=CLUSTER_ID, fake_file=fake_file,
                                 daemon_extra=f"ha = true\nlease_ttl_s = {TTL}").replace(
        'level = "warning"', 'level = "info"'))  # "standby" is an info line
    return Orchd(name, cfg, fake_file)


async def _wait(cond, timeout_s: float, what: str) -> None:
    with anyio.fail_after(timeout_s, shield=False):
        while not cond():
            await anyio.sleep(0.1)
    assert cond(), what


async def _scenario(tmp: Path, url: str) -> None:
    t0 = time.monotonic()
    fake_file = tmp / "fake-cloud.json"
    storage = f"sqlite:///{tmp / 'sweeps.db'}"
    daemons = [_orchd(tmp, n, url, fake_file) for n in ("a", "b")]
    nc = client = None
    try:
        await _wait(lambda: roles(daemons) is not None, 60, "one orchd leads, the other stands by")
        leader, standby = roles(daemons)  # type: ignore[misc]
        nc = await common.connect(url, "agents")
        client = await common.admin(url)
        text = sweep_file(trials=TRIALS, parallelism=2, nodes=1, total_steps=STEPS, pruner="none", seed=5,
                          checkpoint_root=f"file://{tmp / 'ckpt'}", every=10)
        SweepStore(storage).create("ha", parse_sweepspec(text), text, time.time())
        fleet = LossFleet(nc, fake_file, step_s=0.05, hb_s=0.2)
        killed_mid_trial: list[str] = []
        async with anyio.create_task_group() as tg:
            await tg.start(fleet.run)
            await common.publish_prices(fleet.js, "ha")
            tg.start_soon(lambda: serve(storage, [url], None, interval_s=0.25, timeout_s=2.0))

            # -- kill the leader while a trial is half way ---------------------------------------------
            async def half_way() -> str | None:
                for j in (await client.jobs()).jobs:
                    if j.get("sweep_id") == "ha" and j["phase"] == "running" and STEPS // 4 <= j["step"] < STEPS // 2:
                        return str(j["job_id"])
                return None

            with anyio.fail_after(60):
                while not (job := await half_way()):
                    await anyio.sleep(0.1)
            killed_mid_trial.append(job)
            await anyio.to_thread.run_sync(leader.kill9)
            killed = time.monotonic()
            await _wait(lambda: standby.discovery.exists(), 10 * TTL, "the standby takes over")
            took = time.monotonic() - killed

            def finished() -> bool:
                return SweepStore(storage).open("ha").attrs.get(st.REASON) is not None

            await _wait(finished, 120, "the sweep finishes")
            await _wait(lambda: count_cloud(fake_file).alive == 0, 30, "nothing left alive in the cloud")
            tg.cancel_scope.cancel()

        sw = SweepStore(storage).open("ha")
        assert sw.attrs[st.REASON] == "completed"
        rows = sw.trial_rows()
        assert [r["trial"] for r in rows] == list(range(TRIALS)) and {r["state"] for r in rows} == {"complete"}
        jobs = {j["job_id"]: j for j in (await client.jobs()).jobs if j.get("sweep_id") == "ha"}
        assert sorted(jobs) == [trial_job_id("ha", i) for i in range(TRIALS)]  # each trial once in orchd
        for r in rows:
            job = jobs[r["job_id"]]
            assert job["phase"] == "succeeded" and job["nodes"] == 0
            assert r["value"] == trial_loss(r["params"], STEPS) == job["final_loss"]
        assert killed_mid_trial[0] in jobs and (await client.status()).pid == standby.proc.pid
        print(f"\nleader killed mid-trial ({killed_mid_trial[0]}), standby leading after {took:.1f}s; "
              f"{TRIALS} trials completed once; test {time.monotonic() - t0:.1f}s")
    except BaseException:
        for d in daemons:
            print(d.tail())
        raise
    finally:
        if client is not None:
            await client.close()
        if nc is not None:
            await nc.close()
        for d in daemons:
            if d.alive():
                d.stop()


def test_a_sweep_survives_a_leader_takeover(tmp_path: Path, nats_url: str) -> None:
    anyio.run(_scenario, tmp_path, nats_url, backend="asyncio")
