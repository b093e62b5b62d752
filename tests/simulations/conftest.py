from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from simulations.scenario import Scenario, Zone

SHARED = Path(__file__).resolve().parents[3] / "shared" / "traces"


@pytest.fixture(scope="session")
def shared() -> Path:
    if not SHARED.is_dir():  # CI keeps ../shared beside the checkout
        pytest.fail(f"shared traces not found at {SHARED}")
    return SHARED


def tiny_scenario(
    avail: np.ndarray,
    *,
    regions_of_zones: list[int],
    spot: np.ndarray | None = None,
    od: list[float] | None = None,
    tick_s: float = 300.0,
    quanta_per_tick: int = 2,
) -> Scenario:
    avail = np.asarray(avail, dtype=np.int32)
    nreg = max(regions_of_zones) + 1
    regs = tuple(("aws", f"r{g}") for g in range(nreg))
    zones = tuple(Zone(f"r{g}{chr(97 + i)}", f"r{g}", "aws", "p3.2xlarge") for i, g in enumerate(regions_of_zones))
    if spot is None:
        spot = np.full(avail.shape, 0.3)
    return Scenario(
        zones=zones,
        regions=regs,
        zone_region=np.asarray(regions_of_zones, dtype=np.int64),
        avail=avail,
        spot_price=np.asarray(spot, dtype=float),
        od_price=np.asarray(od if od is not None else [1.0] * nreg, dtype=float),
        tick_s=tick_s,
        quanta_per_tick=quanta_per_tick,
    )
