"""Submit-time feasibility on a real orchd (fake cloud) and a real nats-server: a job that no enabled
cloud can run, or whose deadline even on-demand cannot meet, is refused at submit with the reason (400,
``infeasible``) and never becomes a job; a feasible one is accepted, and while it waits `jobs show` says
why and until when."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import nats
import pytest

import wire as ev
from orchestrator.cli.client import AdminClient, AdminError
from orchestrator.daemon.run import run_daemon
from orchestrator.jobspec import parse_jobspec
from orchestrator.natsserver import NatsServer
from simulations.fakecloud import FakeCloud
from tests.integration import helpers as h

pytestmark = pytest.mark.anyio


def _spec(tmp: Path, name: str, *, clouds: str = '["fake"]', deadline_ts: float | None = None,
          best_effort: bool = False):
    text = h.JOB_TOML.format(nodes=1).replace('clouds = ["fake"]', f"clouds = {clouds}")
    text = text.replace('url = "file:///tmp/orch-itest-ckpt"', f'url = "file://{tmp}/ckpt/{name}"')
    if deadline_ts is not None:
        market = 'market = "spot_with_fallback"'
        text = text.replace(market, f"{market}\ndeadline_ts = {deadline_ts}" + ("\nbest_effort = true" if best_effort
                                                                                   else ""))
    return parse_jobspec(text)


async def test_infeasible_jobs_are_refused_at_submit_with_the_reason(server: NatsServer, tmp_path: Path):
    settings = h.settings_for(tmp_path, server.url)
    cloud = FakeCloud()
    nc = await nats.connect(server.url)
    js = nc.jetstream()
    async with anyio.create_task_group() as tg:
        d = await tg.start(lambda task_status: run_daemon(settings, {"fake": cloud}, task_status=task_status))
        await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL, 1.0, 3.0))
        await h.wait_for(lambda: len(d.state.pools) >= 1)
        client = await AdminClient.connect([server.url])
        try:
            with pytest.raises(AdminError) as e:
                await client.submit(_spec(tmp_path, "aws", clouds='["aws"]'), job_id="on-aws")
            assert e.value.code == 400
            assert "no enabled cloud can run this job: it allows clouds [aws], orchd has [fake]" in e.value.message
            # 1000 steps x 1 s + boot + restart do not fit in 10 minutes
            with pytest.raises(AdminError) as e:
                await client.submit(_spec(tmp_path, "late", deadline_ts=time.time() + 600), job_id="too-late")
            assert e.value.code == 400 and "the deadline cannot be met even on on-demand" in e.value.message
            assert "best_effort = true accepts it anyway" in e.value.message
            assert "on-aws" not in d.state.jobs and "too-late" not in d.state.jobs
            # the same deadline with the explicit flag is accepted, and `jobs show` says it is best effort
            late = _spec(tmp_path, "late-ok", deadline_ts=time.time() + 600, best_effort=True)
            assert late.best_effort is True
            assert (await client.submit(late, job_id="best-effort")).created
            assert (await client.job("best-effort")).summary["best_effort"] is True
            reply = await client.submit(_spec(tmp_path, "ok", deadline_ts=time.time() + 7200), job_id="fits")
            assert reply.created and "fits" in d.state.jobs
            # no agent ever registers here: the job waits, and `orchctl jobs show` says why
            shown = await client.job("fits")
            assert shown.summary["best_effort"] is False
            waiting = shown.summary["waiting"]
            assert shown.summary["phase"] in ("pending", "placing") and waiting["reason"], shown.summary
            assert waiting["until"] is None or waiting["until"] >= time.time() - 5
        finally:
            await client.close()
        d.request_stop()
    await nc.close()
