"""orchd as a real subprocess driving the local provider (agent processes on this machine), for the
shutdown and fault-injection tests: its settings, a job of the contract-following fake trainer, and
orchctl calls that return JSON."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from tests.integration.helpers import ctl

ROOT = Path(__file__).resolve().parents[2]
FAKE_TRAINER = ROOT / "tests" / "agent" / "fake_trainer.py"


class LocalOrchd:
    """``python -m orchestrator.daemon`` with ``[providers] enabled = ["local", ...]``. ``nats_url``
    None: orchd starts its embedded nats-server (what an operator trying the local provider gets)."""

    def __init__(self, tmp: Path, nats_url: str | None, *, extra: str = "") -> None:
        self.tmp = tmp
        self.log = tmp / "orchd.log"
        self.nodes_dir = tmp / "nodes"
        self.cfg = tmp / "orchd.toml"
        urls = f'urls = ["{nats_url}"]' if nats_url else ""
        enabled = '["local", "fake"]' if "[providers.fake]" in extra else '["local"]'
        self.cfg.write_text(f"""
[nats]
{urls}
reconnect_wait_s = 0.2
[daemon]
state_dir = "{tmp / 'state'}"
tick_s = 0.5
price_confirm_s = 0.0
heartbeat_interval_s = 1.0
heartbeat_timeout_s = 3.0
command_ack_timeout_s = 2.0
shutdown_grace_s = 5.0
[metrics]
enabled = false
[log]
level = "info"
format = "json"
[providers]
enabled = {enabled}
[providers.local]
work_dir = "{self.nodes_dir}"
zones = ["local-a", "local-b"]
metadata = {{ local-b = "gcp" }}
agent_args = ["--heartbeat-s", "0.5", "--metadata-poll-s", "0.25", "--sigterm-grace-s", "5"]
terminate_grace_s = 3.0
[providers.feeds.local]
interval_s = 1.0
{extra}
""")
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = nats_url or ""

    def start(self) -> LocalOrchd:
        disc = self.tmp / "state" / "orchd.json"
        with open(self.log, "a") as err:  # the child keeps its own descriptor
            self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator.daemon", "--config", str(self.cfg)],
                                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.time() + 30
        while not disc.exists():
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.time() < deadline, "orchd did not start"
            time.sleep(0.05)
        self.url = json.loads(disc.read_text())["nats_url"]
        return self

    def processes(self) -> list[psutil.Process]:
        """orchd's descendants now: agents, their ranks (and the embedded nats-server)."""
        assert self.proc is not None
        return psutil.Process(self.proc.pid).children(recursive=True)

    def stop(self, timeout_s: float = 40.0) -> int:
        """SIGTERM; the exit code (killed after ``timeout_s``: the test then fails on the code)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return -9
        return self.proc.returncode

    def kill_all(self) -> None:
        """Test teardown: nothing of this orchd survives the test."""
        if self.proc is None:
            return
        procs: list[psutil.Process] = []
        if self.proc.poll() is None:
            procs = self.processes()
            self.proc.kill()
            self.proc.wait()
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()

    def ctl(self, *argv: str) -> tuple[int, str, str]:
        return ctl(self.url, *argv)

    def ctl_json(self, *argv: str) -> Any:
        code, out, err = ctl(self.url, *argv, "-o", "json")
        assert code == 0, (argv, code, out, err)
        return json.loads(out)


def local_job(tmp: Path, *, nodes: int = 2, nodes_min: int = 1, steps: int = 1_000_000,
              step_time_s: float = 0.05) -> Path:
    """A job of the fake trainer (tests/agent/fake_trainer.py) on the local provider."""
    path = tmp / "job.toml"
    path.write_text(f"""
name = "local"
total_steps = {steps}
gpu_type = "cpu"
gpus_per_node = 1
nodes = {nodes}
nodes_min = {nodes_min}
nodes_max = {nodes}
clouds = ["local"]
market = "spot_with_fallback"
[checkpoint]
url = "file://{tmp / 'ckpt'}"
interval_s = 600
[trainer]
command = ["{sys.executable}", "{FAKE_TRAINER}"]
args = {{ step_time_s = {step_time_s} }}
""")
    return path


def wait_until(pred: Any, timeout_s: float, what: str, every_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(every_s)
