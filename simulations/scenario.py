"""A replay scenario: zones on one common tick grid, with capacity and prices per tick.

Role: align traces of different gaps and lengths onto one grid, attach spot and on-demand prices,
and fix the progress quantum that the engine and the offline optimum share. Pure numpy, no I/O.

Grid: ``tick_s = max(largest trace gap, min_tick_s)``; traces of different lengths are an
error unless ``truncate`` (then the cut zones are listed in ``Scenario.truncated``). A zone counts
as having N nodes in a tick only if the trace shows at least N at every sample inside the tick (a
short outage becomes a whole-tick outage: pessimistic for spot, identical for every policy). The
trace is treated as cyclic so that jobs can start anywhere in it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from simulations.traces import ON_DEMAND_USD_H, AvailabilityTrace, PriceBook

ONE_NODE_SCALE = 1 << 16


@dataclass(frozen=True, slots=True)
class Zone:
    name: str
    region: str
    cloud: str
    instance_type: str


@dataclass(frozen=True, slots=True)
class Scenario:
    zones: tuple[Zone, ...]
    regions: tuple[tuple[str, str], ...]  # (cloud, region)
    zone_region: np.ndarray = field(repr=False)  # (Z,) index into regions
    avail: np.ndarray = field(repr=False)  # (Z, T) nodes obtainable
    spot_price: np.ndarray = field(repr=False)  # (Z, T) USD per node-hour
    od_price: np.ndarray = field(repr=False)  # (R,) USD per node-hour
    tick_s: float
    quanta_per_tick: int
    price_source: str = ""
    truncated: tuple[tuple[str, int], ...] = ()  # (zone, its own length in ticks) of zones cut to the shortest

    @property
    def n_ticks(self) -> int:
        return int(self.avail.shape[1])

    @property
    def quantum_s(self) -> float:
        return self.tick_s / self.quanta_per_tick

    def usable(self, nodes: int) -> np.ndarray:
        """(Z, T) bool: the zone has ``nodes`` spot nodes for the whole tick at a price below on-demand."""
        return (self.avail >= nodes) & (self.spot_price < self.od_price[self.zone_region][:, None])

    def subset(self, zone_idx: list[int]) -> Scenario:
        zones = tuple(self.zones[i] for i in zone_idx)
        regs = tuple(dict.fromkeys((z.cloud, z.region) for z in zones))
        zr = np.asarray([regs.index((z.cloud, z.region)) for z in zones], dtype=np.int64)
        od = np.asarray([self.od_price[self.regions.index(r)] for r in regs])
        return Scenario(zones, regs, zr, self.avail[zone_idx], self.spot_price[zone_idx], od,
                        self.tick_s, self.quanta_per_tick, self.price_source, self.truncated)


def _resample_min(values: np.ndarray, gap_s: float, tick_s: float, n_ticks: int) -> np.ndarray:
    starts = np.floor(np.arange(n_ticks) * tick_s / gap_s + 1e-9).astype(np.int64)
    if gap_s == tick_s:
        return values[:n_ticks].astype(np.int32)
    return np.minimum.reduceat(values, starts)[:n_ticks].astype(np.int32)


def quanta_for(tick_s: float, target_quantum_s: float = 150.0) -> int:
    return max(1, int(round(tick_s / target_quantum_s)))


def build(
    traces: list[AvailabilityTrace],
    *,
    prices: PriceBook | None = None,
    spot_price_ratio: float | None = None,
    on_demand_usd_h: float | None = None,
    price_start_ts: float | None = None,
    min_tick_s: float = 300.0,
    quantum_s: float = 150.0,
    truncate: bool = False,
) -> Scenario:
    """Put ``traces`` (one per zone) on one grid and price them.

    Prices: with a price book, the spot price of a zone at tick k is the book's price at
    ``price_start_ts + k * tick_s`` (default start: the latest first timestamp among the series used,
    so every series is defined); on-demand comes from the book (GCP) or the public list price table,
    or ``on_demand_usd_h``. Without a book, spot = ``spot_price_ratio`` x on-demand; with no known
    on-demand price the unit is "on-demand node-hours" (on-demand = 1.0).
    """
    if not traces:
        raise ValueError("no traces")
    names = [t.zone for t in traces]
    if len(set(names)) != len(names):
        raise ValueError(f"one trace per zone, got zones {names}")
    tick_s = max(max(t.gap_s for t in traces), min_tick_s)
    lengths = [int(t.duration_s // tick_s) for t in traces]
    n_ticks = min(lengths)
    if n_ticks < 2:
        raise ValueError("traces shorter than two ticks")
    cut = tuple((t.zone, n) for t, n in zip(traces, lengths, strict=True) if n > n_ticks)
    if cut and not truncate:
        have = ", ".join(f"{t.zone} {n}" for t, n in zip(traces, lengths, strict=True))
        raise ValueError(f"traces of different lengths (ticks of {tick_s:.0f} s: {have}); pass --truncate "
                         f"(truncate=True) to cut every zone to the shortest, {n_ticks} ticks")
    zones = tuple(Zone(t.zone, t.region, t.cloud, t.instance_type) for t in traces)
    regions = tuple(dict.fromkeys((z.cloud, z.region) for z in zones))
    zr = np.asarray([regions.index((z.cloud, z.region)) for z in zones], dtype=np.int64)
    avail = np.stack([probe_capacity(_resample_min(t.values, t.gap_s, tick_s, n_ticks), t.nodes_probed)
                      for t in traces])
    od_zone = np.full(len(zones), np.nan)
    spot = np.full((len(zones), n_ticks), np.nan)
    src = ""
    if prices is not None:
        series = []
        for z in zones:
            s = prices.lookup(z.name, z.region, z.instance_type)
            if s is None:
                raise ValueError(f"{prices.source}: no spot prices for {z.instance_type} in {z.name}/{z.region}")
            series.append(s)
        t0 = price_start_ts if price_start_ts is not None else max(float(s.times[0]) for s in series)
        grid = t0 + np.arange(n_ticks) * tick_s
        for i, s in enumerate(series):
            spot[i] = s.at(grid)
            od = s.on_demand_at(grid)
            if od is not None and np.isfinite(od).any():
                od_zone[i] = float(np.nanmedian(od))
        src = f"{prices.source} from ts {t0:.0f}"
    for i, z in enumerate(zones):
        if on_demand_usd_h is not None:
            od_zone[i] = on_demand_usd_h
        elif not np.isfinite(od_zone[i]):
            od_zone[i] = ON_DEMAND_USD_H.get(z.instance_type, 1.0)
    if prices is None:
        ratio = 0.3 if spot_price_ratio is None else spot_price_ratio
        spot = np.repeat((od_zone * ratio)[:, None], n_ticks, axis=1)
        src = f"fixed ratio {ratio}"
    spot = np.where(np.isfinite(spot), spot, np.inf)  # no offer = no capacity
    od = np.asarray([float(np.max(od_zone[zr == g])) for g in range(len(regions))])
    q = max(1, int(round(tick_s / quantum_s)))
    return Scenario(zones, regions, zr, avail, spot, od, tick_s, q, src, cut)


def probe_capacity(values: np.ndarray, probe_nodes: int) -> np.ndarray:
    """Nodes a job may count on from a probe of ``probe_nodes`` nodes that saw ``values`` alive: a probe
    that got every node it asked for says "the zone has capacity" (any job size fits: k-node jobs on
    1- and 4-node traces are replayed this way, an optimistic reading reported apart); a probe that got
    fewer says exactly that many."""
    if probe_nodes < 1:
        raise ValueError(f"probe size {probe_nodes} < 1")
    v = values.astype(np.int32)
    if (v > probe_nodes).any():
        raise ValueError(f"trace shows {int(v.max())} nodes alive but the probe asked for {probe_nodes}")
    return np.where(v >= probe_nodes, ONE_NODE_SCALE, v).astype(np.int32)


def job_quanta(sc: Scenario, work_s: float) -> int:
    return int(math.ceil(work_s / sc.quantum_s - 1e-9))
