"""Real parts of the drills: a nats-server, orchd as a subprocess, its metrics, the fake cloud's file.

Role: start/kill/restart orchd exactly as an operator's process manager would (``python -m
orchestrator.daemon.run --config FILE``; readiness = the discovery file ``<state>/orchd.json`` written by
*this* pid), scrape ``orchd_messages_rejected_total`` from its /metrics, and count launches on the cloud
side from the ``FileFakeCloud`` state file (never from orchd's state).

Concurrency contract: the process helpers are synchronous (call them through ``anyio.to_thread``);
``Orchd.crashes`` counts exits that nobody asked for (the ``daemon_crashes`` figure).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import wire as ev
from providers.base import Instance
from simulations.fakecloud import read_fake_file

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_ID = "orch-chaos"

POOL_A = ev.PoolKey(cloud="fake", region="r1", zone="r1a", instance_type="gpu.small", market=ev.Market.SPOT)
POOL_B = ev.PoolKey(cloud="fake", region="r1", zone="r1a", instance_type="gpu.alt", market=ev.Market.SPOT)
PRICES = ((POOL_A, 1.0, 3.0), (POOL_B, 1.3, 3.2))
"""Two spot pools in one zone (a noticed node is replaced from the other pool) and their on-demand prices."""

CONFIG = """
[nats]
urls = ["{url}"]
reconnect_wait_s = 0.2
[daemon]
state_dir = "{state}"
cluster_id = "{cluster}"
{daemon_extra}
tick_s = 0.25
price_confirm_s = 0.0
heartbeat_interval_s = 0.5
heartbeat_timeout_s = 3.0
command_ack_timeout_s = 1.0
command_retries = 3
liveness_flush_s = 2.0
shutdown_grace_s = 5.0
[metrics]
port = 0
[log]
level = "warning"
format = "json"
[providers]
enabled = ["fake"]
[providers.fake]
state_file = "{fake_file}"
"""


class Orchd:
    """orchd as a real subprocess. ``start`` waits for readiness; ``kill9`` is SIGKILL."""

    def __init__(self, workdir: Path, nats_url: str, daemon_extra: str = "") -> None:
        self.workdir = workdir
        self.state = workdir / "state"
        self.fake_file = workdir / "fake-cloud.json"
        self.cfg = workdir / "orchd.toml"
        self.log = workdir / "orchd.log"
        self.cfg.write_text(CONFIG.format(url=nats_url, state=self.state, cluster=CLUSTER_ID,
                                          fake_file=self.fake_file, daemon_extra=daemon_extra))
        self.proc: subprocess.Popen | None = None
        self.metrics_url = ""
        self.starts = 0
        self.kills = 0
        self.crashes = 0  # exits nobody asked for
        self._stopping = False

    def start(self, timeout_s: float = 60.0) -> Orchd:
        disc = self.state / "orchd.json"
        disc.unlink(missing_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator.daemon", "--config", str(self.cfg)],
                                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.starts += 1
        self._stopping = False
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                self.crashes += 1
                raise RuntimeError(f"orchd exited at start ({self.proc.returncode}): {self.tail()}")
            if disc.exists():
                try:
                    info = json.loads(disc.read_text())
                except ValueError:
                    info = {}
                if info.get("pid") == self.proc.pid:
                    self.metrics_url = info.get("metrics_url", "")
                    return self
            if time.monotonic() > deadline:
                raise RuntimeError(f"orchd not ready in {timeout_s} s: {self.tail()}")
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def crashed(self) -> bool:
        """True (once, and one crash counted) when the process exited without being asked to."""
        p = self.proc
        if p is not None and not self._stopping and p.poll() is not None and p.returncode != -signal.SIGKILL:
            self.crashes += 1
            self._stopping = True  # counted once
            return True
        return False

    def kill9(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:  # died on its own before our kill: a crash
            self.crashes += 1
        else:
            self.proc.send_signal(signal.SIGKILL)
            self.kills += 1
        self.proc.wait(10)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM and wait (a clean shutdown); returns the exit code."""
        if self.proc is None:
            return None
        self._stopping = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self.crashes += 1  # a daemon that ignores SIGTERM is as bad as one that crashed
        code = self.proc.returncode
        if code not in (0, -signal.SIGKILL):
            self.crashes += 1
        return code

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def rejected(self) -> Counter[tuple[str, str]]:
        """``orchd_messages_rejected_total`` by (kind, reason), from the daemon's /metrics."""
        return rejected_counts(self.metrics_url)


def rejected_counts(metrics_url: str) -> Counter[tuple[str, str]]:
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    out: Counter[tuple[str, str]] = Counter()
    for line in text.splitlines():
        if not line.startswith("orchd_messages_rejected_total{"):
            continue
        labels, value = line[len("orchd_messages_rejected_total{"):].rsplit("} ", 1)
        kv = dict(part.split("=", 1) for part in labels.split('",') if "=" in part)
        kind = kv.get("kind", "").strip('"')
        reason = kv.get("reason", "").strip('"')
        out[(kind, reason)] += int(float(value))
    return out


@dataclass
class CloudCount:
    """What the fake cloud holds, counted on its side."""

    instances: int = 0
    alive: int = 0
    duplicate_launches: int = 0  # instances beyond the first for one node id (each node id is launched once)
    alive_duplicates: int = 0  # node ids with two live instances at once
    by_node: dict[str, list[str]] = field(default_factory=dict)


def count_cloud(fake_file: Path) -> CloudCount:
    insts: list[Instance] = read_fake_file(fake_file)
    by_node: dict[str, list[Instance]] = {}
    for i in insts:
        by_node.setdefault(str(i.node_id), []).append(i)
    return CloudCount(
        instances=len(insts),
        alive=sum(1 for i in insts if i.alive),
        duplicate_launches=sum(len(v) - 1 for v in by_node.values()),
        alive_duplicates=sum(1 for v in by_node.values() if sum(1 for i in v if i.alive) > 1),
        by_node={k: [i.instance_id for i in v] for k, v in by_node.items()},
    )


def price_tick(pool: ev.PoolKey, usd: float, od: float, tag: str) -> ev.PriceTick:
    return ev.PriceTick(id=f"px-{tag}-{pool.name}", pool=pool, gpu_type="A100", gpus_per_node=1,
                        price_usd_h=usd, on_demand_usd_h=od, ts=time.time())


def job_spec(name: str, *, nodes: int, total_steps: int) -> ev.JobSpec:
    return ev.JobSpec(name=name, total_steps=total_steps, step_time_s_estimate=0.05, gpu_type="A100",
                      gpus_per_node=1, nodes=nodes, nodes_min=1, nodes_max=nodes, clouds=("fake",),
                      market=ev.MarketPolicy.SPOT_WITH_FALLBACK,
                      checkpoint=ev.CheckpointPolicy(url=f"file:///tmp/orch-chaos/{name}", interval_s=600.0,
                                                     save_s_estimate=0.5))
