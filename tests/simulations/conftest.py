from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from simulations.scenario import Scenario, Zone
from tests.conftest import IN_CI

# The public traces sit beside the checkout (../shared/traces) for developers and CI; a clone has none.
# ORCH_TRACES_DIR points elsewhere (a test hides them this way to check that these tests skip).
SHARED = Path(os.environ.get("ORCH_TRACES_DIR") or Path(__file__).resolve().parents[3] / "shared" / "traces")
# Generated files in the traces' formats, shipped with the tests (tests/fixtures/traces/generate.py).
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
MISSING_REASON = (
    "the public spot traces are not at {path}: put them there (or set ORCH_TRACES_DIR) to run this test; "
    "docs/simulations.md, 'Data and citation', lists each source and its repository"
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that read the real traces carry the ``traces`` marker (``-m traces`` selects them)."""
    for item in items:
        if "shared" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.traces)


@pytest.fixture(scope="session")
def shared() -> Path:
    """The real public traces: skipped with how to get them where absent, required in CI (ORCH_CI=1)."""
    if not SHARED.is_dir():
        reason = MISSING_REASON.format(path=SHARED)
        if IN_CI:  # .ci/run keeps ../shared beside the checkout
            pytest.fail(f"required in CI: {reason}")
        pytest.skip(reason)
    return SHARED


@pytest.fixture(scope="session")
def fixture_traces() -> Path:
    """The shipped trace files (always present)."""
    return FIXTURES


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
