"""A checkpoint root is owned by one job of one cluster, enforced at the storage: a second orchd (its own
state, its own generated cluster identity) refuses a job on a root the first cluster's job claimed - even
one with the same job id - before anything is written there; the owner's own resubmit is accepted."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from orchestrator.daemon.run import run_daemon
from orchestrator.natsserver import NatsServer
from simulations.fakecloud import FakeCloud
from tests.integration import helpers as h
from trainer import rootowner

pytestmark = pytest.mark.anyio


def _spec(tmp: Path, root: Path) -> Path:
    path = tmp / f"job-{len(list(tmp.glob('job-*')))}.toml"
    path.write_text(h.JOB_TOML.format(nodes=1).replace("file:///tmp/orch-itest-ckpt", root.as_uri()))
    return path


async def test_a_second_cluster_never_writes_into_a_root_another_cluster_owns(server, tmp_path: Path) -> None:
    other = NatsServer(tmp_path / "nats-2")
    other.start()
    root = tmp_path / "shared-ckpt"
    try:
        async with anyio.create_task_group() as tg:
            (tmp_path / "a").mkdir()
            (tmp_path / "b").mkdir()
            s1, s2 = h.settings_for(tmp_path / "a", server.url), h.settings_for(tmp_path / "b", other.url)
            d1 = await tg.start(lambda task_status: run_daemon(s1, {"fake": FakeCloud()}, task_status=task_status))
            d2 = await tg.start(lambda task_status: run_daemon(s2, {"fake": FakeCloud()}, task_status=task_status))
            c1, c2 = d1.settings.daemon.cluster_id, d2.settings.daemon.cluster_id
            assert c1 != c2 and c1.startswith("orch-") and c1 != "orch-default"  # generated, unique
            code, _out, err = await h.actl(server.url, "jobs", "submit", str(_spec(tmp_path, root)), "--id", "demo")
            assert code == 0, err
            # job "demo" of cluster 1 starts training: its trainer claims the root before its first write
            await anyio.to_thread.run_sync(lambda: rootowner.claim(root.as_uri(), "demo", c1))
            before = sorted(p.name for p in root.iterdir())
            for job_id in ("demo", "other-job"):  # the same job id on another cluster is another job
                code, _out, err = await h.actl(other.url, "jobs", "submit", str(_spec(tmp_path, root)), "--id", job_id)
                assert code == 1 and f"owned by job demo of cluster {c1}" in err, err
            nested = root / "inside"
            code, _out, err = await h.actl(other.url, "jobs", "submit", str(_spec(tmp_path, nested)), "--id", "n")
            assert code == 1 and "demo" in err, err
            assert sorted(p.name for p in root.iterdir()) == before  # nothing written by the second cluster
            assert "demo" not in d2.state.jobs and "other-job" not in d2.state.jobs
            code, _out, err = await h.actl(server.url, "jobs", "submit", str(_spec(tmp_path, root)), "--id", "demo")
            assert code == 0, err  # the owner's idempotent resubmit
            d1.request_stop()
            d2.request_stop()
    finally:
        other.stop()
