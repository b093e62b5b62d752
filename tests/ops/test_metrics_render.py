"""``/metrics`` writes the per-node and per-job gauges itself (``metrics_http.Renderer``): what it serves
is prometheus_client's exposition byte for byte, family by family, in both formats a scraper asks for;
the scrape lets the decide loop run between pieces of it; the server answers a real HTTP scrape (gzip
included). The whole path through a running orchd and a real Prometheus is tests/ops/test_metrics_sources.py."""

from __future__ import annotations

import gzip
import time
import urllib.request
from types import SimpleNamespace

from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as om_latest

from orchestrator.core.inputs import JobSubmitted
from orchestrator.daemon.gauges import refresh_gauges
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.metrics_http import PAUSE_EVERY, MetricsServer, Renderer
from orchestrator.daemon.observe import MetricsObserver
from tests.core.harness import Driver, pool, price, spec
from wire import CheckpointPolicy, GpuStats

A = pool("p4d.24xlarge", "us-east-1a")
OM = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"


def _metrics() -> Metrics:
    drv = Driver()
    drv(price(A, 10.0))
    for i in range(5):
        one_root = CheckpointPolicy(url=f"file:///ckpt/j{i}", save_s_estimate=20.0)
        drv.launched(drv(JobSubmitted(job_id=f"j{i}", spec=spec(nodes=2, budget_usd=50.0, checkpoint=one_root))))
    metrics = Metrics()
    observer = MetricsObserver(metrics)
    for k, nid in enumerate(drv.state.nodes):
        observer.gpus[nid] = (time.time(), tuple(GpuStats(index=g, util_pct=12.5 * g, mem_used_mib=1.0,
                                                          mem_total_mib=2.0, temp_c=55.0 + k) for g in range(4)))
    refresh_gauges(SimpleNamespace(state=drv.state, metrics=metrics, fencing_token=3, observer=observer))
    metrics.job_step.labels('odd "id"\\with\nnewline').set(1e21)  # escaping and Go's exponent form
    metrics.cost.labels("tiny").set(-0.0001234)
    metrics.cost.labels("big").set(1234567.0)  # Go: 1.234567e+06
    metrics.goodput.labels("nan").set(float("nan"))
    metrics.events.labels("Heartbeat").inc(7)
    metrics.event_lag.observe(0.02)
    return metrics


def _families(text: bytes) -> dict[str, str]:
    """Family name -> its lines (the exposition split at each ``# HELP``), ``# EOF`` apart."""
    out: dict[str, str] = {}
    name = ""
    for line in text.decode().splitlines(keepends=True):
        if line.startswith("# HELP "):
            name = line.split()[2]
        elif line == "# EOF\n":
            name = "# EOF"
        out[name] = out.get(name, "") + line
    return out


def test_the_served_exposition_is_the_encoders_in_both_formats() -> None:
    metrics = _metrics()
    r = Renderer(metrics)
    for accept, encoder in ((None, generate_latest), (OM, om_latest)):
        body, content_type = r.render(accept)
        again, _ = r.render(accept)  # the second scrape, from the kept prefixes, is the same
        want = encoder(metrics.registry)
        assert _families(body) == _families(want), content_type
        assert body == again
        assert len(body) == len(want)
        if encoder is om_latest:
            assert body.endswith(b"# EOF\n") and content_type.startswith("application/openmetrics-text")
    assert b"orchd_node_gpu_temperature_celsius" in body and b'job_id="j4"' in body

    metrics.job_step.remove('odd "id"\\with\nnewline')  # a series gone is gone from the next scrape
    body, _ = r.render(None)
    assert b"odd" not in body
    assert _families(body) == _families(generate_latest(metrics.registry))


def test_a_scrape_lets_the_decide_loop_run_between_its_pieces() -> None:
    metrics = Metrics()
    for i in range(3 * PAUSE_EVERY):  # a heartbeat age per node, as at 6,000 nodes
        metrics.node_heartbeat_age.labels(f"n{i}", f"j{i // 8}").set(i / 10)
    pauses = []
    Renderer(metrics, pause=lambda: pauses.append(1)).render(None)
    assert len(pauses) >= 3


def test_the_server_answers_a_scrape() -> None:
    metrics = _metrics()
    server = MetricsServer(metrics, "127.0.0.1", 0)
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{server.server_port}/metrics",
                                     headers={"Accept": OM, "Accept-Encoding": "gzip"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert resp.headers["Content-Encoding"] == "gzip"
            assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
            body = gzip.decompress(resp.read())
        assert _families(body) == _families(om_latest(metrics.registry))
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5) as resp:
            assert resp.headers["Content-Type"].startswith("text/plain")
            assert _families(resp.read()) == _families(generate_latest(metrics.registry))
    finally:
        server.shutdown()
