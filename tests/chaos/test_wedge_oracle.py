"""The adversarial drill's wedge oracle (``simulations.chaos.wedge``) catches a daemon that stops deciding
without crashing: its verdict on measured times, and a real orchd frozen with SIGSTOP whose notice is then
not decided (and is decided once the daemon runs again)."""

from __future__ import annotations

import signal
import time

import anyio
import pytest

from orchestrator.natsserver import NatsServer
from simulations.chaos import common
from simulations.chaos.agents import SimFleet
from simulations.chaos.harness import Orchd, job_spec
from simulations.chaos.wedge import WEDGE_MAX_S, bound_s, notice_to_command_s, wedges

pytestmark = pytest.mark.timeout(180)


def test_the_verdict_on_measured_times():
    assert bound_s(0.01) == pytest.approx(0.05) and bound_s(3.0) == WEDGE_MAX_S
    assert wedges(0.01, [0.004, 0.05, 0.03]) == []
    assert wedges(0.01, [0.004, 0.051, 0.03]) == ["batch 2: a notice for a healthy job took 0.051 s (bound 0.050 s)"]
    assert wedges(0.01, [None, 0.01]) == ["batch 1: a notice for a healthy job was not decided within 0.050 s"]
    assert [w[:7] for w in wedges(2.0, [4.9, 5.2, None])] == ["batch 2", "batch 3"]  # at most 5 s, however slow
    assert [w[:7] for w in wedges(None, [4.0, 6.0])] == ["batch 2"]


async def _frozen_daemon(tmp_path) -> tuple[float | None, float | None, float | None]:
    """(a notice decided by a running orchd, one sent while it is stopped, the wait for that one after it
    continues), in seconds; None: not decided in time."""
    server = NatsServer(tmp_path / "nats").start()
    orchd = Orchd(tmp_path, server.url)
    nc = client = None
    try:
        await anyio.to_thread.run_sync(orchd.start)
        nc = await common.connect(server.url, "wedge-test")
        fleet = SimFleet(nc, orchd.fake_file, step_s=0.03)
        client = await common.admin(server.url, timeout_s=20.0)
        async with anyio.create_task_group() as tg:
            await tg.start(fleet.run)
            await common.publish_prices(fleet.js, "wedge")
            for job in ("w1", "w2"):
                await common.call(client, "submit", job_spec(job, nodes=1, total_steps=10**6), job_id=job)
            with anyio.fail_after(90):
                while not (len({n.job_id for n in fleet.nodes.values() if n.training}) == 2 and fleet.idle()):
                    await anyio.sleep(0.1)
            node = {n.job_id: n.node_id for n in fleet.nodes.values() if n.training}
            healthy = await notice_to_command_s(fleet, node["w1"])
            assert orchd.proc is not None
            orchd.proc.send_signal(signal.SIGSTOP)
            try:
                t0 = time.time()
                stalled = await notice_to_command_s(fleet, node["w2"], limit_s=2.0)
            finally:
                orchd.proc.send_signal(signal.SIGCONT)
            later = None
            with anyio.move_on_after(WEDGE_MAX_S * 4):
                while later is None:
                    got = [t for t, c in fleet.commands if t >= t0 and getattr(c, "node_id", None) == node["w2"]]
                    later = (min(got) - t0) if got else None
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    finally:
        if client is not None:
            await client.close()
        await common.shutdown(orchd, server, nc)
    return healthy, stalled, later


def test_a_stopped_daemon_is_a_wedge(tmp_path):
    healthy, stalled, later = anyio.run(_frozen_daemon, tmp_path, backend="asyncio")
    assert healthy is not None and wedges(healthy, [healthy]) == []
    assert stalled is None
    assert wedges(healthy, [stalled]) == [f"batch 1: a notice for a healthy job was not decided within "
                                          f"{bound_s(healthy):.3f} s"]
    assert later is not None and later >= 2.0  # decided once orchd ran again: the notice itself was fine
