"""The controller's crash points, each reproduced on a real orchd (subprocess, fake cloud, real nats-server)
with a real Optuna storage (SQLite file), and the sweep's deadline and cancel:

- died right after Optuna's ``ask`` (a RUNNING trial, no job): the next pass submits that trial's job, it
  asks no extra trial for it;
- a trial's job submitted twice (a retry after a lost reply): orchd creates nothing the second time;
- died between recording a prune and cancelling the job: the next pass cancels it, the trial ends PRUNED;
- the deadline passes with trials running: their jobs are cancelled, the trials FAIL (sweep_deadline), no
  new trial starts; ``orchctl sweep cancel`` does the same at once.
"""

from __future__ import annotations

import json
import time

import anyio
import pytest

from orchestrator.cli.main import main
from orchestrator.cli.sweep import _AdminBridge
from orchestrator.sweeps import store as st
from orchestrator.sweeps.controller import Controller
from orchestrator.sweeps.spec import parse_sweepspec, trial_job_id
from orchestrator.sweeps.store import SweepStore
from simulations.sweeps import sweep_file
from tests.sweeps.world import sweep_world

pytestmark = pytest.mark.timeout(240)


def _file(tmp, *, trials: int, parallelism: int, steps: int, deadline_in_s: float | None = None) -> str:
    return sweep_file(trials=trials, parallelism=parallelism, nodes=1, total_steps=steps, pruner="none", seed=3,
                      checkpoint_root=f"file://{tmp / 'ckpt'}", every=10, deadline_in_s=deadline_in_s)


async def _passes(ctl: Controller, sweep_id: str, until, timeout_s: float = 60.0) -> None:
    with anyio.fail_after(timeout_s):
        while True:
            await anyio.to_thread.run_sync(ctl.reconcile, sweep_id, time.time())
            if until():
                return
            await anyio.sleep(0.25)


def _trials(storage: str, sweep_id: str) -> list:
    return SweepStore(storage).open(sweep_id).study.get_trials(deepcopy=False)


async def _scenario(tmp, url: str) -> None:
    async with sweep_world(tmp, url, "crash") as w:
        client, storage = w.client, w.storage
        sweeps = SweepStore(storage)
        ctl = Controller(sweeps, _AdminBridge(client))

        # 1. the controller died right after ask(): trial 0 exists in Optuna, no job in orchd
        text = _file(tmp, trials=3, parallelism=3, steps=40)
        assert sweeps.create("crash", parse_sweepspec(text), text, time.time())
        assert not sweeps.create("crash", parse_sweepspec(text), text, time.time())  # idempotent
        sw = sweeps.open("crash")
        t0 = sw.ask()
        res = await anyio.to_thread.run_sync(ctl.reconcile, "crash", time.time())
        assert res.submitted[0] == trial_job_id("crash", t0.number) and res.asked == [1, 2]
        assert len(_trials(storage, "crash")) == 3

        # 2. a submit retried with the same trial job id creates nothing
        again = await client.submit(sw.spec.template, trial_job_id("crash", 1))
        assert again.created is False

        # 3. died between recording the prune of trial 2 and cancelling its job
        sw.set(_trials(storage, "crash")[2], st.PRUNE_STEP, 10)
        await _passes(ctl, "crash", lambda: all(not st.is_running(t) for t in _trials(storage, "crash")))
        states = [t.state.name for t in _trials(storage, "crash")]
        assert states == ["COMPLETE", "COMPLETE", "PRUNED"]
        jobs = {j["job_id"]: j for j in (await client.jobs()).jobs if j.get("sweep_id") == "crash"}
        assert sorted(jobs) == [trial_job_id("crash", i) for i in range(3)]
        assert jobs[trial_job_id("crash", 2)]["phase"] == "cancelled"
        assert jobs[trial_job_id("crash", 2)]["nodes"] == 0
        await _passes(ctl, "crash", lambda: SweepStore(storage).open("crash").attrs.get(st.REASON) is not None)
        assert SweepStore(storage).open("crash").attrs[st.REASON] == "completed"

        # 4. the deadline passes while 2 trials run (each needs ~20 s): cancelled, FAIL, nothing new
        text = _file(tmp, trials=6, parallelism=2, steps=400, deadline_in_s=4.0)
        sweeps.create("late", parse_sweepspec(text), text, time.time())
        await _passes(ctl, "late", lambda: SweepStore(storage).open("late").attrs.get(st.REASON) is not None)
        late = SweepStore(storage).open("late")
        assert late.attrs[st.REASON] == "sweep_deadline"
        rows = late.trial_rows()
        assert len(rows) == 2 and {r["state"] for r in rows} == {"fail"}
        assert {r["reason"] for r in rows} == {"sweep_deadline"}

        # 5. orchctl sweep cancel: the running trials' jobs cancelled at once, then FAIL (sweep_cancelled)
        text = _file(tmp, trials=4, parallelism=2, steps=400)
        sweeps.create("stop", parse_sweepspec(text), text, time.time())
        await _passes(ctl, "stop", lambda: len(_trials(storage, "stop")) == 2)
        out: list[str] = []
        code = await anyio.to_thread.run_sync(
            lambda: main(["--server", url, "sweep", "cancel", "stop", "--storage", storage], out=out.append))
        assert code == 0 and "2 running trial job(s) cancelled" in "".join(out)
        await _passes(ctl, "stop", lambda: SweepStore(storage).open("stop").attrs.get(st.REASON) is not None)
        rows = SweepStore(storage).open("stop").trial_rows()
        assert len(rows) == 2 and {(r["state"], r["reason"]) for r in rows} == {("fail", "sweep_cancelled")}

        # orchctl sweep list/show read the storage
        out.clear()
        assert main(["sweep", "list", "--storage", storage, "-o", "json"], out=out.append) == 0
        listed = {s["sweep_id"]: s for s in json.loads("".join(out))["sweeps"]}
        assert set(listed) == {"crash", "late", "stop"} and listed["crash"]["state"] == "finished"
        out.clear()
        assert main(["sweep", "show", "crash", "--storage", storage, "-o", "json"], out=out.append) == 0
        shown = json.loads("".join(out))
        assert shown["best"]["trial"] in (0, 1) and [t["state"] for t in shown["trials"]] == [
            "complete", "complete", "pruned"]


def test_crash_points_deadline_and_cancel(tmp_path, nats_url):
    anyio.run(_scenario, tmp_path, nats_url, backend="asyncio")
