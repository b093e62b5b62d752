"""Trials are bound to their sweep by the sweep id orchd holds, never by name: a real orchd (subprocess,
fake cloud, real nats-server), Optuna's storage in a SQLite file, ``orchctl sweep cancel`` as a user runs it.

Two unrelated jobs are submitted beforehand under the ids the sweep's first two trials would get
(``bound-t0000``, ``bound-t0001``). The controller adopts neither: each trial runs under a fresh job id of
its own (recorded on the trial), a job of the sweep in orchd's state. ``orchctl sweep cancel`` then cancels
the sweep's trials and leaves the two other jobs alone.
"""

from __future__ import annotations

import time

import anyio
import msgspec
import pytest

from orchestrator.cli.main import main
from orchestrator.cli.sweep import _AdminBridge
from orchestrator.sweeps import store as st
from orchestrator.sweeps.controller import Controller
from orchestrator.sweeps.spec import parse_sweepspec, trial_job_id
from orchestrator.sweeps.store import SweepStore
from simulations.sweeps import sweep_file
from tests.sweeps.world import sweep_world

pytestmark = pytest.mark.timeout(180)


async def _scenario(tmp, url: str) -> None:
    async with sweep_world(tmp, url, "bind") as w:
        client, storage = w.client, w.storage
        text = sweep_file(trials=2, parallelism=2, nodes=1, total_steps=100_000, pruner="none", seed=3,
                          checkpoint_root=f"file://{tmp / 'ckpt'}", every=10)
        spec = parse_sweepspec(text)
        squatters = [trial_job_id("bound", i) for i in range(2)]
        for jid in squatters:  # plain jobs, no sweep: a GPU no pool has, so they wait (and cost nothing)
            plain = msgspec.structs.replace(
                spec.template, name=f"not a trial {jid}", gpu_type="H100",
                checkpoint=msgspec.structs.replace(spec.template.checkpoint, url=f"file://{tmp / 'other' / jid}"))
            assert (await client.submit(plain, jid)).created
        sweeps = SweepStore(storage)
        assert sweeps.create("bound", spec, text, time.time())
        ctl = Controller(sweeps, _AdminBridge(client))
        res = await anyio.to_thread.run_sync(ctl.reconcile, "bound", time.time())
        assert res.foreign == squatters and res.asked == [0, 1]
        trials = sweeps.open("bound").study.get_trials(deepcopy=False)
        own = [st.job_id_of("bound", t) for t in trials]
        assert res.submitted == own and not set(own) & set(squatters)
        for jid in own:
            assert (await client.job(jid)).summary["sweep_id"] == "bound"
        res = await anyio.to_thread.run_sync(ctl.reconcile, "bound", time.time())  # a second pass: stable
        assert res.foreign == [] and res.submitted == [] and res.cancelled == []

        out: list[str] = []
        code = await anyio.to_thread.run_sync(
            lambda: main(["--server", url, "sweep", "cancel", "bound", "--storage", storage], out=out.append))
        assert code == 0 and "2 running trial job(s) cancelled" in "".join(out), out
        with anyio.fail_after(60):  # a running trial checkpoints first, then ends cancelled
            for jid in own:
                while (await client.job(jid)).summary["phase"] != "cancelled":
                    await anyio.sleep(0.2)
        for jid in squatters:
            summary = (await client.job(jid)).summary
            assert summary["phase"] == "pending" and summary["sweep_id"] is None, summary


def test_trials_are_bound_by_sweep_id_not_by_name(tmp_path, nats_url):
    anyio.run(_scenario, tmp_path, nats_url, backend="asyncio")
