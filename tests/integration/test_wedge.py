"""One bad string cannot wedge orchd: a price tick or an admin submit whose name cannot become a KV key or
a subject token is refused and counted, and a notice for a healthy job is still decided at once after it.

A real orchd (in this process, the real core) with the fake cloud, on a real nats-server; a simulated
agent acks commands. Before the fix, a tick for instance type "gpu evil" ended up in a KV key of orchd's
state, the store refused the write and retried it forever, and the decide loop stopped for good.
"""

from __future__ import annotations

import json
import time

import anyio
import msgspec
import nats
import pytest

import wire as ev
from orchestrator.cli.client import AdminClient, AdminError
from orchestrator.daemon.run import run_daemon
from simulations.fakecloud import FakeCloud
from tests.integration import helpers as h

pytestmark = pytest.mark.anyio

HOSTILE_TYPES = ("gpu evil", "gpu..x", "x" * 5000, "gpu.", ".gpu", "gpu\tx")
HOSTILE_IDS = ("rt job", "rt..job", "j" * 5000, "rt.job", "rt*", "rt>")


async def _notice_decided_s(js, agent, node_id: str, tag: str) -> float:
    """Seconds from a notice for ``node_id`` to its checkpoint command at the agent."""
    before = len(agent.of_kind(ev.CheckpointCmd))
    t0 = time.monotonic()
    notice = ev.PreemptionNotice(id=f"notice-{tag}", node_id=node_id, cloud="fake", deadline_ts=time.time() + 120,
                                 observed_ts=time.time())
    await h.publish_js(js, ev.subject_notice("fake", node_id), notice)
    await h.wait_for(lambda: len(agent.of_kind(ev.CheckpointCmd)) > before, timeout=5.0)
    return time.monotonic() - t0


def _hostile_tick(instance_type: str, i: int) -> bytes:
    """A tick whose instance type is ``instance_type`` (encoded by hand: the wire type may refuse it)."""
    tick = msgspec.to_builtins(h.price(h.POOL, 0.5, 3.0))
    tick["pool"]["instance_type"] = instance_type
    tick["id"] = f"hostile-{i}"
    return json.dumps(tick).encode()


async def test_a_hostile_price_tick_or_job_id_never_wedges_the_loop(server, tmp_path) -> None:
    url = server.url
    settings = h.settings_for(tmp_path, url)
    cloud = FakeCloud()
    nc = await nats.connect(url)
    js = nc.jetstream()
    agent = await h.SimAgent(nc).start()
    async with anyio.create_task_group() as tg:
        d = await tg.start(lambda task_status: run_daemon(settings, {"fake": cloud}, task_status=task_status))
        starts = await h.running_job(d, cloud, nc, agent, tmp_path, url, "healthy")
        for i, bad in enumerate(HOSTILE_TYPES):
            await js.publish(ev.subject_price("fake", "r1"), _hostile_tick(bad, i), headers={"Nats-Msg-Id": f"h{i}"})
        spec = tmp_path / "healthy.toml"  # the healthy job's spec: the ids are refused before its root is
        for bad in HOSTILE_IDS:
            code, _out, err = await h.actl(url, "jobs", "submit", str(spec), "--id", bad)
            assert code != 0 and ("job id" in err or "job_id" in err), (bad[:20], code, err)
        # explain of an id that is not a token: "no such job" (404), never an internal error
        client = await AdminClient.connect([url], timeout_s=10.0)
        try:
            for bad in (*HOSTILE_IDS, "rt\tjob", "rt\njob", "节点", "rt\x00", ""):
                with pytest.raises(AdminError) as e:
                    await client.explain(bad)
                assert e.value.code == 404, (bad[:20], e.value)
        finally:
            await client.close()
        # the loop still decides: a notice for the healthy job gets its checkpoint command at once
        assert await _notice_decided_s(js, agent, starts[0].node_id, "after") < 5.0
        other = tmp_path / "other.toml"
        other.write_text(h.JOB_TOML.format(nodes=1).replace("orch-itest-ckpt", f"orch-itest-ckpt-{tmp_path.name}-2"))
        code, out, err = await h.actl(url, "jobs", "submit", str(other), "--id", "after-attack", "-o", "json")
        assert code == 0 and json.loads(out)["created"], err
        assert not [p for p in d.state.pools.values() if p.pool.instance_type in HOSTILE_TYPES]
        rejected = {k: v for k, v in _samples(d, "orchd_messages_rejected_total").items() if v}
        assert sum(v for (kind, _reason), v in rejected.items() if kind in ("price", "PriceTick")) >= len(
            HOSTILE_TYPES), rejected
        assert sum(v for (kind, _reason), v in rejected.items() if kind == "admin") >= len(HOSTILE_IDS), rejected
        d.request_stop()
    await nc.close()


def _samples(d, name: str) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for metric in d.metrics.registry.collect():
        for s in metric.samples:
            if s.name == name:
                out[(s.labels.get("kind", ""), s.labels.get("reason", ""))] = s.value
    return out
