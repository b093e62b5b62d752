"""Grafana files: structure Grafana needs to load them at start, and every PromQL they hold parses
(promtool check rules on a scratch rules file with one recording rule per expression)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml

from tests.conftest import require_tool
from tests.ops.test_prometheus import full_exposition

GRAFANA = Path(__file__).resolve().parents[2] / "config" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "orchd.json"
# Grafana's own variables, replaced by values of the same kind before PromQL parsing.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h", "$job_id": ".*"}


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _provisioning(kind: str) -> dict:
    files = sorted((GRAFANA / "provisioning" / kind).glob("*.yaml"))
    assert files, kind
    return yaml.safe_load(files[0].read_text())


def _dashboard_exprs() -> list[str]:
    return [t["expr"] for p in _dashboard()["panels"] for t in p["targets"]]


def _alert_exprs() -> list[str]:
    return [d["model"]["expr"] for g in _provisioning("alerting")["groups"] for r in g["rules"]
            for d in r["data"] if d["datasourceUid"] != "__expr__"]


def promql_problems(exprs: list[str], tmp_path: Path) -> str:
    """'' when every expression parses, else promtool's complaint."""
    def fill(expr: str) -> str:
        for var, value in GRAFANA_VARS.items():
            expr = expr.replace(var, value)
        assert "$" not in expr.replace("$1", ""), f"unknown Grafana variable in {expr}"
        return expr

    rules = {"groups": [{"name": "parse", "rules": [{"record": f"parse:expr{i}", "expr": fill(e)}
                                                    for i, e in enumerate(exprs)]}]}
    path = tmp_path / "exprs.yml"
    path.write_text(yaml.safe_dump(rules))
    res = subprocess.run([require_tool("promtool"), "check", "rules", str(path)],
                         capture_output=True, text=True, timeout=60)
    return "" if res.returncode == 0 else res.stdout + res.stderr


def test_dashboard_loads_from_disk_with_a_datasource_variable() -> None:
    d = _dashboard()
    text = DASHBOARD.read_text()
    assert "__inputs" not in d and "${DS_" not in text
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert d["uid"] and d["title"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
        assert {"x", "y", "w", "h"} <= set(p["gridPos"])


def test_dashboard_covers_the_operator_questions() -> None:
    titles = " | ".join(p["title"].lower() for p in _dashboard()["panels"])
    for topic in ("jobs", "nodes by cloud and pool", "preemptions", "recovery", "goodput", "on-demand",
                  "gpu utilisation", "gpu temperature"):
        assert topic in titles, topic


def test_every_promql_parses(tmp_path: Path) -> None:
    exprs = _dashboard_exprs() + _alert_exprs()
    assert len(exprs) > 20
    assert promql_problems(exprs, tmp_path) == ""


def test_parse_check_can_fail(tmp_path: Path) -> None:
    assert "parse" in promql_problems(["sum by (job_id (orchd_job_step)"], tmp_path).lower()


def test_queries_use_exported_metrics() -> None:
    exported = set(re.findall(r"^# TYPE (\S+) (\w+)", full_exposition(), re.M))
    names = {n for n, _ in exported} | {f"{n}_{s}" for n, t in exported if t == "histogram"
                                        for s in ("bucket", "sum", "count")}
    for expr in _dashboard_exprs() + _alert_exprs():
        for used in re.findall(r"\borchd_[a-z0-9_]+", expr):
            assert used in names, (expr, used)


def test_provisioning_files() -> None:
    ds = _provisioning("datasources")
    assert ds["apiVersion"] == 1
    uids = {d["uid"] for d in ds["datasources"]}
    assert all(d["type"] == "prometheus" and d["url"] for d in ds["datasources"])

    dash = _provisioning("dashboards")
    assert dash["apiVersion"] == 1 and dash["providers"][0]["type"] == "file"
    assert dash["providers"][0]["options"]["path"]

    alerting = _provisioning("alerting")
    assert alerting["apiVersion"] == 1
    prom = yaml.safe_load((GRAFANA.parent / "prometheus" / "alerts.yml").read_text())
    prom_alerts = {r["alert"]: r for g in prom["groups"] for r in g["rules"]}
    seen = set()
    for group in alerting["groups"]:
        assert group["name"] and group["folder"] and group["interval"]
        for rule in group["rules"]:
            assert rule["uid"] and len(rule["uid"]) <= 40
            ref_ids = {d["refId"] for d in rule["data"]}
            assert rule["condition"] in ref_ids
            for d in rule["data"]:
                assert d["datasourceUid"] in uids | {"__expr__"}
                assert d["model"]["refId"] == d["refId"]
            query = next(d for d in rule["data"] if d["datasourceUid"] != "__expr__")
            source = prom_alerts[rule["title"]]
            assert query["model"]["expr"] == " ".join(source["expr"].split())
            seen.add(rule["title"])
    assert seen == set(prom_alerts)


def test_committed_files_match_the_generator() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("grafana_build", GRAFANA / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for path, text in mod.render().items():
        assert path.read_text() == text, f"{path} is stale: run python config/grafana/build.py"
