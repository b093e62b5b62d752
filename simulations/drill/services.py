"""The processes of the drill, on loopback and free ports under one temp dir: a 3-server NATS cluster,
orchd, Prometheus, Alertmanager, and the webhook receiver Alertmanager sends to.

Every process runs in a session of its own; ``Services.close`` kills each one (and what it spawned) by
its id, also on Ctrl-C and on failure.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import yaml

from orchestrator.natsserver import NatsServer
from orchestrator.security.nats_auth import render_server_config
from simulations.drill.cluster_secrets import AUTH_USER, Secrets

ROOT = Path(__file__).resolve().parents[2]


class DrillError(RuntimeError):
    """A service did not start, or a scenario's expectation timed out."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise DrillError(f"{name} is not installed (Debian: apt-get install {name})")
    return path


def wait_until(pred: Any, timeout_s: float, what: str, every_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise DrillError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


def kill_tree(proc: psutil.Process | subprocess.Popen[bytes] | None, sig: int = signal.SIGKILL) -> None:
    """``sig`` to a process and every descendant of it (ids taken before the first signal)."""
    if proc is None:
        return
    try:
        p = psutil.Process(proc.pid)
        victims = [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for v in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            v.send_signal(sig)
    if isinstance(proc, subprocess.Popen) and sig == signal.SIGKILL:
        proc.wait()


def nats_cluster(tmp: Path, secrets: Secrets | None, n: int = 3) -> list[NatsServer]:
    """n nats-servers (nats-1..nats-n), JetStream on each, routed to each other on loopback. With
    ``secrets``: TLS on the client listeners and the auth callout include (``Secrets.auth_conf``) on each;
    without, open (no TLS, no authorization)."""
    cports = [free_port() for _ in range(n)]
    routes = [f"nats-route://127.0.0.1:{p}" for p in cports]
    servers = []
    for i, cport in enumerate(cports, start=1):
        conf = tmp / f"nats-{i}.conf"
        conf.write_text(render_server_config(
            # an include is relative to its config file
            auth_include=os.path.relpath(secrets.auth_conf, tmp) if secrets else None,
            tls=secrets.tls if secrets else None,
            host="127.0.0.1", port=-1, store_dir=None, http_port=None, server_name=f"nats-{i}",
            cluster={"name": "orch", "host": "127.0.0.1", "port": cport, "routes": routes}))
        servers.append(NatsServer(tmp / f"nats-{i}", config_file=str(conf), name=f"nats-{i}"))
    for s in servers:
        s.start()
    return servers


STUB_NVML = Path(__file__).with_name("stub_nvml")
"""The stub ``pynvml`` the drill's agents import (the hardware edge; see stub_nvml/pynvml.py)."""


def agent_pythonpath() -> str:
    """The agents' PYTHONPATH: the stub NVML first, then whatever this process was given."""
    return os.pathsep.join([str(STUB_NVML), *filter(None, [os.environ.get("PYTHONPATH", "")])])


class Orchd:
    """``python -m orchestrator.daemon`` with the local provider, HA on the cluster. Its agents read the
    stub NVML (``STUB_NVML``): this machine has no GPU."""

    def __init__(self, name: str, tmp: Path, urls: list[str], *, nodes_dir: Path, secrets: Secrets | None) -> None:
        self.name, self.dir = name, tmp / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_port = free_port()
        self.cfg = self.dir / "orchd.toml"
        self.log = self.dir / "orchd.log"
        self.urls = urls
        self.credentials_dir: Path | None = None
        nats_urls = ", ".join(f'"{u}"' for u in urls)
        secure = agent_env = ""
        if secrets is not None:
            # the secrets as systemd hands them over: orchd's in its credentials directory, the agents'
            # (the CA) in theirs; the logins and roles of cluster_secrets.py
            self.credentials_dir = secrets.orchd_credentials(self.dir / "credentials")
            agents = secrets.agent_credentials(tmp / "agent-credentials")
            secure = f"""user = "orchd"
[credentials]
enabled = true
mode = "callout"
static_users_file = "{secrets.static_users}"
auth_user = "{AUTH_USER}"
"""
            agent_env = f', CREDENTIALS_DIRECTORY = "{agents}"'
        self.cfg.write_text(f"""
[nats]
urls = [{nats_urls}]
stream_replicas = 3
reconnect_wait_s = 0.2
{secure}
[daemon]
state_dir = "{self.dir / 'state'}"
ha = true
lease_ttl_s = 3.0
tick_s = 0.5
price_confirm_s = 0.0
heartbeat_interval_s = 1.0
heartbeat_timeout_s = 3.0
command_ack_timeout_s = 2.0
shutdown_grace_s = 5.0
restart_backoff_base_s = 1.0
restart_backoff_max_s = 2.0
boot_estimate_s = 10.0
terminate_billing_s = 2.0
[metrics]
host = "127.0.0.1"
port = {self.metrics_port}
refresh_s = 0.5
[log]
level = "info"
format = "json"
[providers]
enabled = ["local"]
[providers.local]
work_dir = "{nodes_dir}"
zones = ["local-a", "local-b", "local-c"]
capacity = {{ "local/local-1/local-c/cpu.local/on_demand" = 0, "local/local-1/local-c/cpu.local/spot" = 0 }}
agent_args = ["--heartbeat-s", "0.5", "--metadata-poll-s", "0.25", "--sigterm-grace-s", "5"]
terminate_grace_s = 3.0
agent_env = {{ PYTHONPATH = "{agent_pythonpath()}"{agent_env} }}
[providers.feeds.local]
interval_s = 3600.0
""")
        self.proc: subprocess.Popen[bytes] | None = None
        self.orphans: list[psutil.Process] = []

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.metrics_port}"

    def start(self) -> Orchd:
        with open(self.log, "ab") as err:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "orchestrator.daemon", "--config", str(self.cfg)], cwd=ROOT,
                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True, env=self.environment())
        return self

    def environment(self) -> dict[str, str]:
        """This environment less ORCH_* and any credentials directory, plus orchd's own (as systemd sets it)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_") and k != "CREDENTIALS_DIRECTORY"}
        if self.credentials_dir is not None:
            env["CREDENTIALS_DIRECTORY"] = str(self.credentials_dir)
        return env

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        """kill -9 of orchd alone: its local nodes (children) live on, as nodes outlive a control plane."""
        if self.proc is None:
            return
        with contextlib.suppress(psutil.NoSuchProcess):
            self.orphans += psutil.Process(self.proc.pid).children(recursive=True)
        self.proc.kill()
        self.proc.wait()

    def nodes(self) -> list[psutil.Process]:
        """The agent processes this orchd launched (alive now)."""
        if not self.alive():
            return []
        assert self.proc is not None
        return [p for p in psutil.Process(self.proc.pid).children() if "agent" in " ".join(p.cmdline())]

    def close(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.orphans += psutil.Process(self.proc.pid).children(recursive=True)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                kill_tree(self.proc)
        for p in self.orphans:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


def _http_json(url: str, data: bytes | None = None, timeout: float = 5.0) -> Any:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


class Prometheus:
    """Debian's prometheus: scrapes every orchd each ``scrape_s``, the drill's copy of the rules, sends
    to the Alertmanager."""

    def __init__(self, tmp: Path, targets: list[str], rules_text: str, alertmanager: str, scrape_s: float) -> None:
        self.dir = tmp / "prometheus"
        self.dir.mkdir()
        self.port = free_port()
        (self.dir / "alerts.yml").write_text(rules_text)
        shipped = yaml.safe_load((ROOT / "config" / "prometheus" / "prometheus.yml").read_text())
        every = f"{max(1, round(scrape_s * 1000))}ms"
        shipped["global"] = {"scrape_interval": every, "evaluation_interval": every}
        shipped["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [alertmanager]
        job = next(j for j in shipped["scrape_configs"] if j["job_name"] == "orchd")
        job["static_configs"][0]["targets"] = targets
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(shipped, sort_keys=False))
        self.log = (self.dir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [tool("prometheus"), f"--config.file={self.dir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.dir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--rules.alert.resend-delay=1s", "--web.enable-lifecycle"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        body = _http_json(url)
        if body.get("status") != "success":
            raise DrillError(f"prometheus {path}: {body}")
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=promql)["result"])

    def alerts(self) -> list[dict[str, Any]]:
        """Active alerts (pending and firing) as Prometheus's /api/v1/alerts lists them."""
        return list(self.api("alerts")["alerts"])

    def ready(self) -> bool:
        """Some target scraped (a standby orchd may serve no /metrics: see the drill's JSON)."""
        if self.proc.poll() is not None:
            raise DrillError(f"prometheus exited: {(self.dir / 'prometheus.log').read_text()[-1500:]}")
        try:
            targets = self.api("targets")["activeTargets"]
        except OSError:
            return False
        return any(t["health"] == "up" for t in targets)

    def close(self) -> None:
        kill_tree(self.proc, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc)
        self.log.close()


class Alertmanager:
    """Debian's prometheus-alertmanager (no clustering), every alert routed to the drill's webhook."""

    def __init__(self, tmp: Path, webhook_url: str) -> None:
        self.dir = tmp / "alertmanager"
        self.dir.mkdir()
        self.port = free_port()
        cfg = {"route": {"receiver": "drill", "group_by": ["alertname", "instance", "job_id", "node", "pool"],
                         "group_wait": "0s", "group_interval": "1s", "repeat_interval": "1h"},
               "receivers": [{"name": "drill", "webhook_configs": [{"url": webhook_url, "send_resolved": True}]}]}
        (self.dir / "alertmanager.yml").write_text(yaml.safe_dump(cfg))
        self.log = (self.dir / "alertmanager.log").open("wb")
        self.proc = subprocess.Popen(
            [tool("prometheus-alertmanager"), f"--config.file={self.dir / 'alertmanager.yml'}",
             f"--storage.path={self.dir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--cluster.listen-address="],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alerts(self) -> list[dict[str, Any]]:
        """Alerts Alertmanager holds now (/api/v2/alerts; active, silenced and inhibited)."""
        return list(_http_json(f"http://{self.address}/api/v2/alerts"))

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.address}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def close(self) -> None:
        kill_tree(self.proc, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc)
        self.log.close()


class Webhook:
    """An http.server thread recording every POST (Alertmanager's webhook payloads)."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        lock = self.lock = threading.Lock()
        received = self.received

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with lock:
                    received.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        self.thread = threading.Thread(target=self.server.serve_forever, name="drill-webhook", daemon=True)
        self.thread.start()

    def statuses(self, labels: dict[str, str]) -> set[str]:
        """The statuses (firing, resolved) the webhook received for the alert with these labels."""
        with self.lock:
            return {a["status"] for p in self.received for a in p.get("alerts", []) if a.get("labels") == labels}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
