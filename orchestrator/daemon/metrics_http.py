"""The ``/metrics`` endpoint of orchd (Prometheus text format 0.0.4, or OpenMetrics when the scraper
asks for it) on ``settings.metrics`` host/port.

Why not prometheus_client's own server: at 10,000 nodes the registry holds about 19,000 series (a
heartbeat age per node, several gauges per job; with GPU readings 8 more per node and family), and its
encoder builds a sample object and formats every label of every series on every scrape: about 0.2 s of
CPU in a thread that shares the interpreter with the decide loop. Here the labelled gauges of
``Metrics.bulk`` (the per-node and per-job state gauges) are written straight from their children, each
series' ``name{labels} `` prefix kept between scrapes (a dict look-up and a float's repr per series), and
the thread lets the decide loop run every ``PAUSE_EVERY`` series; every other family goes through
prometheus_client's encoder as before. The text is the encoder's, byte for byte, family by family
(``tests/ops/test_metrics_render.py``); the bulk families come after the others.

Concurrency contract: a threading WSGI server in one daemon thread (a thread per scrape); ``shutdown``
stops it. Port 0 picks a free port (read it back from ``server_port``). A scrape reads gauges that the
decide loop sets meanwhile: each series is read once, at its previous or its new value.
"""

from __future__ import annotations

import gzip
import math
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import Gauge
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from orchestrator.daemon.metrics import Metrics

PAUSE_EVERY = 2000
"""Series written between two releases of the interpreter lock (``time.sleep(0)``) by a scrape."""
_OM_EOF = b"# EOF\n"


def _label_value(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


_float_to_go: Callable[[float], str] = floatToGoString  # untyped in prometheus_client


def _go_float(v: float) -> str:
    """``floatToGoString`` (how Go prints a float) without its checks on the common cases."""
    s = repr(v)
    if v > 0:
        dot = s.find(".")
        if dot > 6:  # Go switches to an exponent sooner than Python (the form differs between versions)
            return _float_to_go(v)
        return "+Inf" if s == "inf" else s
    if v == v and v != -math.inf:  # 0 and the negatives: as Python prints them
        return s
    return _float_to_go(v)  # NaN, -Inf


class _Only(Collector):
    """Some collectors of a registry, as one collector (what the encoder renders)."""

    def __init__(self, collectors: Iterable[Any]) -> None:
        self.collectors = list(collectors)

    def collect(self) -> Iterator[Any]:
        for c in self.collectors:
            yield from c.collect()


class _Header(Collector):
    """A family without its samples: the encoder's ``# HELP`` / ``# TYPE`` lines for it."""

    def __init__(self, gauge: Gauge) -> None:
        self.gauge = gauge

    def collect(self) -> Iterator[Any]:
        yield from self.gauge.describe()


class Renderer:
    """The exposition of a ``Metrics``: ``render(accept)`` -> (body, content type)."""

    def __init__(self, metrics: Metrics, pause: Callable[[], None] = lambda: time.sleep(0)) -> None:
        self.bulk = tuple(metrics.bulk)
        self.rest = _Only(c for c in metrics.collectors if c not in self.bulk)
        self.pause = pause  # lets the decide loop take the interpreter lock between pieces of a scrape
        self._prefixes: dict[Gauge, dict[tuple[str, ...], str]] = {g: {} for g in self.bulk}
        self._headers: dict[tuple[str, Gauge], bytes] = {}

    def render(self, accept: str | None) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept or "")
        head = encoder(self.rest)
        om = head.endswith(_OM_EOF) and content_type.startswith("application/openmetrics-text")
        parts = [head[: -len(_OM_EOF)] if om else head]
        for gauge in self.bulk:
            header = self._headers.get((content_type, gauge))
            if header is None:
                header = encoder(_Header(gauge))
                header = header[: -len(_OM_EOF)] if om else header
                self._headers[(content_type, gauge)] = header
            parts.append(header)
            parts.append(self._samples(gauge).encode())
        if om:
            parts.append(_OM_EOF)
        return b"".join(parts), content_type

    def _samples(self, gauge: Gauge) -> str:
        """Every series of one labelled gauge, as the encoder would write them."""
        with gauge._lock:  # noqa: SLF001 - what prometheus_client's own collect() copies, under its lock
            children: dict[Any, Any] = dict(gauge._metrics)  # noqa: SLF001
        prefixes = self._prefixes[gauge]
        if len(prefixes) > 2 * len(children) + 64:  # series removed since: start the cache again
            prefixes = self._prefixes[gauge] = {}
        name = next(iter(gauge.describe())).name
        order = sorted(range(len(gauge._labelnames)), key=lambda i: gauge._labelnames[i])  # noqa: SLF001
        names = [gauge._labelnames[i] for i in order]  # noqa: SLF001
        lines: list[str] = []
        for n, (values, child) in enumerate(children.items(), 1):
            prefix = prefixes.get(values)
            if prefix is None:
                labels = ",".join(f'{k}="{_label_value(values[i])}"' for k, i in zip(names, order, strict=True))
                prefix = prefixes[values] = f"{name}{{{labels}}} "
            lines.append(prefix + _go_float(child._value.get()) + "\n")  # noqa: SLF001
            if n % PAUSE_EVERY == 0:
                self.pause()
        return "".join(lines)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass


def _app(renderer: Renderer) -> Callable[..., Iterable[bytes]]:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == "/favicon.ico":
            start_response("200 OK", [])
            return [b""]
        body, content_type = renderer.render(environ.get("HTTP_ACCEPT"))
        headers = [("Content-Type", content_type)]
        if "gzip" in environ.get("HTTP_ACCEPT_ENCODING", ""):
            body = gzip.compress(body, compresslevel=1)
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [body]

    return app


class MetricsServer:
    def __init__(self, metrics: Metrics, host: str, port: int) -> None:
        self.renderer = Renderer(metrics)
        server = _Server6 if ":" in host else _Server
        self._httpd = make_server(host, port, _app(self.renderer), server, handler_class=_Quiet)
        self.server_port: int = self._httpd.server_port
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=2)


def serve_metrics(metrics: Metrics, host: str, port: int) -> MetricsServer:
    return MetricsServer(metrics, host, port)
