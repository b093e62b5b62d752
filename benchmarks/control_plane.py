"""Control-plane benchmark: a real nats-server, a real orchd process, N simulated nodes.

    python benchmarks/control_plane.py --nodes 10000 --json

What it does (all through the wire, no shortcuts into the daemon):
  1. starts nats-server (JetStream, temp dir) and ``orchd`` as a subprocess with the file-backed fake
     cloud (so the benchmark learns the node ids the core chose from the cloud's side);
  2. publishes spot/on-demand prices, submits N / --job-nodes jobs through the admin API, waits until
     the fake cloud holds N instances, registers every node (NodeRegistered on JetStream) and acks every
     command with a simulated agent (one subscriber on orch.cmd.>), heartbeats carry the generation the
     agent was told to start;
  3. latency phase (the stated load): every node heartbeats at 1 Hz on core NATS, price ticks at
     --price-rate/s and preemption notices at --notice-rate/s on JetStream, for --seconds. The
     notice-to-command latency is from the notice's publish to the CheckpointCmd's arrival at the
     simulated agent of the noticed node. Beside each notice, a probe of the bus alone: the same message
     on a stream of the same storage to a raw JetStream consumer in a process of its own
     (``benchmarks/raw_nats.py probe``) that answers at once; publish to answer = the bus's latency;
  4. notice burst (--notice-burst N, under the same heartbeat load): N nodes noticed within one second,
     taken zone by zone and job by job (a zone going away); ``burst_acked_s`` = first notice's publish to
     the last checkpoint command of those jobs acked by its agent;
  5. capacity phase: the same nodes heartbeat as fast as the publisher can, for --burst heartbeats;
     events_per_s = events that went through decide() AND whose batch was persisted (orchd's
     orchd_events_total, counted after persist) / the time it took to process them;
  6. raw phase: the same heartbeats, published the same way, to a raw nats-py subscriber that only counts
     (``benchmarks/raw_nats.py count``, a process of its own, same server): ``raw_events_per_s``.

Output keys: offered_events_per_s (latency phase), events_per_s (capacity phase), latency_events_per_s
(processed during the latency phase), notice_to_command_p50/p99/max_ms, notices, samples, and the setup;
the anchors measured in the same run: bus_p50/p99_ms (bus_samples) and ``notice_p99_over_bus_ms``
(notice_to_command_p99_ms - bus_p99_ms), raw_events_per_s and ``events_vs_raw`` (events_per_s over it),
``burst_acked_s`` (with burst_acked_after_last_notice_s, burst_jobs, burst_checkpoint_cmds_acked,
burst_noticed_nodes_acked, per-node burst_notice_to_ack_p50/p99_ms); and orchd's own view of the
latency phase from its histograms (upper bucket bounds of p50/p99): daemon_notice_to_command_sent,
daemon_event_lag (JetStream publish -> decide: delivery and queueing), daemon_batch_decide and
daemon_batch_persist (per batch). With few samples a p99 is the maximum.

``--baseline-tree DIR`` runs the whole benchmark twice, orchd from DIR first and then from this tree
(or ``--orchd-tree``), and prints both with ``current_over_baseline`` ratios: before/after figures
taken in one run, under the same load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec
import nats
import raw_nats  # benchmarks/raw_nats.py, beside this script
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

import wire as ev
from orchestrator import bus
from orchestrator.cli.client import AdminClient, AdminUnreachable
from orchestrator.jobspec import parse_jobspec
from orchestrator.natsserver import NatsServer
from simulations.fakecloud import read_fake_file

POOLS = [ev.PoolKey(cloud="fake", region="r1", zone=z, instance_type=t, market=m)
         for z in ("r1a", "r1b") for t in ("gpu.a", "gpu.b") for m in (ev.Market.SPOT, ev.Market.ON_DEMAND)]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu_s(pid: int) -> float:
    """user+system CPU seconds of a process (Linux /proc): the load-independent cost of the daemon."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def histogram_buckets(metrics_url: str, name: str, labels: str = "") -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of one Prometheus histogram series of orchd's; ``labels`` picks
    the series (e.g. ``part="persist"``)."""
    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        text = r.read().decode()
    buckets = []
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{") and labels in line:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    return buckets


def histogram_quantiles(buckets: list[tuple[float, float]], before: Sequence[tuple[float, float]] = (),
                        qs: tuple[float, ...] = (0.5, 0.99)) -> dict[str, float | None]:
    """Upper bucket bounds holding the quantiles of the observations made between ``before`` and
    ``buckets`` (two readings of the same histogram)."""
    if before:
        buckets = [(le, c - c0) for (le, c), (_, c0) in zip(buckets, before, strict=True)]
    total = buckets[-1][1] if buckets else 0
    out: dict[str, float | None] = {}
    for q in qs:
        out[f"p{int(q * 100)}_le_ms"] = next((le * 1000 for le, c in buckets if total and c >= q * total), None)
    out["count"] = total
    return out


# orchd's own view of the latency phase: its parts, from its histograms
DAEMON_HISTOGRAMS = {
    "daemon_notice_to_command_sent": ("orchd_notice_to_command_seconds", ""),  # notice publish -> command sent
    "daemon_event_lag": ("orchd_event_lag_seconds", ""),  # JetStream publish -> decide (delivery + queueing)
    "daemon_batch_decide": ("orchd_batch_seconds", 'part="decide"'),  # one batch's decide
    "daemon_batch_persist": ("orchd_batch_seconds", 'part="persist"'),  # one batch's KV/outbox writes
}


def events_total(metrics_url: str) -> float:
    for attempt in range(5):  # a daemon saturated by the capacity phase can answer slowly
        try:
            with urllib.request.urlopen(metrics_url, timeout=30) as r:
                text = r.read().decode()
            break
        except TimeoutError:
            if attempt == 4:
                raise
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("orchd_events_total{"))


def price_tick(pool: ev.PoolKey, i: int) -> ev.PriceTick:
    od = 4.0
    spot = od * (0.30 + 0.02 * ((i + hash(pool.name)) % 5)) if pool.market is ev.Market.SPOT else od
    return ev.PriceTick(id=f"bp-{pool.name}-{i}", pool=pool, gpu_type="A100", gpus_per_node=8,
                        price_usd_h=spot, on_demand_usd_h=od, ts=time.time())


REPO = Path(__file__).resolve().parents[1]
PROBE_STREAM = "BENCH_PROBE"


class Agents:
    """The simulated agents: one subscriber on ``orch.cmd.>`` that acks every command at once, remembers
    each node's generation and when each checkpoint command arrived and was acked."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.gen: dict[str, tuple[ev.JobId | None, int]] = {}
        self.ckpt_arrival: dict[str, float] = {}  # node -> first checkpoint command's arrival
        self.ckpt_acks: list[tuple[str, float]] = []  # (node, ack sent) of every checkpoint command

    async def on_cmd(self, msg: Msg) -> None:
        cmd = ev.decode(msg.data, ev.AgentCommand)
        arrived = time.time()
        if isinstance(cmd, ev.StartGenerationCmd):
            self.gen[cmd.node_id] = (cmd.job_id, cmd.generation)
        elif isinstance(cmd, ev.CheckpointCmd):
            self.ckpt_arrival.setdefault(cmd.node_id, arrived)
        if msg.reply:
            await self.nc.publish(msg.reply, ev.encode(ev.CommandAck(cmd_id=cmd.cmd_id, node_id=cmd.node_id, ok=True,
                                                                     ts=time.time())))
        if isinstance(cmd, ev.CheckpointCmd):
            self.ckpt_acks.append((cmd.node_id, time.time()))


class Load:
    """The stated background load: every node heartbeats at 1 Hz on core NATS (in 20 slices a second),
    price ticks at ``price_rate``/s on JetStream. ``offered`` counts what was published."""

    def __init__(self, nc: Client, js: JetStreamContext, ids: Sequence[str],
                 agents: Agents, price_rate: float) -> None:
        self.nc, self.js, self.ids, self.agents, self.price_rate = nc, js, ids, agents, price_rate
        self.seq = dict.fromkeys(ids, 0)
        self.offered = 0
        self.price_i = 1

    def heartbeat(self, nid: str) -> bytes:
        self.seq[nid] += 1
        job_id, g = self.agents.gen.get(nid, (None, 0))
        n = self.seq[nid]
        return ev.encode(ev.Heartbeat(node_id=ev.NodeId(nid), seq=n, ts=time.time(),
                                      state=ev.AgentState.TRAINING if g else ev.AgentState.IDLE, job_id=job_id,
                                      generation=g, step=n, loss=2.0, tokens_per_s=1e5, step_time_s=1.0,
                                      fencing_token=0))

    async def run(self, stop: asyncio.Event) -> None:
        tick = 0.05
        t_start = time.time()
        ids = self.ids
        while not stop.is_set():
            slice_t0 = time.time()
            k = int(len(ids) * tick)
            base = int((slice_t0 - t_start) / tick) * k
            for j in range(k):
                nid = ids[(base + j) % len(ids)]
                await self.nc.publish(ev.subject_heartbeat(nid), self.heartbeat(nid))
            self.offered += k
            if int((slice_t0 - t_start) * self.price_rate) >= self.price_i:
                pool = POOLS[self.price_i % len(POOLS)]
                await self.js.publish_async(ev.subject_price("fake", "r1"), ev.encode(price_tick(pool, self.price_i)),
                                            headers={"Nats-Msg-Id": f"bp-{pool.name}-{self.price_i}"})
                self.price_i += 1
                self.offered += 1
            await self.nc.flush()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, tick - (time.time() - slice_t0)))


def quantile(xs: Sequence[float], q: float) -> float | None:
    """The q-quantile of xs (nearest rank; with fewer than 100 samples the p99 is the maximum)."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


async def _raw_process(role: str, *args: str) -> subprocess.Popen[bytes]:
    """A ``benchmarks/raw_nats.py`` process, once it printed ``ready``."""
    proc = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "raw_nats.py"), role, *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line = await asyncio.to_thread(proc.stdout.readline)
    if line.strip() != b"ready":
        raise RuntimeError(f"raw_nats.py {role} did not start: {line!r}")
    return proc


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def run(args: argparse.Namespace, tree: Path | None = None) -> dict:
    """One whole run against orchd from ``tree`` (default: this repository)."""
    root = (tree or REPO).resolve()
    tmp = Path(tempfile.mkdtemp(prefix="orch-bench-"))
    server = NatsServer(tmp / "nats").start()
    fake_file = tmp / "fake.json"
    cfg = tmp / "orchd.toml"
    cfg.write_text(f"""
[nats]
urls = ["{server.url}"]
[daemon]
state_dir = "{tmp / 'state'}"
tick_s = 5.0
heartbeat_interval_s = 1.0
heartbeat_timeout_s = 15.0
command_ack_timeout_s = 5.0
# the capacity phase floods every node's heartbeat subject far above any real agent's rate: the per-node
# rate limit (which would refuse most of it, cheaply) is off so that the figure is orchd's decide rate
sender_rate_per_s = 0
[metrics]
port = 0
[log]
level = "{args.log_level}"
format = "json"
[providers]
enabled = ["fake"]
[providers.fake]
state_file = "{fake_file}"
gpus_per_node = 8
""")
    prof = ["-m", "cProfile", "-o", os.environ["ORCH_BENCH_PROFILE"]] if os.environ.get("ORCH_BENCH_PROFILE") else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    with open(tmp / "orchd.log", "w") as orchd_log:  # the daemon keeps its own copy of the descriptor
        daemon = subprocess.Popen([sys.executable, *prof, "-m", "orchestrator.daemon", "--config", str(cfg)],
                                  stdout=subprocess.DEVNULL, stderr=orchd_log, cwd=root, env=env)
    nc = await nats.connect(server.url, pending_size=256 * 1024 * 1024)
    js = nc.jetstream()
    # the bus's own figures come from plain clients in processes of their own (benchmarks/raw_nats.py)
    await js.add_stream(bus._stream_config(PROBE_STREAM, [f"{raw_nats.PROBE_SUBJECT}.>"], 3600.0, 1))
    probe = counter = None
    result: dict = {"nodes": args.nodes, "job_nodes": args.job_nodes, "orchd_tree": str(root)}
    try:
        probe = await _raw_process("probe", server.url, PROBE_STREAM)
        counter = await _raw_process("count", server.url)
        disc = tmp / "state" / "orchd.json"
        for _ in range(300):
            if disc.exists():
                break
            await asyncio.sleep(0.1)
        metrics_url = json.loads(disc.read_text())["metrics_url"]
        client = await AdminClient.connect([server.url], timeout_s=30)
        agents = Agents(nc)
        await nc.subscribe("orch.cmd.>", cb=agents.on_cmd, pending_msgs_limit=1_000_000)
        nodes = await _setup(args, js, client, agents, fake_file)
        result["nodes_running"] = len(agents.gen)
        ids = [nid for nid, _ in nodes]
        load = Load(nc, js, ids, agents, args.price_rate)
        stop_load = asyncio.Event()
        load_task = asyncio.create_task(load.run(stop_load))
        try:
            result.update(await _latency_phase(args, nc, js, agents, load, metrics_url, daemon.pid))
            log(f"latency phase: { {k: v for k, v in result.items() if not k.endswith('_all_ms')} }")
            if args.notice_burst > 0:
                result.update(await _notice_burst(args, js, agents, nodes, result["noticed_jobs"]))
                log(f"notice burst: { {k: v for k, v in result.items() if 'burst' in k} }")
        finally:
            stop_load.set()
            await load_task
        result.pop("noticed_jobs")
        await asyncio.sleep(1.0)
        result.update(await _capacity_phase(args, nc, load, client, daemon.pid))
        log(f"capacity phase: processed {result['events_processed']} of {result['burst_published']} "
            f"in {result['capacity_phase_s']}s")
        await asyncio.sleep(1.0)
        result.update(await _raw_phase(args, nc, load))
        result["events_vs_raw"] = _r(result["events_per_s"] / result["raw_events_per_s"], 3) \
            if result["raw_events_per_s"] else None
        result["load_average"] = os.getloadavg()[0]
        await client.close()
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
        result["daemon_exit"] = daemon.returncode
        _stop(probe)
        _stop(counter)
        await nc.close()
        server.stop()
        if args.keep:
            result["tmp_dir"] = str(tmp)
        else:
            server.cleanup()
            shutil.rmtree(tmp, ignore_errors=True)
    result["cpu_count"] = os.cpu_count()
    return result


async def _setup(args: argparse.Namespace, js: JetStreamContext, client: AdminClient, agents: Agents,
                 fake_file: Path) -> list[tuple[ev.NodeId, Any]]:
    """Prices, jobs, launches, registrations: every node told to start a generation (95% at least)."""
    for pool in POOLS:
        await js.publish(ev.subject_price("fake", "r1"), ev.encode(price_tick(pool, 0)),
                         headers={"Nats-Msg-Id": f"bp-{pool.name}-0"})
    await asyncio.sleep(1.0)
    n_jobs = (args.nodes + args.job_nodes - 1) // args.job_nodes
    spec_text = f"""
name = "bench"
total_steps = 10000000
gpu_type = "A100"
gpus_per_node = 8
nodes = {args.job_nodes}
nodes_min = 1
nodes_max = {args.job_nodes}
clouds = ["fake"]
market = "spot_with_fallback"
[checkpoint]
url = "file:///tmp/bench-ckpt"
interval_s = 3600
"""
    spec = parse_jobspec(spec_text)
    t0 = time.time()
    sem = asyncio.Semaphore(16)

    async def submit(i: int) -> None:
        async with sem:
            own = msgspec.structs.replace(spec.checkpoint, url=f"file:///tmp/bench-ckpt/{i:05d}")  # one root a job
            for attempt in range(5):  # a daemon slowed by a loaded machine: the same job id again (idempotent)
                try:
                    await client.submit(msgspec.structs.replace(spec, checkpoint=own), job_id=f"bench-{i:05d}")
                    return
                except AdminUnreachable:
                    if attempt == 4:
                        raise

    await asyncio.gather(*(submit(i) for i in range(n_jobs)))
    log(f"submitted {n_jobs} jobs in {time.time() - t0:.1f}s")
    t0 = time.time()
    while True:
        insts = [i for i in read_fake_file(fake_file) if i.node_id]
        if len(insts) >= n_jobs * args.job_nodes or time.time() - t0 > 300:
            break
        await asyncio.sleep(0.5)
    log(f"{len(insts)} instances launched in {time.time() - t0:.1f}s")
    nodes = [(i.node_id, i) for i in insts if i.node_id is not None]
    for k, (nid, inst) in enumerate(nodes):
        reg = ev.NodeRegistered(id=f"reg-{nid}", node_id=nid, instance_id=inst.instance_id, pool=inst.pool,
                                agent_version="bench", host=f"10.0.{k // 250}.{k % 250}", ts=time.time())
        await js.publish_async(ev.subject_node_event(nid), ev.encode(reg), headers={"Nats-Msg-Id": reg.id})
    await js.publish_async_completed()
    t0 = time.time()
    while len(agents.gen) < len(nodes) * 0.95 and time.time() - t0 < 180:
        await asyncio.sleep(0.5)
    log(f"{len(agents.gen)} nodes told to start a generation in {time.time() - t0:.1f}s")
    return nodes


async def _latency_phase(args: argparse.Namespace, nc: Client, js: JetStreamContext,
                         agents: Agents, load: Load, metrics_url: str, pid: int) -> dict:
    """Notices at ``--notice-rate``/s under the load, one node of each job; beside each, a probe through the
    bus alone (``raw_nats.py probe``): a JetStream message to a raw consumer that answers at once."""
    probe_arrival: dict[str, float] = {}

    async def on_probe_ack(msg: Msg) -> None:
        probe_arrival.setdefault(msg.subject.rsplit(".", 1)[1], time.time())

    probe_sub = await nc.subscribe(f"{raw_nats.PROBE_ACK}.*", cb=on_probe_ack)
    ids = load.ids
    noticed: dict[str, float] = {}
    probed: dict[str, float] = {}
    start_events = events_total(metrics_url)
    offered0 = load.offered
    hist0 = {k: histogram_buckets(metrics_url, *v) for k, v in DAEMON_HISTOGRAMS.items()}
    cpu0 = cpu_s(pid)
    t_start = time.time()
    notice_targets = iter(ids[:: args.job_nodes])  # one node of each job
    next_notice = t_start + 2.0
    while time.time() - t_start < args.seconds:
        if time.time() >= next_notice:
            target = next(notice_targets, None)
            if target is not None:
                n = ev.PreemptionNotice(id=f"bn-{target}", node_id=ev.NodeId(target), cloud="fake",
                                        deadline_ts=time.time() + 120, observed_ts=time.time())
                noticed[target] = time.time()
                await js.publish_async(ev.subject_notice("fake", target), ev.encode(n), headers={"Nats-Msg-Id": n.id})
                key = str(len(probed))
                probed[key] = time.time()
                await js.publish_async(f"{raw_nats.PROBE_SUBJECT}.{key}", ev.encode(n),
                                       headers={"Nats-Msg-Id": f"probe-{key}"})
                load.offered += 1
            next_notice += 1.0 / args.notice_rate
        await asyncio.sleep(max(0.0, min(0.01, next_notice - time.time())))
    elapsed = time.time() - t_start
    await asyncio.sleep(2.0)
    await probe_sub.unsubscribe()
    processed = events_total(metrics_url) - start_events
    lat = [(agents.ckpt_arrival[n] - t) * 1000 for n, t in noticed.items() if n in agents.ckpt_arrival]
    bus_lat = [(probe_arrival[k] - t) * 1000 for k, t in probed.items() if k in probe_arrival]
    p99, bus_p99 = quantile(lat, 0.99), quantile(bus_lat, 0.99)
    job_of = {nid: agents.gen.get(nid, (None, 0))[0] for nid in noticed}
    return dict(
        latency_phase_daemon_cpu_ratio=round((cpu_s(pid) - cpu0) / (elapsed + 2.0), 2),
        offered_events_per_s=round((load.offered - offered0) / elapsed, 1),
        latency_phase_s=round(elapsed, 1),
        latency_events_per_s=round(processed / (elapsed + 2.0), 1),
        notices=len(noticed),
        samples=len(lat),
        notice_to_command_p50_ms=_r(quantile(lat, 0.5)),
        notice_to_command_p99_ms=_r(p99),
        notice_to_command_max_ms=_r(max(lat, default=None)),
        notice_to_command_all_ms=[round(x, 1) for x in sorted(lat)],
        bus_samples=len(bus_lat),
        bus_p50_ms=_r(quantile(bus_lat, 0.5)),
        bus_p99_ms=_r(bus_p99),
        bus_all_ms=[round(x, 1) for x in sorted(bus_lat)],
        notice_p99_over_bus_ms=_r(p99 - bus_p99) if p99 is not None and bus_p99 is not None else None,
        noticed_jobs={j for j in job_of.values() if j is not None},
        **{k: histogram_quantiles(histogram_buckets(metrics_url, *v), hist0[k]) for k, v in DAEMON_HISTOGRAMS.items()},
    )


async def _notice_burst(args: argparse.Namespace, js: JetStreamContext, agents: Agents,
                        nodes: list[tuple[ev.NodeId, Any]], skip_jobs: set[str]) -> dict:
    """``--notice-burst N``: N nodes noticed within one second, under the same heartbeat load - a zone
    going away: the nodes are taken zone by zone, job by job (jobs noticed in the latency phase left out).
    ``burst_acked_s``: from the first notice's publish until the last checkpoint command sent to a node of
    those jobs was acked by its agent (the agents ack at once); waited for until every noticed node has
    acked one and none came for 2 s."""
    cands = sorted(((inst.pool.zone, agents.gen[nid][0] or "", nid) for nid, inst in nodes
                    if nid in agents.gen and agents.gen[nid][0] not in skip_jobs))
    targets = [nid for _zone, _job, nid in cands[: args.notice_burst]]
    jobs = {agents.gen[nid][0] for nid in targets}
    slices = 20
    per = -(-len(targets) // slices)
    sent: dict[str, float] = {}
    t_first = time.time()
    for k in range(slices):
        t_slice = t_first + k / slices
        await asyncio.sleep(max(0.0, t_slice - time.time()))
        for nid in targets[k * per:(k + 1) * per]:
            n = ev.PreemptionNotice(id=f"burst-{nid}", node_id=ev.NodeId(nid), cloud="fake",
                                    deadline_ts=time.time() + 120, observed_ts=time.time())
            sent[nid] = time.time()
            await js.publish_async(ev.subject_notice("fake", nid), ev.encode(n), headers={"Nats-Msg-Id": n.id})
    await js.publish_async_completed()
    publish_s = time.time() - t_first

    def acks() -> list[tuple[str, float]]:
        return [(nid, ts) for nid, ts in agents.ckpt_acks
                if ts >= t_first and agents.gen.get(nid, (None, 0))[0] in jobs]

    deadline = t_first + args.burst_timeout
    last_n, last_change = -1, time.time()
    while time.time() < deadline:
        got = acks()
        if len(got) != last_n:
            last_n, last_change = len(got), time.time()
        acked_nodes = {nid for nid, _ in got}
        if all(nid in acked_nodes for nid in targets) and time.time() - last_change >= 2.0:
            break
        await asyncio.sleep(0.1)
    got = acks()
    first_ack: dict[str, float] = {}
    for acked, ts in got:
        first_ack.setdefault(acked, ts)
    per_node = [(first_ack[nid] - sent[nid]) * 1000 for nid in targets if nid in first_ack]
    complete = all(nid in first_ack for nid in targets)
    return dict(
        notice_burst=len(targets),
        notice_burst_publish_s=round(publish_s, 3),
        burst_jobs=len(jobs),
        burst_checkpoint_cmds_acked=len(got),
        burst_noticed_nodes_acked=sum(nid in first_ack for nid in targets),
        burst_acked_s=round(max(ts for _, ts in got) - t_first, 3) if complete and got else None,
        burst_acked_after_last_notice_s=round(max(ts for _, ts in got) - max(sent.values()), 3)
        if complete and got else None,
        burst_notice_to_ack_p50_ms=_r(quantile(per_node, 0.5)),
        burst_notice_to_ack_p99_ms=_r(quantile(per_node, 0.99)),
    )


async def _capacity_phase(args: argparse.Namespace, nc: Client, load: Load, client: AdminClient,
                          pid: int) -> dict:
    """``--burst`` heartbeats as fast as they can be published; events_per_s = events decided and persisted
    (orchd's counter, read through ``orchctl status``'s call: a /metrics scrape of 10,000 nodes' series
    would cost orchd more CPU than the events) / the time until the counter stopped moving."""

    async def events() -> int:
        return (await client.status()).events_decided

    before = await events()
    cpu0 = cpu_s(pid)
    t0 = time.time()
    sent = await _publish_heartbeats(nc, load, args.burst, ev.subject_heartbeat)
    t_pub = time.time() - t0
    last, last_t = before, time.time()
    while True:
        await asyncio.sleep(0.25)
        cur = await events()
        if cur == last and cur - before >= sent * 0.5 and time.time() - last_t >= 1.0:
            break
        if cur != last:
            last, last_t = cur, time.time()
        if time.time() - t0 > 300:
            break
    done = last - before
    cpu = cpu_s(pid) - cpu0
    return dict(
        burst_published=sent,
        burst_publish_s=round(t_pub, 2),
        burst_publish_per_s=round(sent / t_pub, 1),
        events_processed=int(done),
        events_per_s=round(done / (last_t - t0), 1),
        capacity_phase_s=round(last_t - t0, 2),
        daemon_cpu_s=round(cpu, 2),
        daemon_cpu_us_per_event=round(cpu / done * 1e6, 1) if done else None,
        events_per_daemon_cpu_s=round(done / cpu, 1) if cpu else None,
    )


async def _publish_heartbeats(nc: Client, load: Load, n: int, subject: Callable[[str], str]) -> int:
    sent = 0
    while sent < n:
        for nid in load.ids:
            await nc.publish(subject(nid), load.heartbeat(nid))
            sent += 1
            if sent % 5000 == 0:
                await nc.flush()
            if sent >= n:
                break
    await nc.flush()
    return sent


async def _raw_phase(args: argparse.Namespace, nc: Client, load: Load) -> dict:
    """The same heartbeats, published the same way, to a raw nats-py subscriber (``raw_nats.py count``) on
    the same server: its rate, measured like orchd's (received / time from the first publish to the last
    message received)."""
    t0 = time.time()
    sent = await _publish_heartbeats(nc, load, args.burst, lambda nid: f"{raw_nats.RAW_HB}.{nid}.hb")
    last = -1
    seen: dict = {}
    while time.time() - t0 < 300:
        await asyncio.sleep(0.25)
        seen = json.loads((await nc.request(raw_nats.RAW_CTL, b"", timeout=10)).data)
        if seen["count"] == last and seen["count"] >= sent * 0.5:
            break
        last = seen["count"]
    span = seen.get("last_ts", 0.0) - t0
    return dict(raw_received=seen.get("count", 0),
                raw_events_per_s=round(seen["count"] / span, 1) if seen.get("count") and span > 0 else None)


RATIO_KEYS = ("events_per_s", "daemon_cpu_us_per_event", "events_vs_raw", "notice_to_command_p99_ms",
              "notice_p99_over_bus_ms", "burst_acked_s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--job-nodes", type=int, default=8, help="nodes per job")
    p.add_argument("--seconds", type=float, default=20.0, help="latency phase duration")
    p.add_argument("--notice-rate", type=float, default=2.0, help="notices per second in the latency phase")
    p.add_argument("--price-rate", type=float, default=1.0, help="price ticks per second")
    p.add_argument("--burst", type=int, default=200_000, help="heartbeats in the capacity phase (and the raw phase)")
    p.add_argument("--notice-burst", type=int, default=1000,
                   help="nodes noticed within one second after the latency phase (0: no notice burst)")
    p.add_argument("--burst-timeout", type=float, default=60.0, help="longest wait for the notice burst's acks (s)")
    p.add_argument("--orchd-tree", type=Path, default=None,
                   help="run orchd from this source tree (default: this repository)")
    p.add_argument("--baseline-tree", type=Path, default=None,
                   help="also run the whole benchmark with orchd from this tree first (same load generator, "
                        "same machine) and print both, with current/baseline ratios")
    p.add_argument("--log-level", default="warning", help="orchd's log level (its log is in the temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (orchd.log) and print its path")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.baseline_tree is None:
        result = asyncio.run(run(args, args.orchd_tree))
    else:
        baseline = asyncio.run(run(args, args.baseline_tree))
        current = asyncio.run(run(args, args.orchd_tree))
        result = {"baseline": baseline, "current": current, "current_over_baseline": {
            k: round(current[k] / baseline[k], 3) for k in RATIO_KEYS
            if isinstance(current.get(k), (int, float)) and isinstance(baseline.get(k), (int, float)) and baseline[k]}}
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
