"""Seeded synthetic availability traces with the shape of the SkyPilot 45-day, 9-zone trace.

Role: the input of the speed benchmark (the shared traces are smaller) and of property tests.
Model: each zone alternates available/unavailable spells with exponential lengths (zone-specific
means drawn from the seed), and each region has its own outage process that takes all of its zones
down at once (the correlated outages seen in the real traces: FACTS.md, all three us-west-2 zones
down together far more often than independence predicts). Deterministic for a given seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from simulations.traces import AvailabilityTrace, split_zone

DEFAULT_ZONES = (
    "us-east-1a", "us-east-1c", "us-east-1f",
    "us-east-2a", "us-east-2b", "us-east-2c",
    "us-west-2a", "us-west-2b", "us-west-2c",
)


def _spells(rng: np.random.Generator, n: int, mean_up: float, mean_down: float) -> np.ndarray:
    out = np.empty(n, dtype=np.int32)
    i, up = 0, rng.random() < mean_up / (mean_up + mean_down)
    while i < n:
        length = max(1, int(rng.exponential(mean_up if up else mean_down)))
        out[i : i + length] = 1 if up else 0
        i += length
        up = not up
    return out


def synth_traces(
    *, days: float = 45.0, zones: int = 9, gap_s: float = 600.0, seed: int = 0, instance_type: str = "p3.2xlarge"
) -> list[AvailabilityTrace]:
    rng = np.random.default_rng(seed)
    n = int(days * 86400 // gap_s)
    names = list(DEFAULT_ZONES[:zones]) + [f"us-synth-{i}a" for i in range(max(0, zones - len(DEFAULT_ZONES)))]
    regions = sorted({split_zone(z)[1] for z in names})
    # region-wide outages: rare, hours long
    region_up = {
        r: _spells(rng, n, mean_up=rng.uniform(24, 96) * 3600 / gap_s, mean_down=rng.uniform(1, 6) * 3600 / gap_s)
        for r in regions
    }
    out = []
    for z in names:
        cloud, region = split_zone(z)
        own = _spells(rng, n, mean_up=rng.uniform(2, 24) * 3600 / gap_s, mean_down=rng.uniform(0.5, 8) * 3600 / gap_s)
        vals = own & region_up[region]
        out.append(AvailabilityTrace(z, region, cloud, instance_type, gap_s, vals, 1, f"synth:seed={seed}"))
    return out


def write_synthetic(out: Path, **kw) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for tr in synth_traces(**kw):
        p = out / f"{tr.zone}_v100_1.json"
        p.write_text(json.dumps({"metadata": {"gap_seconds": int(tr.gap_s)}, "data": tr.values.tolist()}))
        paths.append(p)
    return paths
