"""HA: two orchd on one NATS with daemon.ha = true. One leads (admin service, decisions), the other
stands by; when the leader stops, the standby takes the lease with a greater fencing token and
continues from the same persisted state."""

from __future__ import annotations

import urllib.request

import anyio
import nats
import pytest

import wire as ev
from orchestrator import bus
from orchestrator.cli.client import AdminClient
from orchestrator.daemon.run import run_daemon
from orchestrator.jobspec import parse_jobspec
from orchestrator.natsserver import NatsServer
from orchestrator.settings import load_settings
from simulations.fakecloud import FakeCloud
from tests.conftest import free_port
from tests.integration import helpers as h

pytestmark = pytest.mark.anyio


async def test_standby_takes_over_with_greater_token_and_same_state(tmp_path):
    server = NatsServer(tmp_path / "nats").start()
    settings = []
    b_metrics = free_port()
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        cfg = h.write_config(tmp_path / name, server.url, metrics_port=b_metrics if name == "b" else 0)
        cfg.write_text(cfg.read_text().replace("[daemon]\n", "[daemon]\nha = true\nlease_ttl_s = 2.0\n"))
        settings.append(load_settings(cfg, env={}))
    sa, sb = settings
    cloud = FakeCloud()
    nc = await nats.connect(server.url)
    js = nc.jetstream()
    try:
        async with anyio.create_task_group() as tg:
            a = await tg.start(lambda task_status: run_daemon(sa, {"fake": cloud}, task_status=task_status))
            b_handle: list = []

            async def standby() -> None:
                await run_daemon(sb, {"fake": cloud}, task_status=_Started(b_handle))

            tg.start_soon(standby)
            await anyio.sleep(1.0)
            assert not b_handle  # B stands by: not started
            # ... and answers /metrics with orchd_up 0 (OrchdNoLeader and OrchdDown resolve only so)
            text = await anyio.to_thread.run_sync(_scrape, f"http://127.0.0.1:{b_metrics}/metrics")
            assert "\norchd_up 0.0\n" in text and "\norchd_lease_revision 0.0\n" in text
            await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL, 1.0, 3.0))
            client = await AdminClient.connect([server.url])
            job = await client.submit(parse_jobspec(h.JOB_TOML.format(nodes=1)))
            st = await client.status()
            assert st.pid and st.fencing_token == a.fencing_token
            # the consumers' ack wait follows the lease TTL (2 s here: the 10 s floor), so an event the
            # server delivered to a leader that was then cut off reaches the next leader within it
            info = await js.consumer_info(bus.STREAM_EVENTS, bus.CONSUMER_EVENTS)
            assert info.config.ack_wait == bus.ack_wait_s(2.0) == 10.0
            a.request_stop()  # clean exit releases the lease
            b = await h.wait_for(lambda: b_handle and b_handle[0], timeout=10)
            assert b.fencing_token > a.fencing_token
            assert job.job_id in b.state.jobs  # continued from the persisted state
            reply = await client.job(job.job_id)
            assert reply.summary["job_id"] == job.job_id
            assert len(cloud.all_instances()) == 1  # the outbox was not executed twice
            await client.close()
            b.request_stop()
    finally:
        await nc.close()
        server.cleanup()


class _Started:
    """A task_status that records the handle when the standby becomes leader."""

    def __init__(self, sink: list) -> None:
        self.sink = sink

    def started(self, value=None) -> None:
        self.sink.append(value)


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()
