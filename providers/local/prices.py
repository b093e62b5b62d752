"""Price sources of the local provider: a fixed table, or an accelerated replay of a spot price history.

Role: answer "what does zone Z cost per hour now" for the local provider's pools. Two sources:

- ``FixedPrices``: one spot price per zone (and one on-demand price).
- ``ReplayPrices``: a CSV in the shape of AWS DescribeSpotPriceHistory (one row per price change:
  availability zone, instance type, timestamp, spot price; the columns of the flattened dump in
  ``data/`` or the API's own names ``AvailabilityZone``/``InstanceType``/``Timestamp``/``SpotPrice``),
  replayed from its first timestamp at ``speedup`` trace seconds per wall second; trace zones are
  mapped onto local zones in order (or by ``zone_map``).

Both accept ``override(zone, price, duration_s)``: a price spike injected by a test or the demo, on
top of whatever the source says, until it expires.

Concurrency contract: thread-safe (one lock); ``price`` is cheap (a bisect per call).
"""

from __future__ import annotations

import bisect
import csv
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path

BUNDLED_HISTORY = Path(__file__).with_name("data") / "spot_price_history_us-west-2_p3.2xlarge.csv"
P3_2XLARGE_ON_DEMAND_USD_H = 3.06


class _Overrides:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._over: dict[str, tuple[float, float]] = {}  # zone -> (price, until wall ts)

    def override(self, zone: str, price_usd_h: float, duration_s: float = float("inf")) -> None:
        with self._lock:
            self._over[zone] = (price_usd_h, self._clock() + duration_s)

    def clear_override(self, zone: str) -> None:
        with self._lock:
            self._over.pop(zone, None)

    def _overridden(self, zone: str) -> float | None:
        with self._lock:
            o = self._over.get(zone)
            if o is None:
                return None
            if self._clock() >= o[1]:
                del self._over[zone]
                return None
            return o[0]


class FixedPrices(_Overrides):
    def __init__(self, spot_usd_h: Mapping[str, float], on_demand_usd_h: float, *,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(clock)
        self.spot = dict(spot_usd_h)
        self.on_demand_usd_h = on_demand_usd_h

    def price(self, zone: str) -> float:
        o = self._overridden(zone)
        return o if o is not None else self.spot[zone]


def _col(row: Mapping[str, str], *names: str) -> str:
    for n in names:
        if n in row and row[n] != "":
            return row[n]
    raise KeyError(f"none of the columns {names} in {sorted(row)}")


def load_history(path: str | Path, instance_type: str | None = None) -> dict[str, list[tuple[float, float]]]:
    """trace zone -> sorted [(epoch ts, spot price)], from a DescribeSpotPriceHistory-shaped CSV."""
    out: dict[str, list[tuple[float, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            itype = _col(row, "instance_type", "InstanceType")
            if instance_type is not None and itype != instance_type:
                continue
            zone = _col(row, "availability_zone", "AvailabilityZone")
            ts = datetime.fromisoformat(_col(row, "timestamp_utc", "Timestamp").replace("Z", "+00:00")).timestamp()
            price = float(_col(row, "spot_price_usd_hr", "SpotPrice"))
            out.setdefault(zone, []).append((ts, price))
    for series in out.values():
        series.sort()
    if not out:
        raise ValueError(f"{path}: no price rows" + (f" for {instance_type}" if instance_type else ""))
    return out


class ReplayPrices(_Overrides):
    """Replays a price history: wall time ``start + w`` shows the trace at ``t0 + w * speedup``."""

    def __init__(self, path: str | Path, local_zones: Sequence[str], *, on_demand_usd_h: float,
                 instance_type: str | None = None, speedup: float = 3600.0, start_offset_s: float = 0.0,
                 zone_map: Mapping[str, str] | None = None, clock: Callable[[], float] = time.time) -> None:
        super().__init__(clock)
        history = load_history(path, instance_type)
        trace_zones = sorted(history)
        if zone_map is None:
            if len(trace_zones) < len(local_zones):
                raise ValueError(f"{path}: {len(trace_zones)} zones in the trace for {len(local_zones)} local zones")
            zone_map = dict(zip(local_zones, trace_zones, strict=False))
        self.zone_map = dict(zone_map)
        self.series = {z: history[t] for z, t in self.zone_map.items()}
        self._ts = {z: [r[0] for r in s] for z, s in self.series.items()}
        self.t0 = min(s[0][0] for s in self.series.values()) + start_offset_s
        self.speedup = speedup
        self.on_demand_usd_h = on_demand_usd_h
        self.started = clock()

    def trace_time(self) -> float:
        return self.t0 + (self._clock() - self.started) * self.speedup

    def price(self, zone: str) -> float:
        o = self._overridden(zone)
        if o is not None:
            return o
        series, ts = self.series[zone], self._ts[zone]
        i = bisect.bisect_right(ts, self.trace_time()) - 1
        return series[max(i, 0)][1]


PriceSource = FixedPrices | ReplayPrices
