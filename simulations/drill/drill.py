"""The drill's cluster and its observers: what ``python -m simulations.drill`` starts and reads.

``Drill`` starts the services (services.py) in order - the NATS cluster, orchd-1 (it takes the lease),
orchd-2 (standby), the webhook, Alertmanager, Prometheus - and offers what the scenarios need: orchctl
as a subprocess (JSON out), NATS publishing, alert waits through Prometheus's and Alertmanager's HTTP
APIs and the webhook, and snapshots of every orchd's live /metrics.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import nats
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.natsserver import NatsServer
from orchestrator.security.nats_auth import FEED_INBOX
from simulations.drill import rules
from simulations.drill.cluster_secrets import OBSERVER, Secrets
from simulations.drill.services import (
    ROOT,
    Alertmanager,
    DrillError,
    Orchd,
    Prometheus,
    Webhook,
    nats_cluster,
    wait_until,
)
from wire import logs

TRAINER = Path(__file__).with_name("drill_trainer.py")


@dataclass
class AlertResult:
    scenario: str
    fired_prometheus: bool = False
    fired_alertmanager: bool = False
    webhook_firing: bool = False
    resolved_prometheus: bool = False
    resolved_alertmanager: bool = False
    webhook_resolved: bool = False
    labels: dict[str, str] = field(default_factory=dict)
    """The label set that fired (the first one not active before the scenario)."""
    fired_after_s: float | None = None
    resolved_after_s: float | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return all((self.fired_prometheus, self.fired_alertmanager, self.webhook_firing, self.resolved_prometheus,
                    self.resolved_alertmanager, self.webhook_resolved))


@dataclass
class Drill:
    scale: float
    scrape_s: float
    tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="orch-drill-")))
    servers: list[NatsServer] = field(default_factory=list)
    orchds: list[Orchd] = field(default_factory=list)
    prom: Prometheus | None = None
    am: Alertmanager | None = None
    webhook: Webhook | None = None
    started: float = field(default_factory=time.time)
    am_seen: set[tuple[tuple[str, str], ...]] = field(default_factory=set)
    served_at_start: dict[str, dict[str, Any]] = field(default_factory=dict)
    secure: bool = True
    """TLS, the auth callout, per-node credentials and the operator role (cluster_secrets.py); False: an
    open cluster (``--insecure``)."""
    secrets: Secrets | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    # --- services --------------------------------------------------------------------------------

    def start(self) -> None:
        self.secrets = Secrets(self.tmp / "secrets") if self.secure else None
        self.servers = nats_cluster(self.tmp, self.secrets)
        urls = [s.url for s in self.servers]
        self.run_async(self.wait_jetstream)
        nodes = self.tmp / "nodes"
        self.orchds = [Orchd("orchd-1", self.tmp, urls, nodes_dir=nodes, secrets=self.secrets),
                       Orchd("orchd-2", self.tmp, urls[::-1], nodes_dir=nodes, secrets=self.secrets)]
        self._write_operator_config()
        self.orchds[0].start()
        wait_until(lambda: self.leader() is self.orchds[0], 60, "orchd-1 to lead")
        self.orchds[1].start()
        wait_until(lambda: '"standby"' in self.orchds[1].tail(100_000), 60, "orchd-2 to stand by")
        self.webhook = Webhook()
        self.am = Alertmanager(self.tmp, self.webhook.url)
        wait_until(self.am.ready, 30, "alertmanager to be ready")
        text = rules.scaled_rules(self.scale) if self.scale < 1 else rules.ALERTS.read_text()
        self.prom = Prometheus(self.tmp, [o.target for o in self.orchds], text, self.am.address, self.scrape_s)
        wait_until(self.prom.ready, 60, "prometheus to scrape an orchd")
        self.served_at_start = {o.name: {"role": "leader" if o is self.orchds[0] else "standby",
                                         "metrics_served": self.serves_metrics(o)} for o in self.orchds}
        threading.Thread(target=self._watch_alertmanager, name="drill-am-watch", daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        for closer in ([o.close for o in self.orchds]
                       + [c.close for c in (self.prom, self.am, self.webhook) if c is not None]
                       + [s.cleanup for s in self.servers]):
            with contextlib.suppress(Exception):
                closer()

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def run_async(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Any:
        return anyio.run(fn, *args, backend="asyncio")

    async def wait_jetstream(self) -> None:
        from nats.js.api import StreamConfig

        nc = await self.connect()
        try:
            js = nc.jetstream(timeout=1.0)
            with anyio.fail_after(30):
                while True:
                    try:
                        await js.add_stream(StreamConfig(name="drill_probe", subjects=["drill.probe"], num_replicas=3))
                        await js.delete_stream("drill_probe")
                        return
                    except nats.errors.Error:
                        await anyio.sleep(0.2)
        finally:
            await nc.close()

    async def connect(self, user: str = OBSERVER) -> Any:
        """A NATS connection of the drill: as ``user`` (cluster_secrets.py: the observer, or
        ``price-feed`` for price ticks under the feed role), over TLS, on a secure cluster."""
        async def quiet(_e: Exception) -> None:
            return None

        opts: dict[str, Any] = {}
        logs.quiet_asyncio_ssl_eof()  # as orchd, the agents and orchctl do (wire/logs.py)
        if self.secrets is not None:
            opts = {"user": user, "password": self.secrets.passwords[user],
                    "tls": ssl.create_default_context(cafile=self.secrets.tls.ca_file),
                    "inbox_prefix": FEED_INBOX if user == "price-feed" else "_INBOX"}
        return await nats.connect(servers=[s.url for s in self.servers if s.proc is not None], error_cb=quiet,
                                  max_reconnect_attempts=-1, reconnect_time_wait=0.2, connect_timeout=2, **opts)

    def _write_operator_config(self) -> None:
        """orchctl's --config: the servers and, on a secure cluster, the operator login (role orchctl)
        and the CA."""
        login = ""
        if self.secrets is not None:
            login = (f'user = "ops"\npassword = "{self.secrets.passwords["ops"]}"\n'
                     f'tls_ca_file = "{self.secrets.tls.ca_file}"\n')
        self.operator_config.write_text(f"[nats]\nurls = [{', '.join(repr(u) for u in self.urls)}]\n{login}")
        self.operator_config.chmod(0o600)

    @property
    def operator_config(self) -> Path:
        return self.tmp / "operator.toml"

    # --- orchctl ---------------------------------------------------------------------------------

    def ctl(self, *argv: str, check: bool = True) -> Any:
        """orchctl (a subprocess) against the cluster; its JSON output (``check``: exit 0 required)."""
        cmd = [sys.executable, "-m", "orchestrator.cli", "-o", "json", "--config", str(self.operator_config),
               "--server", ",".join(self.urls), "--timeout", "10", *argv]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_") and k != "CREDENTIALS_DIRECTORY"}
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
        if res.returncode != 0:
            if check:
                raise DrillError(f"orchctl {' '.join(argv)}: exit {res.returncode}: {res.stderr.strip()[-500:]}")
            return None
        return json.loads(res.stdout) if res.stdout.strip() else None

    def leader(self) -> Orchd | None:
        st = self.ctl("status", check=False)
        return next((o for o in self.orchds if st and o.proc is not None and o.proc.pid == st.get("pid")), None)

    def job_nodes(self, job: str) -> list[dict[str, Any]]:
        return list(self.ctl("nodes", "list", "--job", job)["nodes"])

    def running_nodes(self, job: str, n: int, after_generation: int = 0) -> list[dict[str, Any]]:
        nodes = [x for x in self.job_nodes(job)
                 if x["phase"] == "running" and x["step"] > 0 and x["generation"] > after_generation]
        return nodes if len(nodes) >= n else []

    def job(self, job: str) -> dict[str, Any]:
        return dict(self.ctl("jobs", "show", job)["summary"])

    def submit(self, job: str, *, nodes: int, budget_usd: float | None = None, market: str = "spot_with_fallback",
               check: bool = True, zones: tuple[str, ...] = ("local-a", "local-b"), extra: str = "") -> None:
        """``extra``: more top-level keys of the job file (TOML lines)."""
        budget = f"budget_usd = {budget_usd}\n" if budget_usd is not None else ""
        budget += f"zones = {list(zones)!r}\n".replace("'", '"') + extra
        spec = self.tmp / f"{job}.toml"
        spec.write_text(f"""
name = "{job}"
total_steps = 10000000
gpu_type = "cpu"
gpus_per_node = 1
nodes = {nodes}
nodes_min = 1
nodes_max = {nodes}
clouds = ["local"]
market = "{market}"
{budget}[checkpoint]
url = "file://{self.ckpt_dir(job)}"
interval_s = 600
save_s_estimate = 2.0
[trainer]
command = ["{sys.executable}", "{TRAINER}"]
args = {{ step_time_s = 0.1, ckpt_every_s = 2.0, emergency_save_s = 1.5 }}
""")
        self.ctl("jobs", "submit", str(spec), "--id", job, check=check)

    def ckpt_dir(self, job: str) -> Path:
        return self.tmp / "ckpt" / job

    # --- alerts ----------------------------------------------------------------------------------

    def _watch_alertmanager(self) -> None:
        while not self._stop.wait(0.5):
            with contextlib.suppress(Exception):
                assert self.am is not None
                for a in self.am.alerts():
                    if a.get("status", {}).get("state") == "active":
                        self.am_seen.add(tuple(sorted(a["labels"].items())))

    def active_alerts(self) -> set[tuple[tuple[str, str], ...]]:
        """The label sets of the alerts Prometheus has pending or firing now."""
        assert self.prom is not None
        return {tuple(sorted(a["labels"].items())) for a in self.prom.alerts()}

    def fired(self, name: str, since: float, before: set[tuple[tuple[str, str], ...]]) -> dict[str, str]:
        """The labels of ``name`` firing in Prometheus at some evaluation since ``since`` (the ALERTS
        series), for a label set that was not active already at ``since`` (``before``); {} if none."""
        assert self.prom is not None
        data = self.prom.api("query_range", query=f'ALERTS{{alertname="{name}",alertstate="firing"}}',
                             start=f"{since:.3f}", end=f"{time.time():.3f}", step=f"{self.scrape_s}")
        for series in data["result"]:
            labels = {k: v for k, v in series["metric"].items() if k not in ("__name__", "alertstate")}
            if tuple(sorted(labels.items())) not in before:
                return dict(labels)
        return {}

    def wait_fired(self, names: list[str], res: dict[str, AlertResult], since: float, timeout_s: float,
                   before: set[tuple[tuple[str, str], ...]]) -> None:
        assert self.webhook is not None
        deadline = time.monotonic() + timeout_s
        while True:
            for n in names:
                r = res[n]
                if not r.labels:
                    r.labels = self.fired(n, since, before)
                    r.fired_prometheus = bool(r.labels)
                key = tuple(sorted(r.labels.items()))
                r.fired_alertmanager = bool(r.labels) and key in self.am_seen
                r.webhook_firing = bool(r.labels) and "firing" in self.webhook.statuses(r.labels)
                if r.fired_after_s is None and r.fired_prometheus and r.fired_alertmanager and r.webhook_firing:
                    r.fired_after_s = round(time.time() - since, 1)
            if all(res[n].fired_after_s is not None for n in names):
                return
            if time.monotonic() > deadline:
                missing = [n for n in names if res[n].fired_after_s is None]
                raise DrillError(f"not fired in {timeout_s:.0f} s: {missing}")
            time.sleep(0.5)

    def wait_resolved(self, names: list[str], res: dict[str, AlertResult], since: float, timeout_s: float) -> None:
        assert self.prom is not None and self.am is not None and self.webhook is not None
        deadline = time.monotonic() + timeout_s
        while True:
            prom = self.active_alerts()
            am = {tuple(sorted(a["labels"].items())) for a in self.am.alerts()
                  if a.get("status", {}).get("state") == "active"}
            for n in names:
                r = res[n]
                key = tuple(sorted(r.labels.items()))
                r.resolved_prometheus = key not in prom
                r.resolved_alertmanager = key not in am
                r.webhook_resolved = "resolved" in self.webhook.statuses(r.labels)
                if r.ok and r.resolved_after_s is None:
                    r.resolved_after_s = round(time.time() - since, 1)
            if all(res[n].ok for n in names):
                return
            if time.monotonic() > deadline:
                raise DrillError(f"not resolved in {timeout_s:.0f} s: {[n for n in names if not res[n].ok]}")
            time.sleep(0.5)

    # --- metrics and panels ----------------------------------------------------------------------

    def serves_metrics(self, o: Orchd) -> bool:
        try:
            with urllib.request.urlopen(f"http://{o.target}/metrics", timeout=5) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def snapshot(self) -> dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
        """family -> {(sample name, labels): value} over every live orchd's /metrics (``instance`` in the labels)."""
        out: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        for o in self.orchds:
            if not o.alive():
                continue
            try:
                with urllib.request.urlopen(f"http://{o.target}/metrics", timeout=5) as r:
                    text = r.read().decode()
            except OSError:
                continue
            for fam in text_string_to_metric_families(text):
                if fam.name.endswith("_created"):  # a counter's or histogram's creation time, not a metric
                    continue
                samples = out.setdefault(fam.name, {})
                for s in fam.samples:
                    if s.name.endswith("_created") or (isinstance(s.value, float) and math.isnan(s.value)):
                        continue
                    samples[(s.name, tuple(sorted({**s.labels, "instance": o.name}.items())))] = s.value
        return out

    def panels(self) -> list[dict[str, Any]]:
        """Every dashboard target over the drill's span (a range query): with data when any step had some."""
        assert self.prom is not None
        out = []
        for title, expr in rules.dashboard_queries(f"{max(4 * self.scrape_s, 1):g}s"):
            data = self.prom.api("query_range", query=expr, start=f"{self.started:.3f}", end=f"{time.time():.3f}",
                                 step=f"{self.scrape_s}")
            out.append({"panel": title, "expr": expr, "series": len(data["result"])})
        return out
