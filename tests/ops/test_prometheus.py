"""Prometheus: alert rules load, their unit tests pass (each alert fires in one case and stays silent
in another), the tests can fail, and the names of every metric orchestrator.daemon.metrics declares pass
`promtool check metrics` and cover what the rules query.

Names only: whether orchd really sets each metric, from its real source, is tested against a running
orchd scraped by a real Prometheus in tests/ops/test_metrics_sources.py (which also runs `promtool check
metrics` on that live exposition)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest

from orchestrator.daemon.metrics import Metrics
from tests.conftest import require_tool

PROM = Path(__file__).resolve().parents[2] / "config" / "prometheus"
REQUIRED_ALERTS = {
    "OrchdDown", "OrchdNodeHeartbeatMissing", "OrchdTrainingStalled", "OrchdPreemptionStorm",
    "OrchdEmergencyCheckpointMissed", "OrchdBudgetNearlySpent", "OrchdPriceSpike",
    "OrchdNatsDisconnected", "OrchdEventBacklogGrowing", "OrchdDecideLoopStalled",
}


def _promtool(*args: str, cwd: Path = PROM, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_tool("promtool"), *args], cwd=cwd, input=stdin,
                          capture_output=True, text=True, timeout=60)


def _rules() -> list[dict]:
    doc = yaml.safe_load((PROM / "alerts.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def full_exposition() -> str:
    """Every metric Metrics declares, each with one placeholder sample (label values "x", value 1): the
    names, types and label names orchd can expose - not what it serves (see test_metrics_sources.py)."""
    m = Metrics()
    for metric in m.registry._names_to_collectors.values():  # noqa: SLF001 - only to enumerate
        names = getattr(metric, "_labelnames", ())
        child = metric.labels(*["x"] * len(names)) if names else metric
        if hasattr(child, "observe"):
            child.observe(1.0)
        elif hasattr(child, "inc") and metric._type == "counter":  # noqa: SLF001
            child.inc()
        else:
            child.set(1.0)
    return generate_latest(m.registry).decode()


def test_rules_load() -> None:
    res = _promtool("check", "rules", "alerts.yml")
    assert res.returncode == 0, res.stdout + res.stderr


def test_scrape_config_loads() -> None:
    res = _promtool("check", "config", "prometheus.yml")
    assert res.returncode == 0, res.stdout + res.stderr


def test_rule_unit_tests_pass() -> None:
    res = _promtool("test", "rules", "alerts_test.yml")
    assert res.returncode == 0, res.stdout + res.stderr


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    names = {r["alert"] for r in _rules()}
    assert names >= REQUIRED_ALERTS
    tests = yaml.safe_load((PROM / "alerts_test.yml").read_text())["tests"]
    fires, silent = set(), set()
    for t in tests:
        for case in t.get("alert_rule_test", []):
            (fires if case.get("exp_alerts") else silent).add(case["alertname"])
    assert names <= fires, names - fires
    assert names <= silent, names - silent


def test_rule_tests_can_fail(tmp_path: Path) -> None:
    """A changed threshold breaks the unit tests: they really evaluate the rules."""
    shutil.copy(PROM / "alerts_test.yml", tmp_path)
    text = (PROM / "alerts.yml").read_text()
    assert "orchd_job_budget_usd > 0.9" in text
    (tmp_path / "alerts.yml").write_text(text.replace("orchd_job_budget_usd > 0.9", "orchd_job_budget_usd > 0.99"))
    res = _promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert res.returncode != 0 and "OrchdBudgetNearlySpent" in res.stdout + res.stderr


def test_alerts_query_only_exported_metrics() -> None:
    exported = set(re.findall(r"^# TYPE (\S+) (\w+)", full_exposition(), re.M))
    names = {n for n, _ in exported}
    names |= {f"{n}_{s}" for n, t in exported if t == "histogram" for s in ("bucket", "sum", "count")}
    for rule in _rules():
        for used in re.findall(r"\borchd_[a-z0-9_]+", rule["expr"]):
            assert used in names, (rule["alert"], used)


def test_declared_metric_names_pass_promtool_check_metrics() -> None:
    exposition = full_exposition()
    assert "orchd_preemptions_total" in exposition and "orchd_job_phase" in exposition
    res = _promtool("check", "metrics", stdin=exposition)
    assert res.returncode == 0 and not (res.stdout + res.stderr).strip(), res.stdout + res.stderr


def test_check_metrics_would_catch_a_bad_name() -> None:
    bad = "# HELP orchd_requests Requests\n# TYPE orchd_requests counter\norchd_requests 1\n"
    res = _promtool("check", "metrics", stdin=bad)
    assert res.returncode != 0 or (res.stdout + res.stderr).strip()


@pytest.fixture(autouse=True)
def _need_promtool() -> None:
    require_tool("promtool")
