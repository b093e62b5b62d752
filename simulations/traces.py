"""Parsers for the public trace formats the simulator replays.

Role: read files from disk into small typed records (numpy arrays inside); nothing here knows about
policies. Formats (documented in docs/simulations.md):

- SkyPilot spot-traces JSON: ``{"metadata": {"gap_seconds": G}, "data": [v0, v1, ...]}``; 1-node
  files hold 1 (available / running) or 0, multi-node files the number of nodes alive. Zone and
  instance type come from the file name (``us-west-2b_v100_1.json``) unless given.
- Bamboo fleet event logs: ``time_ms,add|remove,nodeN`` (no header) -> nodes alive over time; and the
  Bamboo GCP group logs ``date, time, #instances``.
- AWS DescribeSpotPriceHistory CSV (``availability_zone, instance_type, timestamp_utc,
  spot_price_usd_hr``, one row per price change) and the GCP GPU VM price change log
  (``machine_type, region, valid_from_date, ondemand_usd_hr, spot_usd_hr, present``).
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

# Instance type names used in SkyPilot trace file names -> cloud instance types.
TYPE_ALIASES: dict[str, str] = {
    "v100_1": "p3.2xlarge",
    "v100_8": "p3.16xlarge",
    "k80_1": "p2.xlarge",
    "k80_8": "p2.8xlarge",
    "intel_64": "r5.16xlarge",
    "c3-88": "c3-highcpu-88",
    "p3": "p3.2xlarge",  # Bamboo p3-trace.csv
}

# Public on-demand list prices (USD per node-hour) used when a price file has none.
ON_DEMAND_USD_H: dict[str, float] = {
    "p3.2xlarge": 3.06,
    "p3.8xlarge": 12.24,
    "p3.16xlarge": 24.48,
    "p2.xlarge": 0.90,
    "p2.8xlarge": 7.20,
    "p2.16xlarge": 14.40,
}


class TraceFormatError(ValueError):
    """A file that is not in the format it claims (message says which file and why)."""


@dataclass(frozen=True, slots=True)
class AvailabilityTrace:
    """Nodes obtainable / alive in one zone, sampled every ``gap_s`` seconds."""

    zone: str
    region: str
    cloud: str
    instance_type: str
    gap_s: float
    values: np.ndarray = field(repr=False)  # int32 counts
    nodes_probed: int = 1  # how many nodes the probe asked for (1-node files: 1)
    source: str = ""

    @property
    def duration_s(self) -> float:
        return len(self.values) * self.gap_s


@dataclass(frozen=True, slots=True)
class PriceSeries:
    """A step function: ``prices[i]`` holds from ``times[i]`` (UTC epoch s) until ``times[i+1]``."""

    times: np.ndarray
    prices: np.ndarray  # NaN = no spot offer at that time
    on_demand: np.ndarray | None = None  # same length, where the source has it

    def at(self, t: np.ndarray) -> np.ndarray:
        i = np.searchsorted(self.times, t, side="right") - 1
        return self.prices[np.clip(i, 0, len(self.prices) - 1)]

    def on_demand_at(self, t: np.ndarray) -> np.ndarray | None:
        if self.on_demand is None:
            return None
        i = np.searchsorted(self.times, t, side="right") - 1
        return self.on_demand[np.clip(i, 0, len(self.on_demand) - 1)]


@dataclass(frozen=True, slots=True)
class PriceBook:
    """Spot price series by (zone or region, instance type); AWS keys zones, GCP keys regions."""

    kind: str  # "aws" | "gcp"
    series: dict[tuple[str, str], PriceSeries]
    source: str = ""

    def lookup(self, zone: str, region: str, instance_type: str) -> PriceSeries | None:
        s = self.series.get((zone, instance_type)) or self.series.get((region, instance_type))
        if s is not None:
            return s
        # same region, another zone: the closest public signal we have
        for (key, itype), ser in sorted(self.series.items()):
            if itype == instance_type and key.startswith(region) and key[: len(region)] == region:
                return ser
        return None


def split_zone(zone: str, cloud: str | None = None) -> tuple[str, str]:
    """(cloud, region) of a zone name: AWS ``us-west-2b`` -> us-west-2, GCP ``us-central1-a``."""
    m = re.fullmatch(r"([a-z]+-[a-z]+\d+)-([a-z])", zone)
    if m and cloud in (None, "gcp"):
        return "gcp", m.group(1)
    m = re.fullmatch(r"([a-z]+(?:-[a-z]+)+-\d+)([a-z])", zone)
    if m and cloud in (None, "aws"):
        return "aws", m.group(1)
    return cloud or "unknown", zone


def _nodes_from_path(path: Path) -> int | None:
    for part in path.parts:
        m = re.fullmatch(r"(\d+)-node", part)
        if m:
            return int(m.group(1))
    return None


def load_skypilot(
    path: str | Path, *, zone: str | None = None, instance_type: str | None = None, cloud: str | None = None,
    probe_nodes: int | None = None,
) -> AvailabilityTrace:
    """One SkyPilot spot-traces JSON file (one zone). The probe size is ``probe_nodes``, else the
    ``N-node`` folder the file sits in, else 1 for a 0/1 file; anything else is an error (never
    guessed from the file's maximum)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
        gap = float(doc["metadata"]["gap_seconds"])
        data = np.asarray(doc["data"], dtype=np.int32)
    except (KeyError, TypeError, ValueError) as e:
        raise TraceFormatError(f"{path}: not a SkyPilot spot-traces JSON ({e})") from None
    if data.ndim != 1 or len(data) == 0 or gap <= 0 or (data < 0).any():
        raise TraceFormatError(f"{path}: empty data, bad gap_seconds or negative counts")
    stem_zone, _, stem_type = path.stem.partition("_")
    if cloud is None:
        cloud = "gcp" if "gcp" in str(path.parent).lower() else None
    zone = zone or stem_zone
    c, region = split_zone(zone, cloud)
    itype = instance_type or TYPE_ALIASES.get(stem_type, stem_type or "unknown")
    nodes = probe_nodes or _nodes_from_path(path) or (1 if int(data.max()) <= 1 else None)
    if nodes is None:
        raise TraceFormatError(f"{path}: counts up to {int(data.max())} and no N-node folder: pass the probe size "
                               "(--probe-nodes)")
    if int(data.max()) > nodes:
        raise TraceFormatError(f"{path}: {int(data.max())} nodes alive but the probe asked for {nodes}")
    return AvailabilityTrace(zone, region, c, itype, gap, data, nodes, str(path))


def _series_from_events(times_s: np.ndarray, counts: np.ndarray, gap_s: float) -> np.ndarray:
    """Sample a step function (count holds from times_s[i]) every gap_s from times_s[0]."""
    grid = times_s[0] + np.arange(int((times_s[-1] - times_s[0]) // gap_s) + 1) * gap_s
    idx = np.searchsorted(times_s, grid, side="right") - 1
    return counts[idx].astype(np.int32)


def load_bamboo(
    path: str | Path,
    *,
    gap_s: float = 60.0,
    zone: str | None = None,
    region: str = "us-east-1",
    cloud: str = "aws",
    instance_type: str | None = None,
    probe_nodes: int | None = None,
) -> AvailabilityTrace:
    """A Bamboo fleet log (``time_ms,add|remove,nodeN``) or GCP group log (``date, time, #n``). The
    fleet's target size (``probe_nodes``) is not in the file and must be given."""
    path = Path(path)
    rows = [ln.strip() for ln in path.read_text().splitlines() if ln.strip()]
    if not rows:
        raise TraceFormatError(f"{path}: empty")
    if re.match(r"^\d+,(add|remove),", rows[0]):
        alive: set[str] = set()
        ts: list[float] = []
        counts: list[int] = []
        for n, ln in enumerate(rows, 1):
            parts = ln.split(",")
            if len(parts) != 3 or parts[1] not in ("add", "remove"):
                raise TraceFormatError(f"{path}:{n}: expected time_ms,add|remove,nodeN: {ln!r}")
            t = int(parts[0]) / 1000.0
            (alive.add if parts[1] == "add" else alive.discard)(parts[2])
            if ts and ts[-1] == t:
                counts[-1] = len(alive)
            else:
                ts.append(t)
                counts.append(len(alive))
        times, vals = np.asarray(ts), np.asarray(counts)
        default_type = TYPE_ALIASES.get(path.stem.split("-")[0], path.stem.split("-")[0])
    else:
        pts = []
        for n, ln in enumerate(rows, 1):
            parts = [x.strip() for x in ln.split(",")]
            try:
                dt = datetime.strptime(f"{parts[0]} {parts[1]}", "%Y-%m-%d %H:%M:%S")
                pts.append((dt.replace(tzinfo=UTC).timestamp(), int(parts[2])))
            except (IndexError, ValueError):
                raise TraceFormatError(f"{path}:{n}: expected 'date, time, count': {ln!r}") from None
        pts.sort()  # several sampler runs are interleaved in some files
        times = np.asarray([p[0] for p in pts])
        vals = np.asarray([p[1] for p in pts])
        default_type = path.stem.split("-")[0]
        cloud = "gcp" if cloud == "aws" and zone is None else cloud
        if zone is None:
            m = re.search(r"-(east|west|central)(\d)([a-z])$", path.stem)
            if m:
                zone = f"us-{m.group(1)}{m.group(2)}-{m.group(3)}"
                region = zone[:-2]
    values = _series_from_events(times, vals, gap_s)
    if probe_nodes is None:
        raise TraceFormatError(f"{path}: a fleet log does not say how many nodes were requested (at most "
                               f"{int(values.max())} were alive): pass the probe size (--probe-nodes)")
    if int(values.max()) > probe_nodes:
        raise TraceFormatError(f"{path}: {int(values.max())} nodes alive but the probe asked for {probe_nodes}")
    return AvailabilityTrace(
        zone or path.stem, region, cloud, instance_type or default_type, gap_s, values, probe_nodes, str(path),
    )


def load_trace(path: str | Path, **kw) -> AvailabilityTrace:
    """Any supported availability trace, by content."""
    path = Path(path)
    head = path.read_text()[:64].lstrip()
    if head.startswith("{"):
        return load_skypilot(path, **{k: v for k, v in kw.items()
                                      if k in ("zone", "instance_type", "cloud", "probe_nodes")})
    return load_bamboo(path, **kw)


def _utc(ts: str) -> float:
    ts = ts.strip().replace("Z", "+00:00")
    dt = datetime.fromisoformat(ts)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def load_aws_prices(path: str | Path) -> PriceBook:
    """AWS DescribeSpotPriceHistory rows flattened to CSV (one row per price change event)."""
    path = Path(path)
    acc: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with path.open(newline="") as f:
        r = csv.DictReader(f)
        need = {"availability_zone", "instance_type", "timestamp_utc", "spot_price_usd_hr"}
        if not r.fieldnames or not need <= set(r.fieldnames):
            raise TraceFormatError(f"{path}: AWS price CSV needs columns {sorted(need)}")
        for row in r:
            acc.setdefault((row["availability_zone"], row["instance_type"]), []).append(
                (_utc(row["timestamp_utc"]), float(row["spot_price_usd_hr"]))
            )
    series = {}
    for key, pts in acc.items():
        pts.sort()
        series[key] = PriceSeries(np.asarray([p[0] for p in pts]), np.asarray([p[1] for p in pts]))
    return PriceBook("aws", series, str(path))


def load_gcp_changelog(path: str | Path) -> PriceBook:
    """GCP GPU VM price change log: a row whenever (on-demand, spot, present) changes."""
    path = Path(path)
    acc: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    with path.open(newline="") as f:
        r = csv.DictReader(f)
        need = {"machine_type", "region", "valid_from_date", "ondemand_usd_hr", "spot_usd_hr", "present"}
        if not r.fieldnames or not need <= set(r.fieldnames):
            raise TraceFormatError(f"{path}: GCP changelog needs columns {sorted(need)}")
        for row in r:
            present = row["present"].strip() == "1"
            spot = float(row["spot_usd_hr"]) if present and row["spot_usd_hr"] else float("nan")
            od = float(row["ondemand_usd_hr"]) if present and row["ondemand_usd_hr"] else float("nan")
            acc.setdefault((row["region"], row["machine_type"]), []).append(
                (_utc(row["valid_from_date"]), spot, od)
            )
    series = {}
    for key, pts in acc.items():
        pts.sort()
        a = np.asarray(pts)
        series[key] = PriceSeries(a[:, 0], a[:, 1], a[:, 2])
    return PriceBook("gcp", series, str(path))


def load_prices(path: str | Path) -> PriceBook:
    """Either price format, by its header."""
    path = Path(path)
    with path.open() as f:
        header = f.readline()
    if "availability_zone" in header:
        return load_aws_prices(path)
    if "machine_type" in header:
        return load_gcp_changelog(path)
    raise TraceFormatError(f"{path}: neither an AWS spot price CSV nor the GCP price change log")
