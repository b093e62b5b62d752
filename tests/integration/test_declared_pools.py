"""Plugins declare their pools; no wildcard pool is ever a launch target: a real orchd (in-process, the
real core) over a real nats-server with the fake cloud plugin built without a pool list (it declares its
catalog). A tick for an instance type nobody declared ("gpu.invented" at 0.01 $/h, ten times cheaper) is
pending, not confirmed at once, and even once a second tick confirms its price a new job launches in a
declared type - never in the invented one. ``known_instance_types`` carries no "fake/*"."""

from __future__ import annotations

import anyio
import nats
import pytest

import wire as ev
from orchestrator.daemon.registry import known_instance_types, pool_problems
from orchestrator.daemon.run import run_daemon
from orchestrator.settings import load_settings
from simulations.fakecloud import FakeCloud
from tests.integration import helpers as h
from tests.integration.test_trust_gate import submit

pytestmark = pytest.mark.anyio

CONFIRM_S = 0.5
INVENTED = ev.PoolKey(cloud="fake", region="r1", zone="r1a", instance_type="gpu.invented", market=ev.Market.SPOT)


async def test_an_undeclared_instance_type_is_never_a_launch_target(server, tmp_path):
    url = server.url
    cfg = h.write_config(tmp_path, url)
    cfg.write_text(cfg.read_text().replace("price_confirm_s = 0.0", f"price_confirm_s = {CONFIRM_S}"))
    cloud = FakeCloud()
    assert pool_problems({"fake": cloud}) == []
    assert not any(k.endswith("/*") for k in known_instance_types({"fake": cloud}) or ())
    nc = await nats.connect(url)
    js = nc.jetstream()
    subject = ev.subject_price("fake", "r1")
    async with anyio.create_task_group() as tg:
        d = await tg.start(lambda task_status: run_daemon(load_settings(cfg, env={}), {"fake": cloud},
                                                          task_status=task_status))
        assert "fake/gpu.small" in d.state.config.known_instance_types
        assert not any(k.endswith("/*") for k in d.state.config.known_instance_types)
        await h.publish_js(js, subject, h.price(h.POOL, 1.0, 3.0))
        await h.wait_for(lambda: d.state.pools.get(h.POOL.name) is not None
                         and d.state.pools[h.POOL.name].price_usd_h == 1.0)
        await h.publish_js(js, subject, h.price(INVENTED, 0.01, 3.0))  # the first tick: pending, not counted
        await h.wait_for(lambda: INVENTED.name in d.state.pools)
        assert d.state.pools[INVENTED.name].price_usd_h is None
        await anyio.sleep(CONFIRM_S + 0.5)
        await h.publish_js(js, subject, h.price(INVENTED, 0.01, 3.0))  # a second agreeing tick confirms it
        await h.wait_for(lambda: d.state.pools[INVENTED.name].price_usd_h == 0.01)

        job = await submit(url, tmp_path, "new", f"file://{tmp_path}/a")
        await h.wait_for(lambda: cloud.all_instances())
        await anyio.sleep(1.0)  # a few Ticks: no second thought either
        assert {i.pool.instance_type for i in cloud.all_instances()} == {"gpu.small"}
        assert all(n.pool.instance_type == "gpu.small" for n in d.state.nodes.values() if n.job_id == job)
        d.request_stop()
        tg.cancel_scope.cancel()
    await nc.close()


def test_a_plugin_that_declares_nothing_or_bad_names_is_reported_and_never_a_wildcard() -> None:
    class Bare:  # a plugin with neither pools() nor a configured list
        cloud = "acme"

    class Hostile:
        cloud = "evil"

        def pools(self) -> list[ev.PoolKey]:
            return [ev.PoolKey(cloud="evil", region="r1", zone="z", instance_type="gpu..x", market=ev.Market.SPOT),
                    ev.PoolKey(cloud="evil", region="r 1", zone="z", instance_type="gpu.ok", market=ev.Market.SPOT),
                    ev.PoolKey(cloud="other", region="r1", zone="z", instance_type="gpu.b", market=ev.Market.SPOT),
                    ev.PoolKey(cloud="evil", region="r1", zone="z", instance_type="gpu.good", market=ev.Market.SPOT)]

    providers = {"acme": Bare(), "evil": Hostile()}
    assert known_instance_types(providers) == ("evil/gpu.good",)  # type: ignore[arg-type]
    problems = pool_problems(providers)  # type: ignore[arg-type]
    assert problems[0].startswith("providers.acme: declares no pools")
    assert "providers.evil.pools[0].instance_type: has an empty part" in problems[1]
    assert "providers.evil.pools[1].region: contains white space" in problems[2]
    assert problems[3] == "providers.evil.pools[2]: cloud 'other' is not the provider's ('evil')"
    assert len(problems) == 4


def test_a_stored_wildcard_entry_matches_nothing() -> None:
    """The previous release stored "fake/*" in the meta record's config (tests/fixtures/prev_main): it still
    loads, and matches no pool."""
    from orchestrator.core import CoreConfig

    cfg = CoreConfig(known_instance_types=("fake/*", "fake/gpu.small"))
    assert cfg.knows(h.POOL) and not cfg.knows(INVENTED)
    assert not CoreConfig(known_instance_types=("fake/*",)).knows(h.POOL)
