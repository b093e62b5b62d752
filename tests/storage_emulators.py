"""The three clouds' object stores on loopback for tests and the checkpoint benchmark.

- s3: moto's server (``ThreadedMotoServer``), in this process.
- gs: ``gcp-storage-emulator`` (PyPI, the GCS JSON API) as a subprocess, behind :class:`StoreProxy`, which
  enforces ``ifGenerationMatch=0`` (the emulator ignores it: a second create succeeds).
- az: Azurite's blob service (npm) as a subprocess, ``--skipApiVersionCheck`` (it refuses the current SDK's
  API version otherwise) and ``--disableTelemetry``; found on PATH or in ``.ci/node`` (where .ci/run
  installs it).

Every object store is reached through a :class:`StoreProxy` (a forwarding HTTP proxy on 127.0.0.1:0)
that can refuse writes under a prefix with the store's own 403, as the real service does for a write its
credentials do not allow: the "refused write" of the checkpoint tests.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

REPO = Path(__file__).resolve().parents[1]
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade", "host", "content-length"}
_REFUSALS = {
    "s3": ("application/xml", b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>AccessDenied</Code>"
                              b"<Message>Access Denied</Message></Error>"),
    "gs": ("application/json", json.dumps({"error": {"code": 403, "message": "access denied: write refused",
                                                     "errors": [{"reason": "forbidden"}]}}).encode()),
    "az": ("application/xml", b"<?xml version=\"1.0\" encoding=\"utf-8\"?><Error><Code>AuthorizationPermission"
                              b"Mismatch</Code><Message>This request is not authorized.</Message></Error>"),
}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the emulator exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{url}: no answer within {timeout} s")


class StoreProxy:
    """Forwards every request to ``upstream``; refuses writes whose path contains a refused prefix (the
    store's 403); with ``enforce_create``, enforces GCS's ``ifGenerationMatch=0`` on uploads (412 when the
    object exists), one conditional create at a time, so that of two creators exactly one wins."""

    def __init__(self, upstream: str, flavour: str, *, enforce_create: bool = False) -> None:
        self.upstream = urlsplit(upstream)
        self.flavour = flavour
        self.enforce_create = enforce_create
        self.refused: set[str] = set()
        self._create_lock = threading.Lock()
        outer = self

        class _H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _do(self) -> None:
                if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                    body = _read_chunked(self.rfile)
                else:
                    n = int(self.headers.get("Content-Length") or 0)
                    body = self.rfile.read(n) if n else b""
                status, headers, data = outer.handle(self.command, self.path, dict(self.headers.items()), body)
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                if not any(k.lower() == "content-length" for k, _ in headers):
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _do

        class _Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                if not isinstance(sys.exc_info()[1], ConnectionError):  # clients hanging up are normal
                    super().handle_error(request, client_address)

        self.httpd = _Server(("127.0.0.1", 0), _H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def forward(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, list, bytes]:
        conn = http.client.HTTPConnection(self.upstream.hostname or "127.0.0.1", self.upstream.port, timeout=60)
        try:
            out = {k: v for k, v in headers.items() if k.lower() not in _HOP}
            out["Host"] = headers.get("Host", self.upstream.netloc)
            conn.request(method, path, body=body if body or method in ("POST", "PUT", "PATCH") else None, headers=out)
            resp = conn.getresponse()
            data = resp.read()
            own = f"{self.upstream.hostname}:{self.upstream.port}"
            back = [(k, v.replace(own, self.url.split("//", 1)[1])) for k, v in resp.getheaders()
                    if k.lower() not in _HOP or (method == "HEAD" and k.lower() == "content-length")]
            return resp.status, back, data
        finally:
            conn.close()

    def handle(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, list, bytes]:
        if method in ("PUT", "POST", "PATCH") and any(p in unquote(path) or p.encode() in body[:4096]
                                                       for p in self.refused):
            kind, data = _REFUSALS[self.flavour]
            return 403, [("Content-Type", kind), ("x-ms-error-code", "AuthorizationPermissionMismatch")], data
        query = parse_qs(urlsplit(path).query)
        if self.enforce_create and method == "POST" and query.get("ifGenerationMatch") == ["0"]:
            with self._create_lock:
                name = query.get("name", [None])[0] or _multipart_name(body)
                bucket = re.match(r"^/upload/storage/v1/b/([^/]+)/o", urlsplit(path).path)
                if bucket and name:
                    status, _, _ = self.forward("GET", f"/storage/v1/b/{bucket[1]}/o/{quote(name, safe='')}", {}, b"")
                    if status == 200:
                        data = json.dumps({"error": {"code": 412, "message": "conditionNotMet"}}).encode()
                        return 412, [("Content-Type", "application/json")], data
                return self.forward(method, path, headers, body)
        return self.forward(method, path, headers, body)


def _read_chunked(f: Any) -> bytes:
    out = bytearray()
    while True:
        size = int(f.readline().split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while f.readline() not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return bytes(out)
        out += f.read(size)
        f.readline()


def _multipart_name(body: bytes) -> str | None:
    """The object name in a GCS multipart upload's first (JSON) part."""
    m = re.search(rb"\r?\n\r?\n(\{.*?\})\r?\n--", body[:65536], re.S)
    if not m:
        return None
    try:
        name = json.loads(m.group(1)).get("name")
    except ValueError:
        return None
    return name if isinstance(name, str) else None


class Store:
    """One object store for a test: URL scheme, bucket/container, fsspec options, the proxy in front."""

    def __init__(self, kind: str, bucket: str, options: dict[str, Any], proxy: StoreProxy | None,
                 stop: Any) -> None:
        self.kind, self.bucket, self.options, self.proxy, self._stop = kind, bucket, options, proxy, stop

    def url(self, prefix: str) -> str:
        if self.kind == "file":
            return f"file://{self.bucket}/{prefix}"
        return f"{self.kind}://{self.bucket}/{prefix}"

    def refuse_writes(self, prefix: str) -> None:
        assert self.proxy is not None
        self.proxy.refused.add(prefix)

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        self._stop()


def start_s3(bucket: str = "ckpt-bucket") -> Store:
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    proxy = StoreProxy(f"http://{host}:{port}", "s3")
    boto3.client("s3", endpoint_url=proxy.url, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket=bucket)
    opts = {"key": "testing", "secret": "testing",
            "client_kwargs": {"endpoint_url": proxy.url, "region_name": "us-east-1"}}
    return Store("s3", bucket, opts, proxy, server.stop)


def _stop_proc(proc: subprocess.Popen[bytes], *cleanup: str) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for path in cleanup:
        shutil.rmtree(path, ignore_errors=True)


def start_gcs(bucket: str = "ckpt-bucket") -> Store:
    exe = shutil.which("gcp-storage-emulator") or str(Path(sys.executable).parent / "gcp-storage-emulator")
    if not os.path.exists(exe):
        raise FileNotFoundError("gcp-storage-emulator")
    port = free_port()
    proc = subprocess.Popen([exe, "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    direct = f"http://127.0.0.1:{port}"
    try:
        _wait_http(f"{direct}/storage/v1/b?project=test", 30, proc)
        req = urllib.request.Request(f"{direct}/storage/v1/b?project=test", method="POST",
                                     data=json.dumps({"name": bucket}).encode(),
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).close()
    except BaseException:
        _stop_proc(proc)
        raise
    proxy = StoreProxy(direct, "gs", enforce_create=True)
    opts = {"token": "anon", "endpoint_url": proxy.url, "project": "test"}
    store = Store("gs", bucket, opts, proxy, lambda: _stop_proc(proc))
    store.direct_options = {**opts, "endpoint_url": direct}  # type: ignore[attr-defined]
    return store


def azurite_path() -> str | None:
    found = shutil.which("azurite-blob")
    local = REPO / ".ci" / "node" / "node_modules" / ".bin" / "azurite-blob"
    return found or (str(local) if local.exists() else None)


def azurite_connection_string(endpoint: str) -> str:
    return (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint={endpoint}/{AZURITE_ACCOUNT};")


def start_azurite(container: str = "ckpt-container") -> Store:
    exe = azurite_path()
    if exe is None:
        raise FileNotFoundError("azurite-blob")
    port, location = free_port(), tempfile.mkdtemp(prefix="azurite-")
    proc = subprocess.Popen([exe, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", location,
                             "--silent", "--skipApiVersionCheck", "--disableTelemetry", "--loose"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    direct = f"http://127.0.0.1:{port}"
    try:
        _wait_http(f"{direct}/{AZURITE_ACCOUNT}?comp=list", 30, proc)
    except BaseException:
        _stop_proc(proc, location)
        raise
    proxy = StoreProxy(direct, "az")
    opts = {"connection_string": azurite_connection_string(proxy.url)}
    from azure.storage.blob import BlobServiceClient

    BlobServiceClient.from_connection_string(opts["connection_string"]).create_container(container)
    return Store("az", container, opts, proxy, lambda: _stop_proc(proc, location))


def start(kind: str, base_dir: str | None = None) -> Store:
    """A store of ``kind`` (file, s3, gs, az), started; FileNotFoundError when its emulator is not installed."""
    if kind == "file":
        d = base_dir or tempfile.mkdtemp(prefix="ckpt-")
        return Store("file", d, {}, None, lambda: shutil.rmtree(d, ignore_errors=True) if base_dir is None else None)
    return {"s3": start_s3, "gs": start_gcs, "az": start_azurite}[kind]()
