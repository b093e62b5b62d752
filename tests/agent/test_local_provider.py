"""The local provider: real orch-agent processes on a real nats-server, faults injected at the
metadata edge (notice then kill at the deadline) or by kill -9 (vanish); prices fixed or replayed."""

from __future__ import annotations

import time

import anyio
import nats
import pytest

from providers.base import InstanceState, LaunchRequest, NodeBootstrap
from providers.local import LocalConfig, LocalProvider
from providers.local.prices import BUNDLED_HISTORY, ReplayPrices, load_history
from tests.agent.helpers import ensure_events_stream, stream_events, wait_for
from wire import Market, NodeId, NodeRegistered, PreemptionNotice

pytestmark = pytest.mark.anyio


async def test_launch_preempt_vanish(nats_url: str, tmp_path) -> None:
    lp = LocalProvider(LocalConfig(work_dir=str(tmp_path), metadata={"local-b": "gcp"},
                                   agent_args=("--heartbeat-s", "0.5")))
    try:
        nc = await nats.connect(nats_url)
        await ensure_events_stream(nc)
        req = LaunchRequest(pool=lp.pool("local-b"), node_ids=(NodeId("lp-1"), NodeId("lp-2")),
                            idempotency_token="tok-1", cluster_id="c1", job_id="j1",
                            bootstrap=NodeBootstrap(nats_urls=(nats_url,)))
        res = await anyio.to_thread.run_sync(lp.launch, req)
        again = await anyio.to_thread.run_sync(lp.launch, req)
        assert len(res.instances) == 2 and again.instances == res.instances and lp.launch_calls == 2
        assert {i.node_id for i in lp.list_instances("c1")} == {"lp-1", "lp-2"}

        async def registered() -> set[str]:
            return {e.node_id for n in ("lp-1", "lp-2") for e in await stream_events(nc, n)
                    if isinstance(e, NodeRegistered)}

        with anyio.fail_after(30):
            while await registered() != {"lp-1", "lp-2"}:
                await anyio.sleep(0.2)
        deadline = lp.preempt("lp-1", notice_s=2.0)
        iid1 = lp.instance_of("lp-1")
        await anyio.sleep(1.0)
        notices = [e for e in await stream_events(nc, "lp-1") if isinstance(e, PreemptionNotice)]
        assert len(notices) == 1 and notices[0].cloud == "local"  # GCP flavour, local cloud
        assert lp.describe([iid1])[0].state == InstanceState.RUNNING  # alive until the deadline
        await wait_for(lambda: lp.describe([iid1])[0].state == InstanceState.TERMINATED, timeout_s=5)
        assert time.time() >= deadline - 0.05
        lp.vanish("lp-2")
        assert lp.describe([lp.instance_of("lp-2")])[0].state == InstanceState.TERMINATED
        assert lp.list_instances("c1") == []
        await nc.close()
    finally:
        lp.close()


def test_prices_fixed_override_and_replay(tmp_path) -> None:
    lp = LocalProvider(LocalConfig(work_dir=str(tmp_path), spot_usd_h={"local-a": 0.9}))
    quotes = {(q.pool.zone, q.pool.market): q.price_usd_h for q in lp.prices()}
    assert quotes[("local-a", Market.SPOT)] == 0.9
    assert quotes[("local-b", Market.SPOT)] == 0.30 * 3.06
    assert quotes[("local-a", Market.ON_DEMAND)] == 3.06
    lp.price_source.override("local-a", 3.0, duration_s=0.2)
    assert lp.prices([lp.pool("local-a")])[0].price_usd_h == 3.0
    time.sleep(0.25)
    assert lp.prices([lp.pool("local-a")])[0].price_usd_h == 0.9

    history = load_history(BUNDLED_HISTORY, "p3.2xlarge")
    assert sorted(history) == ["us-west-2a", "us-west-2b", "us-west-2c"]
    now = [1000.0]
    rp = ReplayPrices(BUNDLED_HISTORY, ("local-a", "local-b", "local-c"), on_demand_usd_h=3.06,
                      speedup=86400.0, clock=lambda: now[0])
    series = history["us-west-2a"]
    assert rp.price("local-a") == series[0][1]
    seen = set()
    for day in range(0, 90):  # a day of trace per wall second: the price follows the history
        now[0] = 1000.0 + day
        t = rp.trace_time()
        expect = [p for ts, p in series if ts <= t][-1]
        assert rp.price("local-a") == expect
        seen.add(expect)
    assert len(seen) > 3


def test_from_settings_for_orchd_registry(tmp_path) -> None:
    from providers.local import from_settings

    lp = from_settings({"work_dir": str(tmp_path), "zones": ["z1", "z2"], "prices": "replay",
                        "metadata": {"z2": "azure"}, "replay_speedup": 60.0})
    assert {q.pool.zone for q in lp.prices()} == {"z1", "z2"}
    with pytest.raises(ValueError) as e:
        from_settings({"zones": "z1", "colour": "blue", "replay_speedup": "fast"})
    assert "colour" in str(e.value) and "replay_speedup" in str(e.value)
