"""Every metric orchd declares is set from its real source, as a real Prometheus scrapes it.

One operator's day, on loopback: a real nats-server, orchd (in this process, the real core) with the
file-backed fake cloud, simulated agents (``simulations.chaos.agents.SimFleet``) whose heartbeats carry
the GPU readings of the agent's own NVML reader (``agent.heartbeat.SystemSampler``) over a stub NVML
binding - the hardware edge - and Debian's ``prometheus`` scraping orchd's ``/metrics`` every second.

    a job runs on spot           heartbeat age, GPU utilisation and temperature, on-demand cost, goodput
    its node vanishes (no notice) preemptions{kind="vanished"}, recovery time; the lost steps lower goodput
    a notice it cannot meet      emergency checkpoint margin (negative) and a miss; the alert fires;
                                  the replacement runs on demand
    on-demand refused            a deadline job's on-demand launch fails: the deadline is at risk
    the market consumer paused   event backlog
    NVML stops answering         the GPU series go away (no reading: no value)

Each value is read back through Prometheus's HTTP API; then every metric of orchd's live registry must
have a sample with a non-zero value (histograms: observations), and the real exposition passes
``promtool check metrics``. Wall time: about 25 s (the scenario; the other tests here take under a second).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import nats
import pytest
import yaml

import wire as ev
from agent.heartbeat import SystemSampler
from orchestrator import bus
from orchestrator.daemon.run import run_daemon
from orchestrator.natsserver import NatsServer
from orchestrator.settings import load_settings
from simulations.chaos.agents import SimFleet
from simulations.fakecloud import FileFakeCloud
from tests.conftest import free_port, require_tool
from tests.integration import helpers as h

pytestmark = pytest.mark.anyio

PROM_CONFIG = Path(__file__).resolve().parents[2] / "config" / "prometheus"

JOB = """
name = "metrics"
total_steps = 1000000
gpu_type = "A100"
gpus_per_node = 1
budget_usd = 500.0
clouds = ["fake"]
market = "spot_with_fallback"
[checkpoint]
url = "file:///tmp/orch-metrics-ckpt"
interval_s = 600
"""


RISK_JOB = """
name = "metrics-risk"
total_steps = 1000
step_time_s_estimate = 1.0
gpu_type = "A100"
gpus_per_node = 1
clouds = ["fake"]
zones = ["r1b"]
market = "on_demand"
deadline_in = "30d"
[checkpoint]
url = "file:///tmp/orch-metrics-risk-ckpt"
"""


class StubNvml:
    """The functions of ``pynvml`` that ``SystemSampler`` calls, answering for two GPUs (the hardware edge:
    the agent's reader is the product's; only the driver is simulated). ``broken``: every read fails."""

    NVML_TEMPERATURE_GPU = 0

    class NVMLError(Exception):
        pass

    class _Util:
        def __init__(self, gpu: float) -> None:
            self.gpu, self.memory = gpu, 0.0

    class _Mem:
        used, total = 20 * 2**30, 80 * 2**30

    def __init__(self) -> None:
        self.util = [37.0, 81.0]
        self.temp = [55.0, 61.0]
        self.broken = False

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        pass

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.util)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:  # noqa: N802
        return i

    def _check(self) -> None:
        if self.broken:
            raise self.NVMLError("GPU is lost")

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:  # noqa: N802
        self._check()
        return self._Util(self.util[h])

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:  # noqa: N802
        self._check()
        return self._Mem()

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> float:  # noqa: N802
        self._check()
        return self.temp[h]

    def nvmlDeviceGetPowerUsage(self, h: int) -> float:  # noqa: N802
        self._check()
        return 300_000.0


class Prometheus:
    """Debian's prometheus on a free loopback port, scraping one target every second, with orchd's rules."""

    def __init__(self, tmp: Path, target: str) -> None:
        self.port = free_port()
        (tmp / "alerts.yml").write_text((PROM_CONFIG / "alerts.yml").read_text())
        cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": ["alerts.yml"],
               "scrape_configs": [{"job_name": "orchd", "static_configs": [{"targets": [target]}]}]}
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        self.log = (tmp / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [require_tool("prometheus"), f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, promql: str) -> list[tuple[dict[str, str], float]]:
        return [(s["metric"], float(s["value"][1])) for s in self.api("query", query=promql)["result"]]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture
def nats_srv(tmp_path: Path) -> Iterator[NatsServer]:
    s = NatsServer(tmp_path / "nats").start()
    yield s
    s.cleanup()


async def _until(prom: Prometheus, promql: str, ok: Any = lambda v: True, timeout: float = 20.0,
                 ) -> list[tuple[dict[str, str], float]]:
    """The samples of ``promql`` once one of them has a value ``ok`` accepts (polled through the API)."""
    deadline = time.monotonic() + timeout
    last: list[tuple[dict[str, str], float]] = []
    while time.monotonic() < deadline:
        try:
            last = await anyio.to_thread.run_sync(prom.query, promql)
        except OSError:  # prometheus still starting
            last = []
        if any(ok(v) for _m, v in last):
            return last
        await anyio.sleep(0.5)
    raise AssertionError(f"{promql}: no accepted sample in {timeout}s, last {last}")


def _gen_node(d: Any, job_id: str, gen: int) -> Any:
    """The node running generation ``gen`` of the job, once it reports a step of that generation."""
    job = d.state.jobs[job_id]
    if job.generation != gen or job.phase != "running":
        return None
    nodes = [d.state.nodes[n] for n in job.gen_nodes if n in d.state.nodes]
    return nodes[0] if nodes and nodes[0].step > job.committed_step else None


async def test_every_metric_from_its_source(nats_srv: NatsServer, tmp_path: Path) -> None:
    metrics_port = free_port()
    settings = load_settings(h.write_config(tmp_path, nats_srv.url, metrics_port=metrics_port),
                             env={"ORCH_METRICS__REFRESH_S": "0.5"})  # the state gauges every 0.5 s, not 10 s
    cloud = FileFakeCloud(tmp_path / "cloud.json")
    nvml = StubNvml()
    prom = Prometheus(tmp_path, f"127.0.0.1:{metrics_port}")
    nc = await nats.connect(nats_srv.url)
    js = nc.jetstream()
    (tmp_path / "job.toml").write_text(JOB)
    try:
        async with anyio.create_task_group() as tg:
            d = await tg.start(lambda task_status: run_daemon(settings, {"fake": cloud}, task_status=task_status))
            fleet = SimFleet(nc, cloud.state_file, step_s=0.05, hb_s=0.2, sampler=SystemSampler(nvml=nvml))
            fleet_scope = anyio.CancelScope()

            async def run_fleet() -> None:
                with fleet_scope:
                    await fleet.run()

            tg.start_soon(run_fleet)
            await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL, 1.0, 3.0))
            await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL_OD, 3.0, 3.0))
            await h.wait_for(lambda: len(d.state.pools) == 2)
            code, out, err = await h.actl(nats_srv.url, "jobs", "submit", str(tmp_path / "job.toml"), "-o", "json")
            assert code == 0, err
            job_id = json.loads(out)["job_id"]
            await _scenario(d, prom, fleet, cloud, nvml, js, job_id, (nats_srv.url, tmp_path))
            fleet_scope.cancel()
            d.request_stop()
    finally:
        await nc.close()
        prom.stop()


async def _scenario(d: Any, prom: Prometheus, fleet: SimFleet, cloud: FileFakeCloud, nvml: StubNvml, js: Any,
                    job_id: str, where: tuple[str, Path]) -> None:
    # 1. training on spot: heartbeats with GPU readings
    n1 = await h.wait_for(lambda: _gen_node(d, job_id, 1), timeout=20)
    assert n1.pool == h.POOL
    age = await _until(prom, f'orchd_node_heartbeat_age_seconds{{node="{n1.node_id}",job_id="{job_id}"}}')
    assert 0 <= age[0][1] < 5
    util = await _until(prom, f'orchd_node_gpu_utilization_ratio{{node="{n1.node_id}"}}')
    assert {m["gpu"]: v for m, v in util} == {"0": pytest.approx(0.37), "1": pytest.approx(0.81)}
    temp = await _until(prom, f'orchd_node_gpu_temperature_celsius{{node="{n1.node_id}"}}')
    assert {m["gpu"]: v for m, v in temp} == {"0": 55.0, "1": 61.0}
    await _until(prom, f'orchd_job_on_demand_cost_usd{{job_id="{job_id}"}}', lambda v: v > 0)
    await _until(prom, f'orchd_job_goodput_ratio{{job_id="{job_id}"}}', lambda v: v == 1.0)

    # 2. the instance vanishes without notice: found by the heartbeat timeout, replaced; the steps since
    #    the last checkpoint (none yet) are lost
    await h.wait_for(lambda: d.state.nodes[n1.node_id].step >= 20, timeout=10)
    cloud.preempt(n1.instance_id)
    n2 = await h.wait_for(lambda: _gen_node(d, job_id, 2), timeout=30)
    await _until(prom, 'orchd_preemptions_total{kind="vanished"}', lambda v: v == 1)
    await _until(prom, "orchd_recovery_seconds_count", lambda v: v == 1)
    goodput = await _until(prom, f'orchd_job_goodput_ratio{{job_id="{job_id}"}}', lambda v: 0 < v < 1)
    assert 0 < goodput[0][1] < 1

    # 3. a notice whose deadline has passed when the checkpoint commits: a negative margin, a miss, the
    #    alert; the replacement avoids the noticed spot pool: on demand
    await h.wait_for(lambda: d.state.nodes[n2.node_id].step > 5, timeout=10)
    fleet.publish_notice(n2.node_id, deadline_s=0.0)
    n3 = await h.wait_for(lambda: _gen_node(d, job_id, 3), timeout=30)
    assert h.POOL_OD in (n2.pool, n3.pool)  # the notice closed the spot pool for a while: on demand
    margin = await _until(prom, "orchd_emergency_checkpoint_margin_seconds_count", lambda v: v == 1)
    assert margin
    neg = await _until(prom, 'orchd_emergency_checkpoint_margin_seconds_bucket{le="0.0"}', lambda v: v == 1)
    assert neg
    await _until(prom, f'orchd_emergency_checkpoint_missed_total{{job_id="{job_id}"}}', lambda v: v == 1)
    await _until(prom, "orchd_recovery_seconds_count", lambda v: v == 2)
    alerts = await _until(prom, 'ALERTS{alertname="OrchdEmergencyCheckpointMissed"}', lambda v: v == 1)
    assert alerts[0][0]["job_id"] == job_id
    od = await _until(prom, f'orchd_job_on_demand_cost_usd{{job_id="{job_id}"}}', lambda v: v > 0)
    cost = await _until(prom, f'orchd_job_cost_usd{{job_id="{job_id}"}}', lambda v: v > 0)
    assert od[0][1] > cost[0][1]  # the spot node-hours (a third of on-demand) cost more on demand

    # 4. an on-demand launch of a job with a deadline fails (zone r1b has no on-demand capacity): the
    #    guarantee is at risk, orchd retries the job's other on-demand pools
    od_b = ev.PoolKey(cloud="fake", region="r1", zone="r1b", instance_type="gpu.small", market=ev.Market.ON_DEMAND)
    cloud.capacity[od_b] = 0
    await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(od_b, 3.0, 3.0))
    await h.wait_for(lambda: od_b.name in d.state.pools)
    nats_url, tmp = where
    (tmp / "risk.toml").write_text(RISK_JOB)
    code, _, err = await h.actl(nats_url, "jobs", "submit", str(tmp / "risk.toml"), "--id", "metrics-risk")
    assert code == 0, err
    await _until(prom, 'orchd_deadline_at_risk_total{reason="on_demand_launch_failed"}', lambda v: v >= 1)

    # 5. the market consumer paused by an operator: price ticks pile up in the stream
    until = (datetime.now(UTC) + timedelta(minutes=5)).isoformat().replace("+00:00", "Z")
    await js.pause_consumer(bus.STREAM_MARKET, bus.CONSUMER_MARKET, until)
    for i in range(150):
        await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL, 1.0 + i / 1000, 3.0))
    await js.publish(ev.subject_notice("fake", "ghost"), b"{not json")  # counted as rejected
    await _until(prom, "orchd_event_backlog", lambda v: v >= 150)

    # 6. the checkpoint store fails: the generation ends with a storage error, orchd holds the job
    await h.publish_js(js, ev.subject_node_event(n3.node_id), ev.RanksExited(
        id="x-storage", node_id=n3.node_id, job_id=job_id, generation=3, exit_code=76, reason="storage_error",
        last_step=d.state.nodes[n3.node_id].step, ts=time.time()))
    await _until(prom, 'orchd_job_holds_total{reason="storage_error"}', lambda v: v == 1)

    # every metric of the live registry has a sample with a value
    _every_metric_set(d)
    await _promtool_accepts(d.metrics_url)

    await js.resume_consumer(bus.STREAM_MARKET, bus.CONSUMER_MARKET)
    await _until(prom, "orchd_event_backlog", lambda v: v == 0)

    # 7. NVML stops answering: the heartbeats carry no readings, the GPU series go away
    nvml.broken = True
    await h.wait_for(lambda: f'node="{n3.node_id}"' not in _scrape(d.metrics_url).split(
        "orchd_node_gpu_utilization_ratio", 1)[-1], timeout=10)
    text = _scrape(d.metrics_url)
    assert "orchd_node_gpu_utilization_ratio{" not in text and "orchd_node_gpu_temperature_celsius{" not in text


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def _every_metric_set(d: Any) -> None:
    """Each metric family of orchd's registry has a sample with a non-zero value (a histogram: at least
    one observation; a counter: at least one increment)."""
    unset = []
    for family in d.metrics.registry.collect():
        if family.type == "histogram":
            values = [s.value for s in family.samples if s.name.endswith("_count")]
        elif family.type == "counter":
            values = [s.value for s in family.samples if s.name.endswith("_total")]
        else:
            values = [s.value for s in family.samples]
        if not any(v != 0 and not math.isnan(v) for v in values):
            unset.append(family.name)
    assert not unset, f"declared but never set in this scenario: {unset}"


async def _promtool_accepts(url: str) -> None:
    text = await anyio.to_thread.run_sync(_scrape, url)
    res = subprocess.run([require_tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0 and not (res.stdout + res.stderr).strip(), res.stdout + res.stderr


def test_no_nvml_no_gpu_readings() -> None:
    """A node without NVML (no library, no driver, no GPU) reports no GPUs: orchd exports no GPU series."""

    class NoDriver(StubNvml):
        def nvmlInit(self) -> None:  # noqa: N802
            raise self.NVMLError("NVML Shared Library Not Found")

    assert SystemSampler(nvml=NoDriver()).gpus() == ()
    gpus = SystemSampler(nvml=StubNvml()).gpus()
    assert [(g.index, g.util_pct, g.temp_c, g.power_w) for g in gpus] == [(0, 37.0, 55.0, 300.0),
                                                                            (1, 81.0, 61.0, 300.0)]


def test_every_declared_metric_has_a_writer() -> None:
    """Each metric declared in metrics.py is written (set, inc, observe, labels) somewhere in orchd's code
    outside metrics.py - the static half of the scenario's registry walk, without services."""
    root = Path(__file__).resolve().parents[2] / "orchestrator"
    declared = re.findall(r"self\.(\w+) = (?:Gauge|Counter|Histogram)\(", (root / "daemon" / "metrics.py").read_text())
    assert len(declared) > 25
    code = "\n".join(p.read_text() for p in root.rglob("*.py") if p.name != "metrics.py")
    unwritten = [name for name in declared if not re.search(rf"\b(?:m|metrics)\.{name}\b", code)]
    assert not unwritten, f"declared in metrics.py, never written: {unwritten}"


class _CoreDriver:
    """The real core and the decide stage of the pipeline, without NATS: each ``step`` decides events like
    one batch of the decide loop and hands the batch to a ``MetricsObserver``."""

    def __init__(self) -> None:
        from orchestrator import core
        from orchestrator.daemon.coreapi import CoreApi
        from orchestrator.daemon.metrics import Metrics
        from orchestrator.daemon.observe import MetricsObserver

        config = core.CoreConfig(price_confirm_s=0.0)
        self.api = CoreApi(decide=core.decide, state_to_records=core.state_to_records,
                           state_from_records=core.state_from_records, empty_state=lambda: core.State.empty(config))
        self.metrics = Metrics()
        self.observer = MetricsObserver(self.metrics)
        self.state = self.api.empty_state()
        self.commands: list[Any] = []

    def step(self, now: float, *events: Any) -> None:
        from orchestrator.daemon import pipeline

        decider = pipeline.Decider(self.api, self.state, metrics=self.metrics, on_decision=lambda e, d: None,
                                   clock=lambda: now)
        assert decider.decide(events).failed == []
        self.observer.after_batch(self.state, decider.out, now)
        self.state = decider.out.state
        self.commands.extend(decider.out.commands.values())

    def sent(self, cls: type) -> list[Any]:
        return [c.command for c in self.commands if isinstance(getattr(c, "command", None), cls)]

    def missed(self, job_id: str) -> float:
        return self.metrics.registry.get_sample_value("orchd_emergency_checkpoint_missed_total",
                                                      {"job_id": job_id}) or 0.0


def _noticed_job(drv: _CoreDriver, t: float) -> tuple[str, Any]:
    """A one-node job training at step 10, then a terminate notice: (job id, its CheckpointCmd)."""
    from orchestrator.core.commands import Launch
    from orchestrator.core.inputs import JobSubmitted, NodeLaunched
    from orchestrator.jobspec import parse_jobspec

    drv.step(t, h.price(h.POOL, 1.0, 3.0, ts=t), h.price(h.POOL_OD, 3.0, 3.0, ts=t))
    drv.step(t, JobSubmitted(job_id=ev.JobId("j1"), spec=parse_jobspec(JOB)))
    launch = next(c for c in drv.commands if isinstance(c, Launch))
    node = launch.node_ids[0]
    drv.step(t, NodeLaunched(node_id=node, job_id=launch.job_id, instance_id=ev.InstanceId("i-1"), pool=launch.pool,
                             token=launch.token))
    drv.step(t, ev.NodeRegistered(id="r", node_id=node, instance_id=ev.InstanceId("i-1"), pool=launch.pool, ts=t))
    drv.step(t, ev.GenerationStarted(id="g", node_id=node, job_id=launch.job_id, generation=1, first_step=1, ts=t))
    for i, step in enumerate((1, 10)):
        drv.step(t + 1 + i, ev.Heartbeat(node_id=node, seq=i + 1, ts=t, state=ev.AgentState.TRAINING,
                                         job_id=launch.job_id, generation=1, step=step))
    drv.step(t + 3, ev.PreemptionNotice(id="n", node_id=node, cloud="fake", deadline_ts=t + 33, observed_ts=t + 3))
    (cmd,) = drv.sent(ev.CheckpointCmd)
    assert cmd.reason == "preemption_notice" and cmd.deadline_ts == t + 33
    return str(launch.job_id), cmd


def test_an_emergency_checkpoint_that_never_commits_is_missed() -> None:
    """No commit by the deadline (+ MISS_GRACE_S): one miss, counted once; the series is 0 before."""
    from orchestrator.daemon.observe import MISS_GRACE_S

    drv = _CoreDriver()
    t = 1_800_000_000.0
    job_id, cmd = _noticed_job(drv, t)
    drv.observer.refresh(drv.state, cmd.deadline_ts + MISS_GRACE_S - 1)
    assert drv.metrics.registry.get_sample_value("orchd_emergency_checkpoint_missed_total", {"job_id": job_id}) == 0
    drv.observer.refresh(drv.state, cmd.deadline_ts + MISS_GRACE_S + 1)
    drv.observer.refresh(drv.state, cmd.deadline_ts + MISS_GRACE_S + 2)
    assert drv.missed(job_id) == 1


def test_an_emergency_checkpoint_in_time_is_not_missed() -> None:
    """A commit before the deadline: its margin is observed, no miss, even long after the deadline."""
    drv = _CoreDriver()
    t = 1_800_000_000.0
    job_id, cmd = _noticed_job(drv, t)
    drv.step(t + 5, ev.CheckpointCommitted(id="c", node_id=cmd.node_id, job_id=cmd.job_id, generation=1, step=11,
                                           checkpoint_id="step_11", url="file:///tmp/orch-metrics-ckpt/step_11",
                                           save_s=1.0, deadline_margin_s=28.0, emergency=True, ts=t + 5))
    drv.observer.refresh(drv.state, t + 600)
    assert drv.missed(job_id) == 0
    value = drv.metrics.registry.get_sample_value
    assert value("orchd_emergency_checkpoint_margin_seconds_count") == 1
    assert value("orchd_emergency_checkpoint_margin_seconds_bucket", {"le": "20.0"}) == 0
    assert value("orchd_emergency_checkpoint_margin_seconds_bucket", {"le": "30.0"}) == 1  # 28 s


def test_a_generation_ended_without_its_emergency_checkpoint_is_a_miss() -> None:
    """The noticed node is lost before committing and the job resumes on a replacement, well before the
    deadline: the checkpoint can no longer commit - a miss at once; the recovery ends at the first step."""
    from orchestrator.core.commands import Launch
    from orchestrator.core.inputs import NodeGone, NodeLaunched

    drv = _CoreDriver()
    t = 1_800_000_000.0
    job_id, cmd = _noticed_job(drv, t)
    drv.step(t + 4, NodeGone(node_id=cmd.node_id, instance_id=ev.InstanceId("i-1"), reason="provider_terminated"))
    launch = [c for c in drv.commands if isinstance(c, Launch)][-1]
    node = launch.node_ids[0]
    drv.step(t + 5, NodeLaunched(node_id=node, job_id=launch.job_id, instance_id=ev.InstanceId("i-2"),
                                 pool=launch.pool, token=launch.token))
    drv.step(t + 6, ev.NodeRegistered(id="r2", node_id=node, instance_id=ev.InstanceId("i-2"), pool=launch.pool,
                                      ts=t + 6))
    assert drv.state.jobs[job_id].generation == 2
    drv.observer.refresh(drv.state, t + 7)
    assert drv.missed(job_id) == 1
    value = drv.metrics.registry.get_sample_value
    assert value("orchd_recovery_seconds_count") == 0
    drv.step(t + 8, ev.Heartbeat(node_id=node, seq=1, ts=t + 8, state=ev.AgentState.TRAINING, job_id=launch.job_id,
                                 generation=2, step=1))
    assert value("orchd_recovery_seconds_count") == 1
    assert value("orchd_recovery_seconds_bucket", {"le": "5.0"}) == 1  # notice at t+3, first step at t+8
    assert value("orchd_recovery_seconds_bucket", {"le": "2.0"}) == 0
