"""Build the Grafana files orchd ships: the dashboard and the Grafana-managed alert rules.

    python config/grafana/build.py          # rewrite dashboards/orchd.json and provisioning/alerting/orchd.yaml

The dashboard uses a datasource template variable (``${datasource}``), never ``__inputs``, so Grafana
can load it from disk at start. The alert rules are the Prometheus rules of
config/prometheus/alerts.yml (one source of truth), as Grafana-managed rules against the provisioned
datasource uid. tests/ops/test_grafana.py checks the committed files equal this output.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
DATASOURCE_UID = "orchd-prometheus"  # provisioning/datasources/orchd.yaml
DS = {"type": "prometheus", "uid": "${datasource}"}
LEADER = "and on(instance) orchd_up == 1"  # the leader's view of jobs/nodes (a standby's is stale)
JOB = 'job_id=~"$job_id"'


def _panel(pid: int, title: str, targets: list[tuple[str, str]], x: int, y: int, *, kind: str = "timeseries",
           unit: str = "short", w: int = 12, h: int = 8, description: str = "") -> dict:
    return {
        "id": pid, "type": kind, "title": title, "description": description, "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}} if kind == "timeseries" else {},
        "targets": [{"refId": chr(65 + i), "datasource": DS, "expr": expr, "legendFormat": legend}
                    for i, (expr, legend) in enumerate(targets)],
    }


def dashboard() -> dict:
    p = []
    row = 0

    def add(title: str, targets: list[tuple[str, str]], **kw) -> None:
        nonlocal row
        idx = len(p)
        w = kw.pop("w", 12)
        p.append(_panel(idx + 1, title, targets, x=(idx % 2) * 12, y=row, w=w, **kw))
        if idx % 2 == 1:
            row += 8

    add("Leader and NATS", [
        ("orchd_up", "leader {{instance}}"),
        ("orchd_nats_connected", "nats {{instance}}"),
        ("orchd_lease_revision", "lease rev {{instance}}"),
    ], description="orchd_up is 1 on the lease holder only")
    add("Jobs by state", [(f"sum by (state) (orchd_jobs {LEADER})", "{{state}}")])
    add("Nodes by cloud and pool", [
        (f"sum by (cloud, pool) (orchd_nodes{{state=~\"registered|running|noticed|draining\"}} {LEADER})",
         "{{cloud}} {{pool}}")])
    add("Nodes by state", [(f"sum by (state) (orchd_nodes {LEADER})", "{{state}}")])
    add("Preemptions (per pool, per hour)", [
        ("sum by (cloud, pool, kind) (increase(orchd_preemptions_total[1h]))", "{{cloud}} {{pool}} {{kind}}")])
    add("Recovery time (preemption to next first step)", [
        ("histogram_quantile(0.5, sum by (le) (rate(orchd_recovery_seconds_bucket[$__rate_interval])))", "p50"),
        ("histogram_quantile(0.95, sum by (le) (rate(orchd_recovery_seconds_bucket[$__rate_interval])))", "p95"),
    ], unit="s")
    add("Goodput", [(f"orchd_job_goodput_ratio{{{JOB}}} {LEADER}", "{{job_id}}")], unit="percentunit")
    add("Training step", [(f"orchd_job_step{{{JOB}}} {LEADER}", "{{job_id}}")])
    add("Cost vs on-demand", [
        (f"sum by (job_id) (orchd_job_cost_usd{{{JOB}}} {LEADER})", "{{job_id}} spot"),
        (f"sum by (job_id) (orchd_job_on_demand_cost_usd{{{JOB}}} {LEADER})", "{{job_id}} on-demand"),
        (f"sum by (job_id) (orchd_job_budget_usd{{{JOB}}} {LEADER})", "{{job_id}} budget"),
    ], unit="currencyUSD")
    add("Saving vs on-demand", [
        (f"1 - sum(orchd_job_cost_usd{{{JOB}}} {LEADER}) / sum(orchd_job_on_demand_cost_usd{{{JOB}}} {LEADER})",
         "saving")], kind="stat", unit="percentunit")
    add("GPU utilisation", [
        ("avg by (node) (orchd_node_gpu_utilization_ratio)", "{{node}}")], unit="percentunit")
    add("GPU temperature", [
        ("max by (node) (orchd_node_gpu_temperature_celsius)", "{{node}}")], unit="celsius")
    add("Heartbeat age", [(f"orchd_node_heartbeat_age_seconds {LEADER}", "{{node}}")], unit="s")
    add("Notice to checkpoint command", [
        ("histogram_quantile(0.99, sum by (le) (rate(orchd_notice_to_command_seconds_bucket[$__rate_interval])))",
         "p99")], unit="s")
    add("Emergency checkpoint margin (deadline - commit)", [
        ("histogram_quantile(0.05, sum by (le) "
         "(rate(orchd_emergency_checkpoint_margin_seconds_bucket[$__rate_interval])))", "p5"),
        ("sum(increase(orchd_emergency_checkpoint_missed_total[1h]))", "missed / h"),
    ], unit="s")
    add("Spot price / on-demand", [
        ("orchd_pool_price_usd_per_hour{market=\"spot\"} / on(instance, cloud, region, zone, instance_type) "
         "group_left() orchd_pool_on_demand_price_usd_per_hour", "{{cloud}} {{zone}} {{instance_type}}")],
        unit="percentunit")
    add("Event backlog and lag", [
        ("orchd_event_backlog", "backlog {{instance}}"),
        ("histogram_quantile(0.99, sum by (le) (rate(orchd_event_lag_seconds_bucket[$__rate_interval])))", "lag p99"),
    ])
    add("Provider calls by outcome", [
        ("sum by (cloud, op, outcome) (rate(orchd_provider_calls_total[$__rate_interval]))",
         "{{cloud}} {{op}} {{outcome}}")], unit="reqps")
    return {
        "uid": "orchd-overview",
        "title": "orchd - spot training control plane",
        "tags": ["orchd"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1, "regex": ""},
            {"name": "job_id", "label": "Job", "type": "query", "datasource": DS,
             "query": {"query": "label_values(orchd_job_step, job_id)", "refId": "job_id"},
             "definition": "label_values(orchd_job_step, job_id)",
             "multi": True, "includeAll": True, "allValue": ".*", "current": {}, "refresh": 2, "hide": 0},
        ]},
        "annotations": {"list": []},
        "panels": p,
    }


def alert_rules() -> dict:
    prom = yaml.safe_load((HERE.parent / "prometheus" / "alerts.yml").read_text())
    rules = []
    for group in prom["groups"]:
        for r in group["rules"]:
            uid = re.sub(r"(?<!^)(?=[A-Z])", "-", r["alert"]).lower()
            rules.append({
                "uid": uid[:40],
                "title": r["alert"],
                "condition": "B",
                "data": [
                    {"refId": "A", "relativeTimeRange": {"from": 3600, "to": 0}, "datasourceUid": DATASOURCE_UID,
                     "model": {"refId": "A", "expr": " ".join(r["expr"].split()), "instant": True}},
                    # The PromQL already filters: every series it returns is an alert, whatever its
                    # value (`orchd_nats_connected == 0` returns 0), so the condition is presence.
                    {"refId": "B", "datasourceUid": "__expr__",
                     "model": {"refId": "B", "type": "math", "expression": "$A * 0 + 1"}},
                ],
                "noDataState": "OK",
                "execErrState": "Error",
                "for": r.get("for", "0s"),
                "labels": dict(r.get("labels", {})),
                "annotations": {k: v.replace("{{ $value", "{{ $values.A.Value")
                                for k, v in r.get("annotations", {}).items()},
            })
    return {"apiVersion": 1, "groups": [{"orgId": 1, "name": "orchd", "folder": "orchd", "interval": "1m",
                                         "rules": rules}]}


def render() -> dict[Path, str]:
    header = "# Generated by config/grafana/build.py from config/prometheus/alerts.yml - do not edit by hand.\n"
    return {
        HERE / "dashboards" / "orchd.json": json.dumps(dashboard(), indent=2) + "\n",
        HERE / "provisioning" / "alerting" / "orchd.yaml": header + yaml.safe_dump(alert_rules(), sort_keys=False,
                                                                                    width=1000),
    }


if __name__ == "__main__":
    for path, text in render().items():
        path.write_text(text)
        print(f"wrote {path}", file=sys.stderr)
