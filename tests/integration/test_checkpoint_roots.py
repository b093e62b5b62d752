"""One job, one checkpoint root, end to end: a real nats-server, a real orchd (fake cloud), orchctl.

A second job whose ``checkpoint.url`` is another job's root (written differently), inside it or around
it is refused at submit with a 409 that names the other job and the way out (``start_from``); the
refusal is in the audit (``orchctl explain``). A job that names the other job's checkpoint in
``start_from`` and has its own root is accepted.
"""

from __future__ import annotations

import json
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
from tests.integration.helpers import ctl

pytestmark = pytest.mark.anyio



def _spec_toml(url: str, start_from: str | None = None) -> str:
    text = h.JOB_TOML.format(nodes=1).replace('url = "file:///tmp/orch-itest-ckpt"', f'url = "{url}"')
    return text + (f'start_from = "{start_from}"\n' if start_from else "")



async def test_second_job_with_the_same_root_is_refused_with_a_clear_error(server: NatsServer, tmp_path: Path):
    root = f"file://{tmp_path}/ckpt/a"
    settings = h.settings_for(tmp_path, server.url)
    cloud = FakeCloud()
    nc = await nats.connect(server.url)
    js = nc.jetstream()
    async with anyio.create_task_group() as tg:
        d = await tg.start(lambda task_status: run_daemon(settings, {"fake": cloud}, task_status=task_status))
        await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL, 1.0, 3.0))
        await h.wait_for(lambda: len(d.state.pools) >= 1)

        first = tmp_path / "a.toml"
        first.write_text(_spec_toml(root))
        code, out, err = await anyio.to_thread.run_sync(lambda: ctl(server.url, "jobs", "submit", str(first),
                                                                       "-o", "json"))
        assert code == 0, err
        job_a = json.loads(out)["job_id"]
        await h.wait_for(lambda: len(cloud.all_instances()) == 1)

        # the same root, written differently: orchctl says why, and exits non-zero
        second = tmp_path / "b.toml"
        second.write_text(_spec_toml(f"file://{tmp_path}//ckpt/./a/"))
        code, out, err = await anyio.to_thread.run_sync(lambda: ctl(server.url, "jobs", "submit", str(second)))
        assert code != 0 and not out
        assert "orchd error 409" in err and f"is the checkpoint root of job {job_a!r}" in err, err
        assert "One job, one checkpoint root" in err

        client = await AdminClient.connect([server.url])
        try:
            for job_id, url, word in (("b-inside", f"{root}/sub", "lies inside"),
                                      ("b-around", f"file://{tmp_path}/ckpt", "contains")):
                with pytest.raises(AdminError) as e:
                    await client.submit(parse_jobspec(_spec_toml(url)), job_id=job_id)
                assert e.value.code == 409 and f"{word} the checkpoint root of job {job_a!r}" in e.value.message
                assert job_id not in d.state.jobs
            explained = await client.explain("b-inside")
            refused = [x for x in explained.entries if x["action"] == "submit_refused"]
            assert refused and refused[0]["reason"] == "checkpoint_root_overlap"
            assert refused[0]["details"]["other_job"] == job_a

            # a sibling with a common prefix is another root; start_from reads the other job's checkpoint
            other_ckpt = f"{root}/step_000000001"
            reply = await client.submit(parse_jobspec(_spec_toml(f"{root}b", start_from=other_ckpt)), job_id="c")
            assert reply.created and d.state.jobs["c"].spec.checkpoint.start_from == other_ckpt
            assert len(d.state.jobs) == 2  # a and c; nothing refused was kept
        finally:
            await client.close()
        d.request_stop()
    await nc.close()
