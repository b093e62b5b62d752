"""The world of the partition drills: 3 NATS servers, 2 orchd and the agents, each in its own namespace.

Role: on a ``netns.Topology``, start what the product runs, as it runs it:

* ``nats1..nats3``: ``nats-server -c FILE`` (a config from ``render_server_config``: client port 4222,
  cluster routes on 6222 to the other two, JetStream), each on its host's address;
* ``orchd1``, ``orchd2``: ``python -m orchestrator.daemon --config FILE`` with the three URLs,
  ``stream_replicas = 3``, ``daemon.ha = true`` and a short lease; one file-backed fake cloud shared by
  both (``[providers.fake] shared = true``: every call is logged with the caller's pid, so cloud calls
  are attributed on the cloud side). A supervisor restarts an orchd that exited, 2 s later, as
  systemd's ``Restart=on-failure`` / ``RestartSec=2s`` does (systemd/orchd.service);
* one agent host per instance the fake cloud launched (``agentN``, created when the instance appears, as a
  VM boots): ``python -m simulations.chaos.realhost`` - the VM's metadata service and the real orch-agent,
  started as the local provider starts a node, whose ranks run the job's ``trainer.command``
  (``simulations.chaos.parttrainer``, no torch); or, with ``agents="sim"``, ``simulations.chaos.simhost``
  (the simulated agent of ``agents.SimFleet``: no processes but the one, for drills of many nodes).

The driver (this process, root namespace, on the bridge) talks to the cluster like orchctl does (the
admin service) and reads the agents' records and the fake cloud's files to score.

Concurrency contract: the async methods run on the driver's loop; process starts go through
``anyio.to_thread``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

import wire as ev
from orchestrator.cli.client import AdminClient, AdminUnreachable
from orchestrator.natsserver import server_binary
from orchestrator.security.nats_auth import render_server_config
from providers.base import TAG_JOB
from simulations.chaos.harness import CLUSTER_ID, ROOT, count_cloud
from simulations.chaos.netns import Topology
from simulations.fakecloud import read_fake_file

EXIT_LEASE_LOST = 3  # orchestrator.daemon.run.EXIT_LEASE_LOST (not imported: the daemon's top module)

ORCHD_CONFIG = """
[nats]
urls = [{urls}]
stream_replicas = 3
reconnect_wait_s = 0.2
[daemon]
state_dir = "{state}"
cluster_id = "{cluster}"
ha = true
lease_ttl_s = {ttl}
tick_s = 0.25
price_confirm_s = 0.0
heartbeat_interval_s = {hb}
heartbeat_timeout_s = {hb_timeout}
command_ack_timeout_s = 1.0
command_retries = 3
liveness_flush_s = 2.0
shutdown_grace_s = 5.0
[metrics]
host = "{ip}"
port = 9464
refresh_s = 1.0
[log]
level = "info"
format = "json"
[providers]
enabled = ["fake"]
[providers.fake]
state_file = "{fake_file}"
shared = true
"""


@dataclass
class Timing:
    """The drills' clock: the product's defaults scaled down (heartbeat 2 s / timeout 10 s / lease 6 s)."""

    hb_s: float = 0.5
    hb_timeout_s: float = 4.0
    lease_ttl_s: float = 3.0
    step_s: float = 0.05


@dataclass
class OrchdProc:
    name: str
    cfg: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    pids: list[int] = field(default_factory=list)
    exits: list[tuple[float, int, int]] = field(default_factory=list)  # (time, pid, code)
    held: bool = False  # the driver keeps it down (no restart)


class World:
    def __init__(self, topo: Topology, work: Path, timing: Timing | None = None, agents: str = "real") -> None:
        if agents not in ("real", "sim"):
            raise ValueError(f"agents must be 'real' or 'sim', not {agents!r}")
        self.topo, self.work, self.t, self.agent_kind = topo, work, timing or Timing(), agents
        self.ckpt_root = work / "checkpoints"
        self.fake_file = work / "fake-cloud.json"
        self.calls_file = self.fake_file.with_suffix(".calls.jsonl")
        self.servers: dict[str, subprocess.Popen[bytes]] = {}
        self.urls: dict[str, str] = {}
        self.orchds: dict[str, OrchdProc] = {}
        self.agents: dict[str, str] = {}  # instance id -> host name
        self.agent_dirs: dict[str, Path] = {}  # host name -> its records folder
        self.crashes: list[str] = []

    # --- start ------------------------------------------------------------------------------------

    def start_nats(self) -> None:
        names = ["nats1", "nats2", "nats3"]
        for n in names:
            self.topo.add_host(n)
        routes = [f"nats-route://{self.topo.hosts[n].ip}:6222" for n in names]
        for n in names:
            d = self.work / n
            d.mkdir(parents=True, exist_ok=True)
            conf = d / "server.conf"
            ip = self.topo.hosts[n].ip
            conf.write_text(render_server_config(
                auth_include=None, host=ip, port=4222, store_dir=str(d / "js"), http_port=None, server_name=n,
                cluster={"name": "orch", "host": ip, "port": 6222, "routes": routes}))
            self.servers[n] = self.topo.spawn(n, [server_binary(), "-c", str(conf)], log=d / "server.log")
            self.urls[n] = f"nats://{ip}:4222"
        deadline = time.monotonic() + 30
        for n in names:
            log = self.work / n / "server.log"
            while "Server is ready" not in (log.read_text(errors="replace") if log.exists() else ""):
                if self.servers[n].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{n} did not start: {log.read_text(errors='replace')[-1500:]}")
                time.sleep(0.05)

    def start_orchds(self) -> None:
        urls = ", ".join(f'"{u}"' for u in self.urls.values())
        for n in ("orchd1", "orchd2"):
            self.topo.add_host(n)
            d = self.work / n
            d.mkdir(parents=True, exist_ok=True)
            cfg = d / "orchd.toml"
            cfg.write_text(ORCHD_CONFIG.format(urls=urls, state=d / "state", cluster=CLUSTER_ID,
                                               ip=self.topo.hosts[n].ip, ttl=self.t.lease_ttl_s, hb=self.t.hb_s,
                                               hb_timeout=self.t.hb_timeout_s, fake_file=self.fake_file))
            self.orchds[n] = OrchdProc(n, cfg, d / "orchd.log")
        self._spawn_orchd(self.orchds["orchd1"])
        self.wait_log("orchd1", "lease_acquired", 60)
        self._spawn_orchd(self.orchds["orchd2"])
        self.wait_log("orchd2", "standby", 60)

    def _spawn_orchd(self, o: OrchdProc) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
        env["PYTHONUNBUFFERED"] = "1"
        o.proc = self.topo.spawn(o.name, [sys.executable, "-m", "orchestrator.daemon", "--config", str(o.cfg)],
                                 log=o.log, cwd=ROOT, env=env)
        o.pids.append(o.proc.pid)  # ``ip netns exec`` execs the command: same pid

    # --- running -------------------------------------------------------------------------------------

    async def supervise(self) -> None:
        """Restart an exited orchd after 2 s (systemd's Restart=on-failure); boot an agent host for every
        new live instance in the fake cloud."""
        while True:
            for o in self.orchds.values():
                if o.proc is not None and o.proc.poll() is not None:
                    code = o.proc.returncode
                    o.exits.append((time.time(), o.proc.pid, code))
                    if code != EXIT_LEASE_LOST:  # with the last lines of its log: why
                        self.crashes.append(f"{o.name} pid {o.proc.pid} exited {code}: {_tail(o.log)}")
                    o.proc = None
                if o.proc is None and not o.held and (not o.exits or time.time() - o.exits[-1][0] >= 2.0):
                    await anyio.to_thread.run_sync(self._spawn_orchd, o)
            try:
                insts = read_fake_file(self.fake_file)
            except (OSError, ValueError):
                insts = []
            for inst in insts:
                if inst.alive and inst.instance_id not in self.agents:
                    name = f"agent{len(self.agents) + 1}"  # registered on this loop, never from a thread
                    self.agents[inst.instance_id] = name
                    self.agent_dirs[name] = self.work / name
                    await anyio.to_thread.run_sync(self._boot_agent, str(inst.instance_id), name)
            await anyio.sleep(0.1)

    def _boot_agent(self, instance_id: str, name: str) -> None:
        host = self.topo.add_host(name)
        d = self.work / name
        d.mkdir(parents=True, exist_ok=True)
        common = ["--nats", ",".join(self.urls.values()), "--fake-file", str(self.fake_file),
                  "--instance", instance_id, "--out", str(d), "--hb-s", str(self.t.hb_s)]
        if self.agent_kind == "real":
            argv = [sys.executable, "-m", "simulations.chaos.realhost", *common, "--ip", host.ip]
        else:
            argv = [sys.executable, "-m", "simulations.chaos.simhost", *common, "--step-s", str(self.t.step_s)]
        self.topo.spawn(name, argv, log=d / "host.log", cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_log(self, orchd: str, event: str, timeout_s: float, after: int = 0) -> None:
        log = self.orchds[orchd].log
        deadline = time.monotonic() + timeout_s
        while True:
            text = log.read_text(errors="replace")[after:] if log.exists() else ""
            if f'"event": "{event}"' in text:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{orchd}: no {event} in {timeout_s} s: {text[-2000:]}")
            time.sleep(0.05)

    def log_events(self, orchd: str, event: str) -> list[dict[str, Any]]:
        out = []
        log = self.orchds[orchd].log
        for line in (log.read_text(errors="replace") if log.exists() else "").splitlines():
            if f'"event": "{event}"' in line:
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
        return out

    def log_times(self, orchd: str, event: str) -> list[float]:
        """When (epoch seconds, from the log's own UTC timestamps) ``orchd`` logged ``event``."""
        from datetime import datetime

        return [datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
                for e in self.log_events(orchd, event) if "timestamp" in e]

    # --- observations -------------------------------------------------------------------------------

    async def admin(self) -> AdminClient:
        return await AdminClient.connect(list(self.urls.values()), timeout_s=2.0)

    async def leader(self, timeout_s: float = 2.0) -> tuple[str, int] | None:
        """(orchd name, fencing token) of the daemon answering the admin service, or None."""
        try:
            async with await AdminClient.connect(list(self.urls.values()), timeout_s=timeout_s) as c:
                st = await c.status()
        except (AdminUnreachable, OSError, TimeoutError):
            return None
        except Exception:  # a reply cut by the partition: nobody answered in time
            return None
        for o in self.orchds.values():
            if st.pid in o.pids:
                return o.name, st.fencing_token
        return None

    def scrape(self, orchd: str, prefix: str = "orchd_") -> dict[str, float] | None:
        """orchd's /metrics as Prometheus would scrape it over the network (``name{labels}`` -> value);
        None when it cannot be reached (a cut host: Prometheus's ``up`` would be 0)."""
        url = f"http://{self.topo.hosts[orchd].ip}:9464/metrics"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:
                text = r.read().decode()
        except OSError:
            return None
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith(prefix):
                name, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[name] = float(value)
        return out

    def records(self) -> list[dict[str, Any]]:
        """Every agent's records (commands received first-time, events emitted), with ``host``, by time."""
        out = []
        for host, d in self.agent_dirs.items():
            f = d / "records.jsonl"
            if not f.exists():
                continue
            for line in f.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    r = json.loads(line)
                    r["host"] = host
                    out.append(r)
        return sorted(out, key=lambda r: r["t"])

    def cloud_calls(self) -> list[dict[str, Any]]:
        if not self.calls_file.exists():
            return []
        out = []
        for line in self.calls_file.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def cloud(self) -> Any:
        return count_cloud(self.fake_file)

    def host_of(self, node_id: str) -> str | None:
        for inst in read_fake_file(self.fake_file):
            if str(inst.node_id) == node_id:
                return self.agents.get(str(inst.instance_id))
        return None

    def notice(self, host: str, deadline_s: float) -> float:
        """The cloud announces that ``host``'s VM is reclaimed in ``deadline_s``: its metadata service says
        so (realhost; simhost publishes the notice itself). Returns when it was asked."""
        t = time.time()
        tmp = self.agent_dirs[host] / "notice.tmp"
        tmp.write_text(str(deadline_s))
        tmp.rename(self.agent_dirs[host] / "notice")
        return t


def instances_of(fake_file: Path, job_id: str) -> list[Any]:
    return [i for i in read_fake_file(fake_file) if i.tags.get(TAG_JOB) == job_id]


def job_spec(name: str, *, nodes: int, total_steps: int, root: Path, step_s: float = 0.05) -> ev.JobSpec:
    """The drills' job: checkpoints under ``root/<name>`` (its own root, emptied first: a rerun with the same
    seed starts clean), ranks that run ``parttrainer`` at ``step_s`` a step."""
    import shutil

    import msgspec

    from simulations.chaos.harness import job_spec as base

    ckpt = root / name
    shutil.rmtree(ckpt, ignore_errors=True)
    spec = base(name, nodes=nodes, total_steps=total_steps)
    return msgspec.structs.replace(
        spec, checkpoint=msgspec.structs.replace(spec.checkpoint, url=f"file://{ckpt}"),
        trainer=ev.TrainerSpec(command=(sys.executable, "-m", "simulations.chaos.parttrainer"),
                               args={"step_time_s": step_s}))


def _tail(log: Path, lines: int = 3) -> list[str]:
    """The last ``lines`` lines of an orchd log (each cut to 300 characters): why it exited."""
    try:
        return [line[:300] for line in log.read_text(errors="replace").splitlines()[-lines:]]
    except OSError as e:
        return [f"(log unreadable: {e})"]
