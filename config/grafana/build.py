"""Build the Grafana files orchd ships: the dashboard and the Grafana-managed alert rules.

    python config/grafana/build.py          # rewrite dashboards/orchd.json and provisioning/alerting/orchd.yaml

The dashboard is built with grafana-foundation-sdk (Grafana's own builder library, pinned in the ``dev``
extra: its releases differ in the JSON they write), so every field is one the SDK's dashboard schema
knows. Its panels pick their datasource through the ``${datasource}`` variable (never ``__inputs``, so
Grafana can load the file from disk at start), and that variable's saved value is the fixed uid of
provisioning/datasources/orchd.yaml: the dashboard opens on orchd's Prometheus whether or not the
organisation has a default datasource (Grafana picks another Prometheus datasource where that uid is
absent). The alert rules are the Prometheus rules of config/prometheus/alerts.yml (one source of
truth), as Grafana-managed rules against the same uid. tests/ops/test_grafana.py checks the committed
files equal this output.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

try:
    from grafana_foundation_sdk.builders import common as common_b
    from grafana_foundation_sdk.builders import dashboard as dashboard_b
    from grafana_foundation_sdk.builders import prometheus, stat, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import common
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, GridPos, VariableOption, VariableRefresh
except ModuleNotFoundError as e:  # a build-time tool: not in the runtime install
    raise SystemExit(f"config/grafana/build.py needs grafana-foundation-sdk ({e}): pip install -e '.[dev]'") from e

HERE = Path(__file__).resolve().parent
DATASOURCE_UID = "orchd-prometheus"  # provisioning/datasources/orchd.yaml
DATASOURCE_NAME = "Prometheus (orchd)"  # ditto
SCHEMA_VERSION = 39  # the dashboard JSON schema version Grafana migrates from (as before the SDK)
LEADER = "and on(instance) orchd_up == 1"  # the leader's view of jobs/nodes (a standby's is stale)
JOB = 'job_id=~"$job_id"'
PANEL_W, PANEL_H = 12, 8  # two panels per row of the 24-column grid


def _ds() -> DataSourceRef:
    return DataSourceRef(type_val="prometheus", uid="${datasource}")


# (title, [(PromQL, legend)], options): options are kind ("timeseries"|"stat"), unit, description.
Target = tuple[str, str]
PANELS: list[tuple[str, list[Target], dict[str, str]]] = [
    ("Leader and NATS", [
        ("orchd_up", "leader {{instance}}"),
        ("orchd_nats_connected", "nats {{instance}}"),
        ("orchd_lease_revision", "lease rev {{instance}}"),
    ], {"description": "orchd_up is 1 on the lease holder only"}),
    ("Jobs by state", [(f"sum by (state) (orchd_jobs {LEADER})", "{{state}}")], {}),
    ("Nodes by cloud and pool", [
        (f"sum by (cloud, pool) (orchd_nodes{{state=~\"registered|running|noticed|draining\"}} {LEADER})",
         "{{cloud}} {{pool}}")], {}),
    ("Nodes by state", [(f"sum by (state) (orchd_nodes {LEADER})", "{{state}}")], {}),
    ("Preemptions (per pool, per hour)", [
        ("sum by (cloud, pool, kind) (increase(orchd_preemptions_total[1h]))", "{{cloud}} {{pool}} {{kind}}")], {}),
    ("Recovery time (preemption to next first step)", [
        ("histogram_quantile(0.5, sum by (le) (rate(orchd_recovery_seconds_bucket[$__rate_interval])))", "p50"),
        ("histogram_quantile(0.95, sum by (le) (rate(orchd_recovery_seconds_bucket[$__rate_interval])))", "p95"),
    ], {"unit": "s"}),
    ("Goodput", [(f"orchd_job_goodput_ratio{{{JOB}}} {LEADER}", "{{job_id}}")], {"unit": "percentunit"}),
    ("Training step", [(f"orchd_job_step{{{JOB}}} {LEADER}", "{{job_id}}")], {}),
    ("Cost vs on-demand", [
        (f"sum by (job_id) (orchd_job_cost_usd{{{JOB}}} {LEADER})", "{{job_id}} spot"),
        (f"sum by (job_id) (orchd_job_on_demand_cost_usd{{{JOB}}} {LEADER})", "{{job_id}} on-demand"),
        (f"sum by (job_id) (orchd_job_budget_usd{{{JOB}}} {LEADER})", "{{job_id}} budget"),
    ], {"unit": "currencyUSD"}),
    ("Saving vs on-demand", [
        (f"1 - sum(orchd_job_cost_usd{{{JOB}}} {LEADER}) / sum(orchd_job_on_demand_cost_usd{{{JOB}}} {LEADER})",
         "saving")], {"kind": "stat", "unit": "percentunit"}),
    ("GPU utilisation", [
        ("avg by (node) (orchd_node_gpu_utilization_ratio)", "{{node}}")], {"unit": "percentunit"}),
    ("GPU temperature", [
        ("max by (node) (orchd_node_gpu_temperature_celsius)", "{{node}}")], {"unit": "celsius"}),
    ("Heartbeat age", [(f"orchd_node_heartbeat_age_seconds {LEADER}", "{{node}}")], {"unit": "s"}),
    ("Notice to checkpoint command", [
        ("histogram_quantile(0.99, sum by (le) (rate(orchd_notice_to_command_seconds_bucket[$__rate_interval])))",
         "p99")], {"unit": "s"}),
    ("Emergency checkpoint margin (deadline - commit)", [
        ("histogram_quantile(0.05, sum by (le) "
         "(rate(orchd_emergency_checkpoint_margin_seconds_bucket[$__rate_interval])))", "p5"),
        ("sum(increase(orchd_emergency_checkpoint_missed_total[1h]))", "missed / h"),
    ], {"unit": "s"}),
    ("Spot price / on-demand", [
        ("orchd_pool_price_usd_per_hour{market=\"spot\"} / on(instance, cloud, region, zone, instance_type) "
         "group_left() orchd_pool_on_demand_price_usd_per_hour", "{{cloud}} {{zone}} {{instance_type}}")],
        {"unit": "percentunit"}),
    ("Event backlog and lag", [
        ("orchd_event_backlog", "backlog {{instance}}"),
        ("histogram_quantile(0.99, sum by (le) (rate(orchd_event_lag_seconds_bucket[$__rate_interval])))", "lag p99"),
    ], {}),
    ("Provider calls by outcome", [
        ("sum by (cloud, op, outcome) (rate(orchd_provider_calls_total[$__rate_interval]))",
         "{{cloud}} {{op}} {{outcome}}")], {"unit": "reqps"}),
]


def _panel(index: int, title: str, targets: list[Target], opts: dict[str, str]) -> Any:
    """Panel ``index`` (0-based) of the two-column grid, with one Prometheus query per target."""
    kind = opts.get("kind", "timeseries")
    if kind == "stat":
        panel: Any = stat.Panel().reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]))
    else:
        # Grafana's own defaults, stated: the SDK's typed model then reads the panel back unchanged
        panel = timeseries.Panel().draw_style(common.GraphDrawStyle.LINE).line_width(1).legend(
            common_b.VizLegendOptions().show_legend(True).display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM))
    panel = (panel.id(index + 1).title(title).description(opts.get("description", "")).datasource(_ds())
             .grid_pos(GridPos(x=(index % 2) * PANEL_W, y=(index // 2) * PANEL_H, w=PANEL_W, h=PANEL_H))
             .unit(opts.get("unit", "short")))
    for i, (expr, legend) in enumerate(targets):
        panel = panel.with_target(prometheus.Dataquery().ref_id(chr(65 + i)).datasource(_ds()).expr(expr)
                                  .legend_format(legend))
    return panel


def dashboard_builder() -> dashboard_b.Dashboard:
    datasource = (dashboard_b.DatasourceVariable("datasource").id("datasource").label("Data source")
                  .type("prometheus").regex("")
                  .current(VariableOption(selected=True, text=DATASOURCE_NAME, value=DATASOURCE_UID)))
    job_query = "label_values(orchd_job_step, job_id)"
    job = (dashboard_b.QueryVariable("job_id").id("job_id").label("Job").datasource(_ds())
           .query({"query": job_query, "refId": "job_id"}).multi(True).include_all(True).all_value(".*")
           .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED))
    board = (dashboard_b.Dashboard("orchd - spot training control plane").uid("orchd-overview").tags(["orchd"])
             .timezone("utc").editable().version(1).refresh("30s").time("now-6h", "now")
             .with_variable(datasource).with_variable(job).annotations([]))
    for i, (title, targets, opts) in enumerate(PANELS):
        board = board.with_panel(_panel(i, title, targets, opts))
    return board


def dashboard() -> dict[str, Any]:
    """The dashboard's JSON model (what Grafana loads), from the SDK's own encoder."""
    model = dashboard_builder().build()
    model.schema_version = SCHEMA_VERSION
    out: dict[str, Any] = json.loads(json.dumps(model, cls=JSONEncoder))
    return out


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
