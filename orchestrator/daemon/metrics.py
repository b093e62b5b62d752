"""Prometheus metrics of orchd: one registry, every metric defined here.

Role: the names the daemon exports and that config/prometheus alert rules and the Grafana dashboard
query. Names pass ``promtool check metrics`` (counters get ``_total`` from prometheus_client, units in
the name). The shell updates them; the core never touches them.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

HOLD_REASONS = ("storage_error", "failed", "no_usable_checkpoint", "exited_early")
"""The reasons of the core's restart holds (docs/core.md, "Restart hold")."""


class _Registry(CollectorRegistry):
    """A registry that lists its collectors in the order they were registered (``/metrics`` renders
    them: ``metrics_http.Renderer``)."""

    def __init__(self) -> None:
        super().__init__()
        self.collectors: list[Any] = []

    def register(self, collector: Any) -> None:
        super().register(collector)
        self.collectors.append(collector)

    def unregister(self, collector: Any) -> None:
        super().unregister(collector)
        self.collectors.remove(collector)


class Metrics:
    """All orchd metrics on one registry (a fresh one per daemon, so tests can run several)."""

    def __init__(self) -> None:
        r = self.registry = _Registry()
        self.state_series: dict[Gauge, set[tuple[str, ...]]] = {}  # per gauge family: the series of the last
        # state refresh (``gauges.refresh_gauge_slices``: the ones not set again are removed)
        # In this order on /metrics:
        self._define_daemon_metrics(r)
        self._define_job_and_pool_metrics(r)
        self._define_dashboard_metrics(r)
        self.collectors = r.collectors
        self.bulk: tuple[Gauge, ...] = (  # a series per node or per job: /metrics writes them itself
            self.node_heartbeat_age, self.gpu_util, self.gpu_temp, self.cost, self.on_demand_cost, self.budget,
            self.job_step, self.goodput, self.job_phase, self.job_nodes,
        )

    def _define_daemon_metrics(self, r: CollectorRegistry) -> None:
        """Up, bus, state counts, the events through decide() and their latencies."""
        self.up = Gauge("orchd_up", "1 while orchd runs and holds the leader lease (0 on standby)", registry=r)
        self.nats_connected = Gauge("orchd_nats_connected", "1 while orchd is connected to NATS", registry=r)
        self.jobs = Gauge("orchd_jobs", "Jobs by state", ["state"], registry=r)
        self.nodes = Gauge("orchd_nodes", "Nodes by cloud, pool and state", ["cloud", "pool", "state"], registry=r)
        self.events = Counter("orchd_events", "Events through decide(), by type", ["type"], registry=r)
        self.rejected = Counter(
            "orchd_messages_rejected", "Messages rejected before decide(), by subject kind and reason",
            ["kind", "reason"], registry=r,
        )
        self.decisions = Counter("orchd_decisions", "Commands decided, by kind", ["kind"], registry=r)
        self.holds = Counter(
            "orchd_job_holds", "Restart holds (a generation ended by the trainer or a storage error), by reason",
            ["reason"], registry=r,
        )
        for reason in HOLD_REASONS:  # from 0: increase() sees the first hold
            self.holds.labels(reason)
        self.deadline_at_risk = Counter(
            "orchd_deadline_at_risk", "Decisions that put a job's deadline guarantee at risk (an on-demand launch "
            "failed: the job tries the other on-demand pools), by reason", ["reason"], registry=r,
        )
        self.deadline_at_risk.labels("on_demand_launch_failed")  # from 0: increase() sees the first
        self.preemptions = Counter(
            "orchd_preemptions", "Preemptions by cloud, pool and kind (notice|vanished)",
            ["cloud", "pool", "kind"], registry=r,
        )
        self.event_lag = Histogram(
            "orchd_event_lag_seconds", "Publish-to-decide lag of ingested events",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r,
        )
        self.backlog = Gauge("orchd_event_backlog", "Messages pending in the ingestion consumers", registry=r)
        self.decide_progress = Gauge(
            "orchd_decide_progress_timestamp_seconds",
            "When the decide loop last made progress (a batch decided, or nothing to decide); a leader whose "
            "value stops moving is stalled (alert OrchdDecideLoopStalled; the systemd watchdog restarts it)",
            registry=r)
        self.notice_to_command = Histogram(
            "orchd_notice_to_command_seconds", "Preemption notice publish to checkpoint command sent",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=r,
        )

    def _define_job_and_pool_metrics(self, r: CollectorRegistry) -> None:
        """Per job (cost, budget, step, recovery, checkpoints), per pool (prices), per node, per provider."""
        self.cost = Gauge("orchd_job_cost_usd", "Accrued cost per job", ["job_id"], registry=r)
        self.on_demand_cost = Gauge(
            "orchd_job_on_demand_cost_usd", "What the same node-hours would have cost on demand", ["job_id"], registry=r
        )
        self.budget = Gauge(
            "orchd_job_budget_usd", "Budget cap per job not yet finished (absent when none)", ["job_id"], registry=r
        )
        self.job_step = Gauge("orchd_job_step", "Last reported training step per job", ["job_id"], registry=r)
        self.recovery = Histogram(
            "orchd_recovery_seconds", "Preemption or failure to the next generation's first step",
            buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600), registry=r,
        )
        self.checkpoint_margin = Histogram(
            "orchd_emergency_checkpoint_margin_seconds", "Deadline minus commit time of emergency checkpoints",
            buckets=(-30, -10, -1, 0, 1, 5, 10, 20, 30, 60, 120), registry=r,
        )
        self.checkpoint_missed = Counter(
            "orchd_emergency_checkpoint_missed", "Emergency checkpoints that missed their deadline", ["job_id"],
            registry=r,
        )
        self.pool_price = Gauge(
            "orchd_pool_price_usd_per_hour", "Latest price per pool",
            ["cloud", "region", "zone", "instance_type", "market"], registry=r,
        )
        self.pool_on_demand_price = Gauge(
            "orchd_pool_on_demand_price_usd_per_hour", "On-demand price for the pool's instance type",
            ["cloud", "region", "zone", "instance_type"], registry=r,
        )
        self.node_heartbeat_age = Gauge(
            "orchd_node_heartbeat_age_seconds", "Seconds since each node's last heartbeat", ["node", "job_id"],
            registry=r,
        )
        self.gpu_util = Gauge("orchd_node_gpu_utilization_ratio", "GPU utilisation 0..1", ["node", "gpu"], registry=r)
        self.gpu_temp = Gauge("orchd_node_gpu_temperature_celsius", "GPU temperature", ["node", "gpu"], registry=r)
        self.provider_calls = Counter(
            "orchd_provider_calls", "Provider calls by cloud, op and outcome", ["cloud", "op", "outcome"], registry=r
        )
        self.goodput = Gauge("orchd_job_goodput_ratio", "Useful steps / executed steps per job", ["job_id"], registry=r)

    def _define_dashboard_metrics(self, r: CollectorRegistry) -> None:
        """Added for the alert rules (config/prometheus/alerts.yml) and the dashboard, and the decide
        loop's own cost."""
        self.job_phase = Gauge(
            "orchd_job_phase", "1 for each job's current phase (JobPhase value), 0 for the others it had",
            ["job_id", "phase"], registry=r,
        )
        self.job_nodes = Gauge(
            "orchd_job_nodes", "Live nodes of each job per pool", ["job_id", "cloud", "region", "zone", "instance_type",
                                                                  "market"], registry=r,
        )
        self.lease_revision = Gauge(
            "orchd_lease_revision", "Revision (fencing token) of the leader lease this orchd holds; 0 on standby",
            registry=r,
        )
        # The decide loop's own cost (orchestrator/daemon/loop.py):
        self.batch_seconds = Histogram(
            "orchd_batch_seconds", "Wall time of one decide batch (decide + persist + ack), by part",
            ["part"], buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=r,
        )
        self.batch_events = Histogram(
            "orchd_batch_events", "Events decided per batch",
            buckets=(1, 2, 5, 10, 50, 100, 500, 1000, 5000), registry=r,
        )
