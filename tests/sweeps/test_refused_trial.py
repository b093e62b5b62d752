"""A trial whose job spec orchd refuses for good (400: e.g. no enabled cloud can run it) FAILs with orchd's
message, and is not submitted again on every pass (it was: the controller logged the 400 every 2 s and
`sweep show` had the trial running with no reason).

The controller and its admin bridge are the real ones, on a real nats-server and a real Optuna storage
(SQLite); orchd's two endpoints are stood in by a responder that answers as orchd does (a 404 for the
trial's job, the micro error headers of a 400 for its submit).
"""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import nats
import pytest

import wire as ev
from orchestrator.cli.client import AdminClient
from orchestrator.cli.sweep import _AdminBridge, format_show
from orchestrator.sweeps.controller import Controller
from orchestrator.sweeps.spec import parse_sweepspec
from orchestrator.sweeps.store import SweepStore
from simulations.sweeps import sweep_file

pytestmark = pytest.mark.anyio
REFUSAL = "job cannot run: no enabled cloud can run this job: it allows clouds [fake], orchd has [local] enabled"


async def _answer(nc, msg, code: int, message: str) -> None:
    await nc.publish(msg.reply, ev.encode(ev.AdminErrorBody(code=code, message=message)),
                     headers={"Nats-Service-Error-Code": str(code), "Nats-Service-Error": message})


async def test_a_refused_trial_fails_with_orchds_message_and_is_not_resubmitted(nats_server, tmp_path: Path) -> None:
    nc = await nats.connect(nats_server.url)
    submits: list[bytes] = []

    async def on_show(msg) -> None:
        await _answer(nc, msg, 404, "no such job")

    async def on_submit(msg) -> None:
        submits.append(msg.data)
        await _answer(nc, msg, 400, REFUSAL)

    await nc.subscribe(ev.admin_subject("jobs", "show"), cb=on_show)
    await nc.subscribe(ev.admin_subject("jobs", "submit"), cb=on_submit)
    await nc.flush()
    client = await AdminClient.connect([nats_server.url], timeout_s=5.0)
    try:
        text = sweep_file(trials=1, parallelism=1, nodes=1, total_steps=100, pruner="none", seed=1,
                          checkpoint_root=f"file://{tmp_path / 'ckpt'}", every=10)
        sweeps = SweepStore(f"sqlite:///{tmp_path / 'sweeps.db'}")
        assert sweeps.create("refused", parse_sweepspec(text), text, time.time())
        ctl = Controller(sweeps, _AdminBridge(client))
        first = await anyio.to_thread.run_sync(ctl.reconcile, "refused", time.time())
        second = await anyio.to_thread.run_sync(ctl.reconcile, "refused", time.time())
        assert first.told == [(0, "fail")] and first.submitted == []
        assert len(submits) == 1  # not again on the next pass
        assert second.state == "finished", second
        sw = SweepStore(f"sqlite:///{tmp_path / 'sweeps.db'}").open("refused")
        assert sw.summary()["reason"] == "all_trials_refused"  # not "completed": none of them ran
        shown = format_show(sw.summary(), sw.trial_rows(), None, "table")  # what `orchctl sweep show` prints
        assert "all_trials_refused" in shown and "no completed trial yet" in shown
        assert "it allows clouds [fake]," in shown and "orchd has [local] enabled" in shown, shown  # not markup
        (row,) = SweepStore(f"sqlite:///{tmp_path / 'sweeps.db'}").open("refused").trial_rows()
        assert row["state"] == "fail" and row["reason"] == f"refused: {REFUSAL}", row
    finally:
        await client.close()
        await nc.close()
