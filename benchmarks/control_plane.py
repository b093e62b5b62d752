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
  4. capacity phase, in steady state: the load stops, and once orchd has drained what the latency
     phase left (``drained``: both consumers empty, no command in flight, the event counter still for
     1 s; ``steady_drain_s``, ``steady_drained``) the same nodes heartbeat as fast as the publisher can,
     for --burst heartbeats; events_per_s = events that went through decide() AND whose batch was
     persisted (orchd's counter, counted after persist) / the time it took to process them: orchd's
     sustainable event rate, the figure ``events_vs_raw`` is about;
  5. notice burst (--notice-burst N, under the same heartbeat load, restarted): N nodes noticed within
     one second, taken zone by zone and job by job (a zone going away); ``burst_acked_s`` = first
     notice's publish to the last checkpoint command of those jobs acked by its agent;
  6. the burst's aftermath: right after the burst, the capacity phase again (``aftermath_*`` keys,
     ``aftermath_vs_raw``). It measures orchd while it still handles the burst's consequences
     (replacement launches, new generations; the file-backed fake cloud runs in orchd's own process and
     appends a journal line per call);
  7. raw phase: the same heartbeats, published the same way, to a raw nats-py subscriber that only counts
     (``benchmarks/raw_nats.py count``, a process of its own, same server): ``raw_events_per_s``.

Output keys: offered_events_per_s (latency phase), events_per_s (steady capacity phase), latency_events_per_s
(processed during the latency phase), notice_to_command_p50/p99/max_ms, notices, samples, and the setup;
the anchors measured in the same run: bus_p50/p99_ms (bus_samples) and ``notice_p99_over_bus_ms``
(notice_to_command_p99_ms - bus_p99_ms), raw_events_per_s and ``events_vs_raw`` (events_per_s over it),
raw_cpu_us_per_event and ``cpu_vs_raw`` (the raw subscriber's CPU per message over orchd's CPU per event
in the capacity phase: the rate ratio each would reach on a core of its own; on a shared machine the two
rates are taken at different moments, under different load),
``burst_acked_s`` (with burst_acked_after_last_notice_s, burst_jobs, burst_checkpoint_cmds_acked,
burst_noticed_nodes_acked, per-node burst_notice_to_ack_p50/p99_ms); and orchd's own view of the
latency phase (and, prefixed ``burst_``, of the notice burst) from its histograms (upper bucket bounds
of p50/p99): daemon_notice_to_command_sent,
daemon_event_lag (JetStream publish -> decide: delivery and queueing), daemon_batch_decide and
daemon_batch_persist (per batch). With few samples a p99 is the maximum.

``--baseline-tree DIR`` runs the whole benchmark twice, orchd from DIR first and then from this tree
(or ``--orchd-tree``), and prints both with ``current_over_baseline`` ratios: before/after figures
taken in one run, under the same load. The phases, the simulated agents and the load are in
``benchmarks/control_plane_phases.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec
import nats
import raw_nats  # benchmarks/raw_nats.py, beside this script
from control_plane_phases import (
    DAEMON_HISTOGRAMS,
    POOLS,
    PROBE_STREAM,
    REPO,
    Agents,
    Load,
    capacity_phase,
    drained,
    histogram_buckets,
    histogram_quantiles,
    latency_phase,
    log,
    notice_burst,
    price_tick,
    raw_phase,
    raw_process,
    rounded,
    stop_process,
)
from nats.aio.client import Client
from nats.js import JetStreamContext

import wire as ev
from orchestrator import bus
from orchestrator.cli.client import AdminClient, AdminUnreachable
from orchestrator.jobspec import parse_jobspec
from orchestrator.natsserver import NatsServer
from simulations.fakecloud import read_fake_file


def _orchd_config(nats_url: str, tmp: Path, fake_file: Path, log_level: str) -> str:
    """orchd's settings for a run: this server, a state dir and the file-backed fake cloud in ``tmp``."""
    return f"""
[nats]
urls = ["{nats_url}"]
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
level = "{log_level}"
format = "json"
[providers]
enabled = ["fake"]
[providers.fake]
state_file = "{fake_file}"
gpus_per_node = 8
"""


async def run(args: argparse.Namespace, tree: Path | None = None) -> dict:
    """One whole run against orchd from ``tree`` (default: this repository)."""
    root = (tree or REPO).resolve()
    tmp = Path(tempfile.mkdtemp(prefix="orch-bench-"))
    server = NatsServer(tmp / "nats").start()
    fake_file = tmp / "fake.json"
    cfg = tmp / "orchd.toml"
    cfg.write_text(_orchd_config(server.url, tmp, fake_file, args.log_level))
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
        probe = await raw_process("probe", server.url, PROBE_STREAM)
        counter = await raw_process("count", server.url)
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
            result.update(await latency_phase(args, nc, js, agents, load, metrics_url, daemon.pid))
            log(f"latency phase: { {k: v for k, v in result.items() if not k.endswith('_all_ms')} }")
        finally:
            stop_load.set()
            await load_task
        # steady state: the capacity phase starts once orchd has drained what the latency phase left
        result.update({f"steady_{k}": v for k, v in (await drained(js, client, args.drain_timeout)).items()})
        result.update(await capacity_phase(args, nc, load, client, daemon.pid))
        log(f"capacity phase (steady): processed {result['events_processed']} of {result['burst_published']} "
            f"in {result['capacity_phase_s']}s")
        if args.notice_burst > 0:
            result.update(await _burst_and_aftermath(args, nc, js, client, agents, load, nodes, metrics_url,
                                                     daemon.pid, result["noticed_jobs"]))
        result.pop("noticed_jobs")
        await asyncio.sleep(1.0)
        result.update(await raw_phase(args, nc, load, counter.pid))
        _ratios(result)
        result["load_average"] = os.getloadavg()[0]
        await client.close()
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
        result["daemon_exit"] = daemon.returncode
        stop_process(probe)
        stop_process(counter)
        await nc.close()
        server.stop()
        if args.keep:
            result["tmp_dir"] = str(tmp)
        else:
            server.cleanup()
            shutil.rmtree(tmp, ignore_errors=True)
    result["cpu_count"] = os.cpu_count()
    return result


async def _burst_and_aftermath(args: argparse.Namespace, nc: Client, js: JetStreamContext, client: AdminClient,
                               agents: Agents, load: Load, nodes: list[tuple[ev.NodeId, Any]], metrics_url: str,
                               pid: int, noticed_jobs: set[str]) -> dict:
    """The notice burst under the heartbeat load (once orchd has drained), then the capacity phase again
    right after it (``aftermath_*``)."""
    result: dict = {}
    # (a scrape of /metrics costs orchd CPU at 10,000 nodes, benchmarks/gauge_refresh.py: taken before the drain)
    hist0 = {k: histogram_buckets(metrics_url, *v) for k, v in DAEMON_HISTOGRAMS.items()}
    result.update({f"burst_{k}": v for k, v in (await drained(js, client, args.drain_timeout)).items()})
    stop_load = asyncio.Event()
    load_task = asyncio.create_task(load.run(stop_load))
    try:
        result.update(await notice_burst(args, js, agents, nodes, noticed_jobs))
        result.update({f"burst_{k}": histogram_quantiles(histogram_buckets(metrics_url, *v), hist0[k])
                       for k, v in DAEMON_HISTOGRAMS.items()})
        log(f"notice burst: { {k: v for k, v in result.items() if 'burst' in k} }")
    finally:
        stop_load.set()
        await load_task
    # the burst's aftermath, right away (orchd still handling the burst's consequences)
    after = await capacity_phase(args, nc, load, client, pid)
    result.update({f"aftermath_{k}": v for k, v in after.items()})
    log(f"capacity phase (aftermath): {after}")
    return result


def _ratios(result: dict) -> None:
    """``events_vs_raw`` (and ``aftermath_vs_raw``) from the rates, ``cpu_vs_raw`` from CPU time: each on
    a core of its own (the rates follow the machine's load at the moment each was taken)."""
    raw = result["raw_events_per_s"]
    result["events_vs_raw"] = rounded(result["events_per_s"] / raw, 3) if raw else None
    raw_cpu, cpu = result["raw_cpu_us_per_event"], result["daemon_cpu_us_per_event"]
    result["cpu_vs_raw"] = rounded(raw_cpu / cpu, 3) if raw_cpu and cpu else None
    if "aftermath_events_per_s" in result:
        result["aftermath_vs_raw"] = rounded(result["aftermath_events_per_s"] / raw, 3) if raw else None


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


RATIO_KEYS = ("events_per_s", "daemon_cpu_us_per_event", "events_vs_raw", "cpu_vs_raw", "notice_to_command_p99_ms",
              "notice_p99_over_bus_ms", "burst_acked_s", "aftermath_events_per_s",
              "aftermath_daemon_cpu_us_per_event", "aftermath_vs_raw")


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
    p.add_argument("--drain-timeout", type=float, default=10.0,
                   help="longest wait for orchd to drain before the steady capacity phase (s; below the "
                        "15 s heartbeat timeout of the benchmark's orchd)")
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
