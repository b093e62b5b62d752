"""The ``/metrics`` endpoint of orchd (Prometheus text format) on ``settings.metrics`` host/port.

Concurrency contract: prometheus_client's WSGI server in one daemon thread; ``shutdown`` stops it.
Port 0 picks a free port (read it back from ``server_port``).
"""

from __future__ import annotations

from prometheus_client import start_http_server

from orchestrator.daemon.metrics import Metrics


class MetricsServer:
    def __init__(self, metrics: Metrics, host: str, port: int) -> None:
        self._httpd, self._thread = start_http_server(port, addr=host, registry=metrics.registry)
        self.server_port: int = self._httpd.server_port

    def shutdown(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=2)


def serve_metrics(metrics: Metrics, host: str, port: int) -> MetricsServer:
    return MetricsServer(metrics, host, port)
