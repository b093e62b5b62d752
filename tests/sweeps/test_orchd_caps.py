"""orchd holds a sweep to its total budget with the controller down: a real orchd (subprocess, fake cloud,
real nats-server), simulated agents, Optuna's storage in a SQLite file.

The controller submits two trials and then stops running. A hostile admin submit claims the sweep id with
a budget a million times bigger. orchd sums the cost of every job of the sweep and, near the cap, stops
them all - a checkpoint first, reason ``sweep_budget`` (shown by ``orchctl jobs show``) - and refuses a new
trial with a clear 409. The controller, back, ends both trials as FAIL (``sweep_budget``) and finishes the
sweep with that reason without asking for another trial.
"""

from __future__ import annotations

import json
import time

import anyio
import msgspec
import pytest

from orchestrator.cli.client import AdminError
from orchestrator.cli.main import main
from orchestrator.cli.sweep import _AdminBridge
from orchestrator.sweeps import store as st
from orchestrator.sweeps.controller import Controller
from orchestrator.sweeps.spec import parse_sweepspec, trial_job_id, trial_jobspec
from orchestrator.sweeps.store import SweepStore
from simulations.sweeps import sweep_file
from tests.sweeps.world import sweep_world

pytestmark = pytest.mark.timeout(180)
# 1 $/h a node (on-demand 3 $/h: the termination tail orchd reserves is 0.05 $ a node): two trials, with
# no budget of their own (no trial_budget_usd), reach the stop a few seconds after both bill. A launch
# reserves boot (2 s here), a checkpoint, two Ticks and the tail (core/sweep_budget.py): both fit in it.
BUDGET = 0.106


async def _until(cond, timeout_s: float = 60.0, every: float = 0.2) -> None:
    with anyio.fail_after(timeout_s):
        while not await cond():
            await anyio.sleep(every)


async def _scenario(tmp, url: str) -> None:
    # the termination tail BUDGET is sized for
    async with sweep_world(tmp, url, "caps", daemon_extra="terminate_billing_s = 60.0\nboot_estimate_s = 2.0") as w:
        client, storage = w.client, w.storage
        text = sweep_file(trials=4, parallelism=2, nodes=1, total_steps=4000, pruner="none", seed=3,
                          checkpoint_root=f"file://{tmp / 'ckpt'}", every=10, budget_usd=BUDGET)
        sweeps = SweepStore(storage)
        assert sweeps.create("capped", parse_sweepspec(text), text, time.time())
        ctl = Controller(sweeps, _AdminBridge(client))
        res = await anyio.to_thread.run_sync(ctl.reconcile, "capped", time.time())
        jobs = [trial_job_id("capped", i) for i in range(2)]
        assert res.submitted == jobs  # ... and now the controller is down

        # a hostile submit claims the sweep with a far bigger budget (a GPU no pool has: it waits)
        sw = sweeps.open("capped")
        evil = msgspec.structs.replace(
            trial_jobspec(sw.spec, "capped", "evil", {"x": 0.5}, None, time.time() + 86400.0),
            gpu_type="H100", sweep_budget_usd=BUDGET * 1e6)
        assert (await client.submit(evil, "evil")).created
        # absurd caps are refused outright, each named
        with pytest.raises(AdminError) as bad:
            await client.submit(msgspec.structs.replace(evil, sweep_budget_usd=1e12, sweep_deadline_ts=-1.0),
                                "absurd")
        assert bad.value.code == 400 and "sweep_budget_usd: must be a number within" in bad.value.message
        assert "sweep_deadline_ts: must be a number within" in bad.value.message

        async def stopped() -> bool:
            phases = [(await client.job(j)).summary["phase"] for j in [*jobs, "evil"]]
            return phases == ["stopped"] * 3

        try:
            await _until(stopped, 60.0)
        except TimeoutError:
            for j in [*jobs, "evil"]:
                print(j, (await client.job(j)).summary)
                print([(e["action"], e["reason"]) for e in (await client.explain(j, 500)).entries][-15:])
            raise
        for j in [*jobs, "evil"]:
            summary = (await client.job(j)).summary
            assert (summary["reason"], summary["nodes"]) == ("sweep_budget", 0), summary
        # checkpoint first: the trials' ranks were asked to save (an orderly stop, not a hard one)
        events = (await client.explain("capped-t0000", 500)).entries
        assert any(e["action"] == "checkpoint" and e["reason"] == "sweep_budget" for e in events), events
        cost = sum([(await client.job(j)).summary["cost_usd"] for j in jobs])
        assert 0 < cost <= BUDGET

        out: list[str] = []
        code = await anyio.to_thread.run_sync(
            lambda: main(["--server", url, "jobs", "show", jobs[0], "-o", "json"], out=out.append))
        shown = json.loads("".join(out))["summary"]
        assert code == 0 and shown["reason"] == "sweep_budget"
        # the sweep as orchd holds it: the smallest cap any of its jobs carries, not the hostile one's
        assert shown["sweep"]["budget_usd"] == BUDGET and shown["sweep"]["closed"] == "sweep_budget"
        assert shown["sweep"]["jobs"] == 3 and 0 < shown["sweep"]["cost_usd"] <= BUDGET

        # a new trial of the closed sweep is refused, with the reason
        with pytest.raises(AdminError) as e:
            await client.submit(trial_jobspec(sw.spec, "capped", trial_job_id("capped", 2), {"x": 0.1}, 0.5),
                                trial_job_id("capped", 2))
        assert e.value.code == 409 and "sweep 'capped' is closed (sweep_budget)" in e.value.message

        # the controller, back: both trials FAIL with orchd's reason, the sweep finishes with it
        res = await anyio.to_thread.run_sync(ctl.reconcile, "capped", time.time())
        assert sorted(res.told) == [(0, "fail"), (1, "fail")] and res.asked == [] and res.state == "finished"
        done = SweepStore(storage).open("capped")
        assert done.attrs[st.REASON] == "sweep_budget"
        assert [(r["state"], r["reason"]) for r in done.trial_rows()] == [("fail", "sweep_budget")] * 2


def test_orchd_stops_a_sweep_at_its_total_budget_with_the_controller_down(tmp_path, nats_url):
    anyio.run(_scenario, tmp_path, nats_url, backend="asyncio")
