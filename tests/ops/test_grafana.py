"""Grafana files: structure Grafana needs to load them at start, the dashboard built by
grafana-foundation-sdk and within its schema, every panel of the first release kept, every PromQL parses
(promtool check rules on a scratch rules file with one recording rule per expression) and names only
metrics the daemon's registry declares, and datasource provisioning that needs no default datasource."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.conftest import IN_CI, require_tool
from tests.ops.test_prometheus import full_exposition

GRAFANA = Path(__file__).resolve().parents[2] / "config" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "orchd.json"
# The panels and variables of the hand-assembled dashboard this builder replaced.
FIRST_RELEASE = Path(__file__).resolve().parent / "fixtures" / "grafana_panels.json"
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


def _variable_queries() -> list[str]:
    """The query variables' Grafana queries (``label_values(metric, label)``: Grafana's, not PromQL)."""
    return [v["query"]["query"] for v in _dashboard()["templating"]["list"] if v["type"] == "query"]


def _sdk() -> None:
    """grafana-foundation-sdk (the dev extra): skip where missing, except in CI."""
    if importlib.util.find_spec("grafana_foundation_sdk") is None:
        if IN_CI:
            pytest.fail("grafana-foundation-sdk is required in CI (pip install -e '.[dev]')")
        pytest.skip("grafana-foundation-sdk not installed")


def _build_module() -> ModuleType:
    _sdk()
    spec = importlib.util.spec_from_file_location("grafana_build", GRAFANA / "build.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
    # Saved with the provisioned datasource selected: no reliance on the organisation's default.
    provisioned = {ds["uid"] for ds in _provisioning("datasources")["datasources"]}
    assert variables["datasource"]["current"].get("value") in provisioned, variables["datasource"]["current"]
    assert variables["job_id"]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    assert d["uid"] and d["title"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
        assert {"x", "y", "w", "h"} <= set(p["gridPos"])
        if p["type"] == "timeseries":
            assert p["options"]["legend"]["showLegend"] is True, p["title"]


def test_every_panel_and_variable_of_the_first_release_survives() -> None:
    """Same titles in the same order, same kind and unit, same (expression, legend) per query."""
    before = json.loads(FIRST_RELEASE.read_text())
    d = _dashboard()
    now = [{"title": p["title"], "type": p["type"], "unit": p["fieldConfig"]["defaults"]["unit"],
            "targets": [[t["expr"], t["legendFormat"]] for t in p["targets"]]} for p in d["panels"]]
    assert now == before["panels"]
    variables = [{"name": v["name"], "type": v["type"], "query": v["query"]} for v in d["templating"]["list"]]
    assert variables == before["variables"]


def sdk_round_trip(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` decoded by the SDK's typed dashboard model (panel options, field config and Prometheus
    queries by their plugins' schemas) and encoded again: what the schema does not know is lost."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard

    register_default_plugins()
    out: dict[str, Any] = json.loads(json.dumps(Dashboard.from_json(d), cls=JSONEncoder))
    return out


def test_dashboard_is_the_sdk_builder_output_and_within_its_schema() -> None:
    """build.py assembles the dashboard with grafana-foundation-sdk's builders, and the committed JSON
    is a fixed point of the SDK's typed model: decoding it and encoding it again loses and adds nothing
    (a field outside the schema, a misspelt key, a wrong nesting would not survive)."""
    from grafana_foundation_sdk.builders.dashboard import Dashboard as DashboardBuilder

    mod = _build_module()
    assert isinstance(mod.dashboard_builder(), DashboardBuilder)
    committed = _dashboard()
    assert mod.dashboard() == committed
    assert sdk_round_trip(committed) == committed


@pytest.mark.parametrize("where", ["dashboard", "panel", "options", "query"])
def test_schema_check_can_fail(where: str) -> None:
    _sdk()
    d = _dashboard()
    target = {"dashboard": d, "panel": d["panels"][0], "options": d["panels"][0]["options"]["legend"],
              "query": d["panels"][0]["targets"][0]}[where]
    target["legendPlacement" if where == "options" else "exprr" if where == "query" else "gridpos"] = "x"
    assert sdk_round_trip(d) != d


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


def _exported_series() -> set[str]:
    """The series names orchd's registry (orchestrator/daemon/metrics.py) exposes: counters with
    ``_total``, histograms with ``_bucket``/``_sum``/``_count``. The agent exports no Prometheus metrics:
    its GPU figures reach Prometheus through orchd (``orchd_node_gpu_*``, from heartbeats)."""
    return set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", full_exposition(), re.M))


def unknown_metrics(exprs: list[str]) -> list[tuple[str, str]]:
    names = _exported_series()
    return [(expr, used) for expr in exprs for used in re.findall(r"\borchd_[a-z0-9_]+", expr) if used not in names]


def test_queries_use_exported_metrics() -> None:
    exprs = _dashboard_exprs() + _variable_queries() + _alert_exprs()
    assert any("orchd_preemptions_total" in e for e in exprs) and any("_bucket[" in e for e in exprs)
    assert unknown_metrics(exprs) == []


def test_metric_check_can_fail() -> None:
    assert unknown_metrics(["sum(orchd_preemptions)", "orchd_job_step"]) == [("sum(orchd_preemptions)",
                                                                            "orchd_preemptions")]


def test_provisioning_files() -> None:
    ds = _provisioning("datasources")
    assert ds["apiVersion"] == 1
    uids = {d["uid"] for d in ds["datasources"]}
    assert all(d["type"] == "prometheus" and d["url"] for d in ds["datasources"])
    # Grafana refuses a provisioned default where the organisation already has one; nothing needs it.
    assert not any("isDefault" in d for d in ds["datasources"]), "datasource provisioning must not set isDefault"

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
    for path, text in _build_module().render().items():
        assert path.read_text() == text, f"{path} is stale: run python config/grafana/build.py"
