"""Runs the drill: services up, the job, every scenario in turn, then the figures (JSON).

Alerts fired / expected: expected = every alert of config/prometheus/alerts.yml; fired = those that
fired in their scenario (Prometheus, Alertmanager and the webhook saw them) and resolved afterwards.
Panels with data / total: every target of the Grafana dashboard, variables substituted, queried over
the drill's span. Metrics set / declared: declared = the metric families of the live orchd registries;
set = those whose value changed during some scenario (or the set-up, where the faults of ``at_setup``
scenarios are made). The agents serve no /metrics: what they read (heartbeats, GPU readings, checkpoint
reports) reaches Prometheus through orchd's registry.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from simulations.drill import rules
from simulations.drill.drill import AlertResult, Drill
from simulations.drill.scenarios import SCENARIOS, Scenario, setup, teardown_dirs

GPU_READINGS = ("stub NVML (simulations/drill/stub_nvml/pynvml.py): the agents run on CPU, their one GPU's readings "
                "are fixed values, not measurements; they carry orchd_node_gpu_* through heartbeats to Prometheus")
"""How the drill's GPU series are made (the JSON's ``gpu_readings``)."""
SECURITY = ("TLS on every client listener (a throwaway CA); the auth callout answered by both orchd (account key, "
            "auth user); orchd, orchctl (role orchctl) and the price feed (role feed:local) as static users; agents "
            "enrolled with per-node credentials; orchd and the agents read their secrets from $CREDENTIALS_DIRECTORY")

Snapshot = dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]


def changed(before: Snapshot, after: Snapshot) -> set[str]:
    """Families with a sample whose value differs (a new sample counts from 0)."""
    out = set()
    for fam, samples in after.items():
        old = before.get(fam, {})
        if any(v != old.get(k, 0.0) for k, v in samples.items()):
            out.add(fam)
    return out


class MetricsWatch:
    """Snapshots of every orchd's /metrics every ``every_s`` while a scenario runs: the families that
    differ from the first snapshot at any of them (a value that rose and fell back counts)."""

    def __init__(self, d: Drill, every_s: float = 1.0) -> None:
        self.d, self.every_s = d, every_s
        self.first = d.snapshot()
        self.declared = set(self.first)
        self.changed: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drill-metrics-watch", daemon=True)
        self._thread.start()

    def _take(self) -> None:
        snap = self.d.snapshot()
        self.declared |= set(snap)
        self.changed |= changed(self.first, snap)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            with contextlib.suppress(Exception):  # an orchd killed by the scenario, a scrape refused
                self._take()

    def stop(self) -> tuple[set[str], set[str]]:
        """(declared, changed) over the scenario."""
        self._stop.set()
        self._thread.join()
        self._take()
        return self.declared, self.changed


@dataclass
class Started:
    """A scenario whose fault was made at set-up (``Scenario.at_setup``): when, what was active then, and
    what its undo needs."""

    t0: float
    before: set[tuple[tuple[str, str], ...]]
    undo_arg: Any


def _start_early(d: Drill, sc: Scenario) -> Started:
    t0, before = time.time(), d.active_alerts()
    return Started(t0, before, sc.fault(d))


def _run_one(d: Drill, sc: Scenario, results: dict[str, AlertResult], windows_s: float,
             started: Started | None = None) -> dict[str, Any]:
    t0 = started.t0 if started is not None else time.time()
    for name in sc.alerts:
        results[name] = AlertResult(scenario=sc.name)
    info: dict[str, Any] = {"scenario": sc.name, "alerts": list(sc.alerts), "error": "",
                            "fault_at_setup": started is not None}  # its seconds count from the set-up
    try:
        before = started.before if started is not None else d.active_alerts()
        info["active_before"] = sorted({dict(a)["alertname"] for a in before})
        undo_arg = started.undo_arg if started is not None else sc.fault(d)
        try:
            if sc.alerts:
                d.wait_fired(list(sc.alerts), results, t0, timeout_s=sc.fire_timeout_s or 120 + windows_s,
                             before=before)
        finally:
            sc.undo(d, undo_arg)
        if sc.alerts:
            d.wait_resolved(list(sc.alerts), results, t0, timeout_s=60 + 2 * windows_s)
    except Exception as e:  # noqa: BLE001 - recorded, and the drill goes on with the next scenario
        info["error"] = f"{type(e).__name__}: {e}"
        for name in sc.alerts:
            results[name].error = results[name].error or info["error"]
    info["seconds"] = round(time.time() - t0, 1)
    return info


def run(scale: float, scrape_s: float, *, only: list[str] | None = None, keep: bool = False, secure: bool = True,
        log: Any = print) -> dict[str, Any]:
    t_start = time.monotonic()
    d = Drill(scale=scale, scrape_s=scrape_s, secure=secure)
    expected = rules.alert_names()
    windows_s = max(rules.range_windows()) * scale
    results: dict[str, AlertResult] = {}
    scenarios: list[dict[str, Any]] = []
    declared: set[str] = set()
    metrics_set: set[str] = set()
    panels: list[dict[str, Any]] = []
    setup_error = ""
    try:
        log(f"drill: services under {d.tmp}")
        d.start()
        chosen = [sc for sc in SCENARIOS if not only or sc.name in only]
        watch = MetricsWatch(d)  # the set-up too: the faults made then (at_setup) move metrics from there
        early = {sc.name: _start_early(d, sc) for sc in chosen if sc.at_setup}
        setup(d)
        seen, moved = watch.stop()
        declared |= seen
        metrics_set |= moved
        for sc in chosen:
            log(f"drill: scenario {sc.name}")
            watch = MetricsWatch(d)
            scenarios.append(_run_one(d, sc, results, windows_s, early.get(sc.name)))
            seen, moved = watch.stop()
            declared |= seen
            metrics_set |= moved
            log(f"drill:   {scenarios[-1]}")
        panels = d.panels()
    except Exception as e:  # noqa: BLE001 - reported in the JSON
        setup_error = f"{type(e).__name__}: {e}"
    finally:
        d.close()
        if not keep:
            teardown_dirs(d)
    fired = [n for n in expected if n in results and results[n].ok]
    with_data = [p for p in panels if p["series"]]
    return {
        "alerts": {"fired": len(fired), "expected": len(expected),
                   "details": {n: asdict(results[n]) if n in results else None for n in expected}},
        "panels": {"with_data": len(with_data), "total": len(rules.dashboard_queries("1s")),
                   "without_data": [p["panel"] + ": " + p["expr"] for p in panels if not p["series"]]},
        "metrics": {"set": len(metrics_set & declared), "declared": len(declared),
                    "unset": sorted(declared - metrics_set)},
        "scale": scale, "scrape_interval_s": scrape_s, "scenarios": scenarios, "error": setup_error,
        "orchd_at_start": d.served_at_start,
        "gpu_readings": GPU_READINGS,
        "nats_security": SECURITY if secure else "none: an open cluster (--insecure)",
        "wall_s": round(time.monotonic() - t_start, 1),
    }
