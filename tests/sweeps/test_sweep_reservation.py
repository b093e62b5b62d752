"""A sweep's budget is reserved at launch, not checked after the fact: a real orchd (subprocess, fake cloud,
real nats-server), Optuna's storage in a SQLite file, the controller run once and then down.

The attack: a sweep with a budget of 0.02 USD and 3 trials, 1 USD/h a node (on-demand 3 USD/h: the
termination tail orchd books for a node is 0.05 USD). Before, each trial launched a node - its own budget
was all the launch read - and the sweep ended at 0.05 USD a trial. Now no trial launches: the first one's
node alone is committed to more than the budget, so it stops at once (``sweep_budget``), the sweep is
closed and orchd refuses the other trials (409); nothing is launched in the cloud and nothing is spent.
The controller, back, ends the trials as FAIL (``sweep_budget``) and finishes the sweep with that reason.
"""

from __future__ import annotations

import time

import anyio
import pytest

from orchestrator.cli.sweep import _AdminBridge
from orchestrator.sweeps import store as st
from orchestrator.sweeps.controller import Controller
from orchestrator.sweeps.spec import parse_sweepspec, trial_job_id
from orchestrator.sweeps.store import SweepStore
from simulations.chaos.harness import count_cloud
from simulations.sweeps import sweep_file
from tests.sweeps.world import sweep_world

pytestmark = pytest.mark.timeout(180)
BUDGET = 0.02


async def _scenario(tmp, url: str) -> None:
    async with sweep_world(tmp, url, "reserve", daemon_extra="terminate_billing_s = 60.0") as w:
        client, storage = w.client, w.storage
        text = sweep_file(trials=3, parallelism=3, nodes=1, total_steps=4000, pruner="none", seed=3,
                          checkpoint_root=f"file://{tmp / 'ckpt'}", every=10, budget_usd=BUDGET)
        sweeps = SweepStore(storage)
        assert sweeps.create("tight", parse_sweepspec(text), text, time.time())
        ctl = Controller(sweeps, _AdminBridge(client))
        res = await anyio.to_thread.run_sync(ctl.reconcile, "tight", time.time())
        first = trial_job_id("tight", 0)
        assert res.submitted == [first] and res.closed == "sweep_budget"  # ... and the controller is down
        await anyio.sleep(3.0)  # a few Ticks: nothing is launched later either
        summary = (await client.job(first)).summary
        assert (summary["phase"], summary["reason"], summary["nodes"]) == ("stopped", "sweep_budget", 0), summary
        assert summary["cost_usd"] == 0.0 and summary["sweep"]["cost_usd"] <= BUDGET
        assert summary["sweep"]["closed"] == "sweep_budget"
        events = (await client.explain(first, 200)).entries
        refused = [e for e in events if e["action"] == "launch_refused"]
        assert refused and refused[0]["reason"] == "sweep_budget", events
        assert count_cloud(w.orchd.fake_file).instances == 0

        res = await anyio.to_thread.run_sync(ctl.reconcile, "tight", time.time())  # the controller, back
        assert res.asked == [] and res.state == "finished"
        done = SweepStore(storage).open("tight")
        assert done.attrs[st.REASON] == "sweep_budget"
        assert {(r["state"], r["reason"]) for r in done.trial_rows()} == {("fail", "sweep_budget")}


def test_a_sweep_budget_below_a_nodes_commitment_launches_nothing(tmp_path, nats_url):
    anyio.run(_scenario, tmp_path, nats_url, backend="asyncio")
