"""The alert rules and dashboard queries the drill checks, and the one time factor of its short run.

Role: read config/prometheus/alerts.yml and config/grafana/dashboards/orchd.json as shipped; write a
copy of the rules whose ``for:`` durations and PromQL range windows are multiplied by one factor, and
derive that factor mechanically from the rules file (``auto_scale``); list every dashboard target's
expression with its variables substituted.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "config" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "config" / "grafana" / "dashboards" / "orchd.json"

_UNITS_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0, "y": 31536000.0}
_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
_RANGE = re.compile(r"\[(\d+(?:ms|s|m|h|d|w|y))(?::(\d+(?:ms|s|m|h|d|w|y))?)?\]")
SAMPLES_PER_WINDOW = 4
"""The shortest scaled range window holds this many scrapes (a rate or deriv needs two at least)."""


def seconds(duration: str) -> float:
    """A Prometheus duration ("1h30m", "500ms") in seconds."""
    parts = _DURATION.findall(duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise ValueError(f"not a Prometheus duration: {duration!r}")
    return sum(int(n) * _UNITS_S[u] for n, u in parts)


def duration(s: float) -> str:
    """Seconds as a Prometheus duration in whole milliseconds (at least 1ms)."""
    return f"{max(1, round(s * 1000))}ms"


def alert_rules(path: Path = ALERTS) -> list[dict[str, Any]]:
    doc = yaml.safe_load(path.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def alert_names(path: Path = ALERTS) -> list[str]:
    return [r["alert"] for r in alert_rules(path)]


def range_windows(path: Path = ALERTS) -> list[float]:
    """Every range window of every rule's expression, in seconds."""
    return [seconds(m.group(1)) for r in alert_rules(path) for m in _RANGE.finditer(r["expr"])]


def auto_scale(scrape_s: float, path: Path = ALERTS) -> float:
    """The factor that makes the rules' shortest range window hold ``SAMPLES_PER_WINDOW`` scrapes (at
    most 1): every window and ``for:`` shrinks by the same factor, so each alert keeps its shape."""
    windows = range_windows(path)
    if not windows:
        raise ValueError(f"{path}: no range window in any rule: nothing to derive the scale from")
    return min(1.0, SAMPLES_PER_WINDOW * scrape_s / min(windows))


def _scale_expr(expr: str, scale: float) -> str:
    def one(m: re.Match[str]) -> str:
        rng = duration(seconds(m.group(1)) * scale)
        if m.group(2) is not None or m.group(0).endswith(":]"):
            step = f":{duration(seconds(m.group(2)) * scale)}" if m.group(2) else ":"
            return f"[{rng}{step}]"
        return f"[{rng}]"

    return _RANGE.sub(one, expr)


def scaled_rules(scale: float, path: Path = ALERTS) -> str:
    """The rules file with every ``for:`` and range window multiplied by ``scale`` (YAML text)."""
    if not 0 < scale <= 1:
        raise ValueError(f"scale must be within (0, 1], got {scale}")
    doc = yaml.safe_load(path.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule["expr"] = _scale_expr(rule["expr"], scale)
            if "for" in rule:
                rule["for"] = duration(seconds(str(rule["for"])) * scale)
    return yaml.safe_dump(doc, sort_keys=False)


def dashboard_queries(rate_interval: str, path: Path = DASHBOARD) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel, variables substituted: ``$job_id`` by its
    "All" value, ``$__rate_interval`` by ``rate_interval``."""
    dash = json.loads(path.read_text())
    values = {"__rate_interval": rate_interval}
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            values[var["name"]] = var.get("allValue") or ".*"
        elif var.get("type") == "datasource":
            values[var["name"]] = str(var.get("current", {}).get("value", ""))

    def panels(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for p in items:
            out.append(p)
            out.extend(panels(p.get("panels", [])))
        return out

    queries = []
    for panel in panels(dash.get("panels", [])):
        for target in panel.get("targets", []):
            expr = target.get("expr")
            if not expr:
                continue
            for name in sorted(values, key=len, reverse=True):
                expr = expr.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
            if "$" in expr:
                raise ValueError(f"panel {panel.get('title')!r}: unsubstituted variable in {expr!r}")
            queries.append((str(panel.get("title", "")), expr))
    return queries
