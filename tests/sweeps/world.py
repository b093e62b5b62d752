"""The world of the sweep scenarios with a real orchd: orchd (subprocess, fake cloud) on a real
nats-server, an admin client, a fleet of simulated agents that report losses (``LossFleet``), prices
published; on the way out every instance of the fake cloud is gone (nothing leaked) and all is closed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from orchestrator.cli.client import AdminClient
from simulations.chaos import common
from simulations.chaos.harness import Orchd, count_cloud
from simulations.sweeps import LossFleet


@dataclass
class SweepWorld:
    orchd: Orchd
    client: AdminClient
    fleet: LossFleet
    storage: str  # the Optuna storage URL (SQLite in the test's directory)


@asynccontextmanager
async def sweep_world(tmp: Path, url: str, tag: str, **orchd_kw: Any) -> AsyncIterator[SweepWorld]:
    """Start it all, yield, and once the block is done wait (30 s at most) until no instance is alive."""
    orchd = Orchd(tmp, url, **orchd_kw)
    await anyio.to_thread.run_sync(orchd.start)
    nc = await common.connect(url, "agents")
    client = await common.admin(url)
    try:
        fleet = LossFleet(nc, orchd.fake_file, step_s=0.05, hb_s=0.2)
        async with anyio.create_task_group() as tg:
            await tg.start(fleet.run)
            await common.publish_prices(fleet.js, tag)
            yield SweepWorld(orchd, client, fleet, f"sqlite:///{tmp / 'sweeps.db'}")
            tg.cancel_scope.cancel()
        with anyio.fail_after(30):
            while count_cloud(orchd.fake_file).alive:
                await anyio.sleep(0.2)
    finally:
        await client.close()
        await nc.close()
        await anyio.to_thread.run_sync(orchd.stop)
