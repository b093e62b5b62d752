"""The local provider: a ``CloudProvider`` whose nodes are ``orch-agent`` processes on this machine.

Role: the whole loop without a cloud (the demo, end-to-end tests, a laptop). Each launched node is one
agent process (``sys.executable -m agent.main``) with its own fake metadata service
(``providers.local.metadata``), so a preemption is injected exactly as a cloud announces it:

- ``preempt(node, notice_s)``: the node's metadata service announces termination at now + notice_s
  (AWS instance-action, GCP preempted, Azure Preempt - whichever flavour the zone speaks), and the
  node's process tree is killed (SIGKILL) at the deadline, whatever it is doing.
- ``vanish(node)``: SIGKILL of the node's process tree now, with no notice (a host failure).

Pools: one per local zone (``zones``; each zone may speak another cloud's metadata flavour), spot and
on-demand, with prices from a ``FixedPrices`` table or a ``ReplayPrices`` history replayed in accelerated
time (see prices.py). ``capacity`` limits live instances per pool (None = unlimited).

Idempotency: a launch with a token already used returns the first call's instances.
Instance ids are ``local-<run>-<n>``: ``<run>`` is fixed per provider object (its start time and 2 random bytes), so an
orchd started again never reuses an id its state still holds for a node of the last run (a Terminate
of that old node must not reach a new one); terminated instances stay visible to ``describe`` as
TERMINATED.

When orchd stops, its local nodes stop too (``daemon_stopping``, called by orchd on its way out,
before its NATS connections close): each node's metadata service and this node table live in orchd's
process, so a node left running would poll a dead metadata service, and a restarted orchd (a new
provider, empty table) could neither describe nor terminate it. Each agent gets SIGTERM - it
checkpoints its ranks and publishes ``NodeLeaving`` while NATS is still up - and SIGKILL after
``terminate_grace_s``. Nodes of a cloud provider, by contrast, outlive orchd by design.

Concurrency contract: thread-safe (one lock around the bookkeeping; process spawning and killing
happen outside it where they can block). Kill timers are daemon threads. ``close()`` kills every node
at once (SIGKILL); ``daemon_stopping()`` stops them all gracefully, in parallel.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import msgspec
import psutil
import structlog

from providers.base import (
    TAG_CLUSTER,
    CapacityError,
    Instance,
    InstanceState,
    LaunchRequest,
    LaunchResult,
    PriceQuote,
    check_owned,
    raise_refused,
)
from providers.local.metadata import MetadataServer
from providers.local.prices import BUNDLED_HISTORY, P3_2XLARGE_ON_DEMAND_USD_H, FixedPrices, PriceSource, ReplayPrices
from wire import FailureReason, InstanceId, Market, NodeId, PoolKey
from wire.config import load_checked

log = structlog.get_logger("providers.local")


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalConfig:
    region: str = "local-1"
    zones: tuple[str, ...] = ("local-a", "local-b", "local-c")
    metadata: Mapping[str, str] = field(default_factory=dict)
    """zone -> metadata flavour its nodes speak (aws | gcp | azure); default aws."""
    instance_type: str = "cpu.local"
    gpu_type: str = "cpu"
    gpus_per_node: int = 1
    """Ranks per node (processes); on CPU keep 1."""
    work_dir: str = "./var/local-nodes"
    nats_urls: tuple[str, ...] = ()
    """Used when a launch request carries no bootstrap."""
    agent_args: tuple[str, ...] = ()
    """Extra orch-agent arguments, e.g. ("--heartbeat-s", "1")."""
    agent_env: Mapping[str, str] = field(default_factory=dict)
    prices: str = "fixed"
    """fixed | replay"""
    spot_usd_h: Mapping[str, float] = field(default_factory=dict)
    """fixed: zone -> spot price; missing zones get 0.30 x on-demand."""
    on_demand_usd_h: float = P3_2XLARGE_ON_DEMAND_USD_H
    history_csv: str = ""
    """replay: a DescribeSpotPriceHistory-shaped CSV; empty = the bundled us-west-2 p3.2xlarge excerpt."""
    history_instance_type: str = "p3.2xlarge"
    replay_speedup: float = 3600.0
    capacity: Mapping[str, int] = field(default_factory=dict)
    """pool name -> max live instances."""
    terminate_grace_s: float = 5.0
    """terminate(): SIGTERM (the agent checkpoints and leaves), SIGKILL after this grace."""


@dataclass(slots=True)
class _Node:
    instance: Instance
    metadata: MetadataServer
    proc: subprocess.Popen[bytes] | None
    log_file: IO[bytes] | None
    work_dir: Path
    flavour: str
    kill_at: float | None = None


class LocalProvider:
    """See the module docstring."""

    cloud = "local"

    def __init__(self, config: LocalConfig | None = None, *, prices: PriceSource | None = None) -> None:
        self.config = cfg = config or LocalConfig()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        # this provider object's instance ids (module docstring): its start time, and 2 random bytes
        self._run = f"{time.time_ns() // 1_000_000:x}{os.urandom(2).hex()}"
        self._nodes: dict[InstanceId, _Node] = {}
        self._by_node: dict[str, InstanceId] = {}
        self._by_token: dict[str, tuple[InstanceId, ...]] = {}
        self.work_dir = Path(cfg.work_dir).resolve()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        if prices is None:
            if cfg.prices == "replay":
                prices = ReplayPrices(cfg.history_csv or BUNDLED_HISTORY, cfg.zones,
                                      on_demand_usd_h=cfg.on_demand_usd_h, instance_type=cfg.history_instance_type,
                                      speedup=cfg.replay_speedup)
            elif cfg.prices == "fixed":
                table = {z: float(cfg.spot_usd_h.get(z, 0.30 * cfg.on_demand_usd_h)) for z in cfg.zones}
                prices = FixedPrices(table, cfg.on_demand_usd_h)
            else:
                raise ValueError(f"providers.local.prices: {cfg.prices!r} is not fixed or replay")
        self.price_source = prices
        self.launch_calls = 0
        self.events: list[tuple[float, str, str]] = []  # (ts, kind, node) of injected faults
        self.ended_ts: dict[InstanceId, float] = {}
        self._price_log: dict[str, list[tuple[float, float]]] = {}  # zone -> spot price changes seen

    # --- pools -----------------------------------------------------------------------------------

    def pools(self) -> list[PoolKey]:
        c = self.config
        return [PoolKey(cloud=self.cloud, region=c.region, zone=z, instance_type=c.instance_type, market=m)
                for z in c.zones for m in (Market.SPOT, Market.ON_DEMAND)]

    def pool(self, zone: str, market: Market = Market.SPOT) -> PoolKey:
        c = self.config
        return PoolKey(cloud=self.cloud, region=c.region, zone=zone, instance_type=c.instance_type, market=market)

    # --- CloudProvider ---------------------------------------------------------------------------

    def launch(self, request: LaunchRequest) -> LaunchResult:
        c = self.config
        pool = request.pool
        with self._lock:
            self.launch_calls += 1
            existing = self._by_token.get(request.idempotency_token)
            if existing is not None:
                return LaunchResult(instances=tuple(self._nodes[i].instance for i in existing))
            if pool.cloud != self.cloud or pool.zone not in c.zones or pool.instance_type != c.instance_type:
                raise CapacityError(f"no such local pool {pool.name}", pool=pool)
            cap = c.capacity.get(pool.name)
            live = sum(1 for n in self._nodes.values() if n.instance.pool == pool and n.instance.alive)
            room = request.count if cap is None else max(0, min(request.count, cap - live))
            if room == 0:
                raise CapacityError(f"no capacity in {pool.name}", pool=pool)
            planned = [(InstanceId(f"local-{self._run}-{next(self._ids):05d}"), request.node_ids[i])
                       for i in range(room)]
            self._by_token[request.idempotency_token] = tuple(i for i, _ in planned)
        boot = request.bootstrap
        urls = boot.nats_urls if boot is not None and boot.nats_urls else c.nats_urls
        created = []
        for iid, node_id in planned:
            created.append(self._spawn(iid, NodeId(node_id), request, urls))
        missing = request.count - room
        return LaunchResult(instances=tuple(created), missing=missing,
                            failure=FailureReason.CAPACITY if missing else None,
                            message=f"{missing} short in {pool.name}" if missing else "")

    def _spawn(self, iid: InstanceId, node_id: NodeId, request: LaunchRequest, urls: Sequence[str]) -> Instance:
        c = self.config
        flavour = c.metadata.get(request.pool.zone, "aws")
        md = MetadataServer(instance_name=str(iid)).start()
        wd = self.work_dir / str(node_id)
        wd.mkdir(parents=True, exist_ok=True)
        inst = Instance(instance_id=iid, node_id=node_id, pool=request.pool, state=InstanceState.RUNNING,
                        tags=request.instance_tags(node_id), launched_ts=time.time(), private_ip="127.0.0.1")
        args = [sys.executable, "-m", "agent.main", "--node-id", str(node_id), "--metadata", flavour,
                "--metadata-endpoint", md.url, "--cloud-name", self.cloud, "--work-dir", str(wd),
                "--instance-id", str(iid), "--pool", msgspec.json.encode(request.pool).decode(),
                "--advertise-host", "127.0.0.1", "--exit-with-parent"]
        for u in urls:
            args += ["--nats-url", u]
        args += list(c.agent_args)
        env = self.agent_environment(node_id, request)
        log_file = open(wd / "agent.log", "ab")  # noqa: SIM115 - closed when the node ends
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        with self._lock:
            self._nodes[iid] = _Node(inst, md, proc, log_file, wd, flavour)
            self._by_node[str(node_id)] = iid
        log.info("local_node_launched", node_id=node_id, instance_id=iid, zone=request.pool.zone,
                 market=str(request.pool.market), metadata=flavour, pid=proc.pid)
        return inst

    def agent_environment(self, node_id: NodeId, request: LaunchRequest) -> dict[str, str]:
        """The environment of a node's agent: orchd's, less its ``CREDENTIALS_DIRECTORY`` (orchd's own
        secrets, which systemd hands to orchd alone), plus ``agent_env`` (which may name the node's own
        credentials directory), plus the launch's secret: the node's single-use enrolment token
        (``ORCH_AGENT_ENROL_TOKEN``, as the cloud bootstrap writes it) when orchd issues per-node
        credentials, else the shared token. Secrets never go on the command line."""
        env = {k: v for k, v in os.environ.items() if k != "CREDENTIALS_DIRECTORY"}
        env.update(self.config.agent_env)
        boot = request.bootstrap
        if boot is not None and boot.node_credentials.get(str(node_id)):
            env["ORCH_AGENT_ENROL_TOKEN"] = boot.node_credentials[str(node_id)]
        elif boot is not None and boot.credential:
            env["ORCH_AGENT_NATS_TOKEN"] = boot.credential
        return env

    def terminate(self, instance_ids: Sequence[InstanceId], cluster_id: str) -> None:
        """Stop only the nodes that carry this cluster's tag; refuse (log, then raise) the rest."""
        with self._lock:
            described = [self._nodes[i].instance for i in instance_ids if i in self._nodes]
        ours, refused = check_owned(self.cloud, cluster_id, described, log.warning)
        for iid in ours:
            with self._lock:
                node = self._nodes.get(iid)
                if node is None or not node.instance.alive:
                    continue
                node.instance = msgspec.structs.replace(node.instance, state=InstanceState.STOPPING)
            threading.Thread(target=self._stop_node, args=(iid, "terminated"), daemon=True,
                             name=f"terminate-{iid}").start()
        raise_refused(self.cloud, cluster_id, refused)

    def _stop_node(self, iid: InstanceId, why: str) -> None:
        """A cloud's terminate: ACPI shutdown (SIGTERM to the agent), then power off after the grace."""
        node = self._nodes[iid]
        if node.proc is not None and node.proc.poll() is None:
            try:
                node.proc.send_signal(signal.SIGTERM)
                node.proc.wait(self.config.terminate_grace_s)
            except subprocess.TimeoutExpired:
                pass
        self._kill(iid, why)

    def list_instances(self, cluster_id: str) -> list[Instance]:
        self._refresh()
        with self._lock:
            return [n.instance for n in self._nodes.values()
                    if n.instance.alive and n.instance.tags.get(TAG_CLUSTER) == cluster_id]

    def describe(self, instance_ids: Sequence[InstanceId]) -> list[Instance]:
        self._refresh()
        with self._lock:
            return [self._nodes[i].instance for i in instance_ids if i in self._nodes]

    def prices(self, pools: Sequence[PoolKey] | None = None) -> list[PriceQuote]:
        now = time.time()
        od = self.price_source.on_demand_usd_h
        out = []
        for pool in pools if pools is not None else self.pools():
            if pool.cloud != self.cloud or pool.zone not in self.config.zones:
                continue
            spot = self.price_source.price(pool.zone)
            with self._lock:
                series = self._price_log.setdefault(pool.zone, [])
                if not series or series[-1][1] != spot:
                    series.append((now, spot))
            out.append(PriceQuote(pool=pool, gpu_type=self.config.gpu_type, gpus_per_node=self.config.gpus_per_node,
                                  price_usd_h=spot if pool.market is Market.SPOT else od, on_demand_usd_h=od, ts=now))
        return out

    # --- fault injection -------------------------------------------------------------------------

    def instance_of(self, node_id: str) -> InstanceId:
        with self._lock:
            return self._by_node[node_id]

    def metadata_of(self, node_id: str) -> MetadataServer:
        with self._lock:
            return self._nodes[self._by_node[node_id]].metadata

    def preempt(self, node_id: str, notice_s: float = 30.0) -> float:
        """Announce the reclaim through the node's metadata service; kill it at the deadline. Returns it."""
        iid = self.instance_of(node_id)
        deadline = time.time() + notice_s
        with self._lock:
            node = self._nodes[iid]
            node.kill_at = deadline
            self.events.append((time.time(), "notice", node_id))
        node.metadata.inject_terminate(deadline)
        log.info("local_preemption_notice", node_id=node_id, deadline_s=notice_s, metadata=node.flavour)
        timer = threading.Timer(max(0.0, deadline - time.time()), self._kill, args=(iid, "preempted"))
        timer.daemon = True
        timer.start()
        return deadline

    def vanish(self, node_id: str) -> None:
        """The node disappears now: no notice, every process killed (a host failure)."""
        iid = self.instance_of(node_id)
        with self._lock:
            self.events.append((time.time(), "vanished", node_id))
        self._kill(iid, "vanished")

    # --- fault injection by an operator (orchd's admin API: orchctl nodes preempt | kill) -----------

    def inject_preemption(self, node_id: str, instance_id: str | None, notice_s: float) -> float:
        """``preempt`` for orchd's ``nodes.preempt``, after checking the node is one of ours and alive
        (LookupError: not ours; ValueError: not running any more, or a preemption is pending). The deadline."""
        self._injectable(node_id, instance_id)
        return self.preempt(node_id, notice_s)

    def inject_kill(self, node_id: str, instance_id: str | None) -> None:
        """``vanish`` for orchd's ``nodes.kill``, after the same checks as ``inject_preemption``."""
        self._injectable(node_id, instance_id, kill=True)
        self.vanish(node_id)

    def _injectable(self, node_id: str, instance_id: str | None, *, kill: bool = False) -> None:
        self._refresh()
        with self._lock:
            iid = self._by_node.get(node_id)
            if iid is None:
                raise LookupError(f"the local provider has no instance for node {node_id!r} (not launched yet?)")
            node = self._nodes[iid]
            if instance_id is not None and instance_id != iid:
                raise LookupError(f"node {node_id!r} is instance {iid} here, not {instance_id}")
            if not node.instance.alive:
                raise ValueError(f"instance {iid} is not running any more (state {node.instance.state.value})")
            if node.kill_at is not None and not kill:
                left = node.kill_at - time.time()
                raise ValueError(f"a preemption of instance {iid} is pending already (deadline in {left:.0f} s)")

    def _kill(self, iid: InstanceId, why: str) -> None:
        with self._lock:
            node = self._nodes.get(iid)
            if node is None:
                return
            proc = node.proc
        if proc is not None and proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait()
        with self._lock:
            first = node.instance.state != InstanceState.TERMINATED
            if first:
                self.ended_ts[iid] = time.time()
                node.instance = msgspec.structs.replace(node.instance, state=InstanceState.TERMINATED)
                log.info("local_node_ended", node_id=node.instance.node_id, instance_id=iid, why=why)
            if node.log_file is not None:
                node.log_file.close()
                node.log_file = None
        if first:
            node.metadata.stop()

    def _refresh(self) -> None:
        """An agent process that exited on its own (crash, drain) is a terminated instance."""
        with self._lock:
            dead = [iid for iid, n in self._nodes.items()
                    if n.instance.alive and n.proc is not None and n.proc.poll() is not None]
        for iid in dead:
            self._kill(iid, "exited")

    def bill(self, now: float | None = None) -> dict[str, float]:
        """What this cloud would charge: each instance's lifetime priced per second at its pool's price
        (spot: the prices this provider quoted over time, spikes included; on-demand: fixed)."""
        now = time.time() if now is None else now
        od = self.price_source.on_demand_usd_h
        cost = node_s = 0.0
        with self._lock:
            for iid, n in self._nodes.items():
                start = n.instance.launched_ts or now
                end = self.ended_ts.get(iid, now)
                node_s += max(0.0, end - start)
                if n.instance.pool.market is Market.ON_DEMAND:
                    cost += od * max(0.0, end - start) / 3600.0
                    continue
                zone = n.instance.pool.zone
                series = self._price_log.get(zone) or [(start, self.price_source.price(zone))]
                for i, (ts, price) in enumerate(series):
                    seg_end = series[i + 1][0] if i + 1 < len(series) else float("inf")
                    lo, hi = max(start, ts if i else float("-inf")), min(end, seg_end)
                    if hi > lo:
                        cost += price * (hi - lo) / 3600.0
        return {"cost_usd": cost, "node_seconds": node_s, "on_demand_cost_usd": od * node_s / 3600.0}

    def daemon_stopping(self) -> None:
        """orchd is stopping: stop every live node gracefully and in parallel (see the module
        docstring); returns once all are gone (at most ``terminate_grace_s`` plus the kill)."""
        with self._lock:
            ids = [iid for iid, n in self._nodes.items()
                   if n.instance.alive and n.proc is not None and n.proc.poll() is None]
        if not ids:
            return
        log.info("local_nodes_stopping", nodes=len(ids), grace_s=self.config.terminate_grace_s)
        threads = [threading.Thread(target=self._stop_node, args=(iid, "orchd_stopped"), daemon=True,
                                    name=f"stop-{iid}") for iid in ids]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def close(self) -> None:
        with self._lock:
            ids = [iid for iid, n in self._nodes.items() if n.proc is not None and n.proc.poll() is None]
        for iid in ids:
            self._kill(iid, "provider_closed")

    def node_pools(self) -> dict[str, str]:
        """node id -> the short name of its pool (zone/market), for reports."""
        with self._lock:
            return {str(n.instance.node_id): f"{n.instance.pool.zone}/{n.instance.pool.market}"
                    for n in self._nodes.values()}

    def alive_nodes(self) -> list[str]:
        self._refresh()
        with self._lock:
            return [str(n.instance.node_id) for n in self._nodes.values() if n.instance.alive]


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (children listed first, so none escapes by reparenting)."""
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):  # it ended by itself meanwhile
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=5)


def from_settings(table: Mapping[str, Any]) -> LocalProvider:
    """``[providers.local]`` of orchd's settings -> LocalProvider; one SettingsError with every problem."""
    return LocalProvider(load_checked(LocalConfig, dict(table), "providers.local"))
