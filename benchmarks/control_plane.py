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
     simulated agent of the noticed node;
  4. capacity phase: the same nodes heartbeat as fast as the publisher can, for --burst heartbeats;
     events_per_s = events that went through decide() AND whose batch was persisted (orchd's
     orchd_events_total, counted after persist) / the time it took to process them.

Output keys: offered_events_per_s (latency phase), events_per_s (capacity phase), latency_events_per_s
(processed during the latency phase), notice_to_command_p50/p99/max_ms, notices, samples, and the setup;
and orchd's own view of the latency phase from its histograms (upper bucket bounds of p50/p99):
daemon_notice_to_command_sent, daemon_event_lag (JetStream publish -> decide: delivery and queueing),
daemon_batch_decide and daemon_batch_persist (per batch).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec
import nats

import wire as ev
from orchestrator.cli.client import AdminClient
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
    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("orchd_events_total{"))


def price_tick(pool: ev.PoolKey, i: int) -> ev.PriceTick:
    od = 4.0
    spot = od * (0.30 + 0.02 * ((i + hash(pool.name)) % 5)) if pool.market is ev.Market.SPOT else od
    return ev.PriceTick(id=f"bp-{pool.name}-{i}", pool=pool, gpu_type="A100", gpus_per_node=8,
                        price_usd_h=spot, on_demand_usd_h=od, ts=time.time())


async def run(args: argparse.Namespace) -> dict:
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
    with open(tmp / "orchd.log", "w") as orchd_log:  # the daemon keeps its own copy of the descriptor
        daemon = subprocess.Popen([sys.executable, *prof, "-m", "orchestrator.daemon", "--config", str(cfg)],
                                  stdout=subprocess.DEVNULL, stderr=orchd_log, cwd=Path(__file__).resolve().parents[1])
    nc = await nats.connect(server.url, pending_size=256 * 1024 * 1024)
    js = nc.jetstream()
    result: dict = {"nodes": args.nodes, "job_nodes": args.job_nodes}
    try:
        disc = tmp / "state" / "orchd.json"
        for _ in range(300):
            if disc.exists():
                break
            await asyncio.sleep(0.1)
        metrics_url = json.loads(disc.read_text())["metrics_url"]
        client = await AdminClient.connect([server.url], timeout_s=30)

        # --- simulated agents: ack every command, remember each node's generation ----------------
        gen: dict[str, tuple[ev.JobId | None, int]] = {}
        ckpt_arrival: dict[str, float] = {}

        async def on_cmd(msg) -> None:
            cmd = ev.decode(msg.data, ev.AgentCommand)
            if isinstance(cmd, ev.StartGenerationCmd):
                gen[cmd.node_id] = (cmd.job_id, cmd.generation)
            elif isinstance(cmd, ev.CheckpointCmd):
                ckpt_arrival.setdefault(cmd.node_id, time.time())
            if msg.reply:
                await nc.publish(msg.reply, ev.encode(ev.CommandAck(cmd_id=cmd.cmd_id, node_id=cmd.node_id, ok=True,
                                                                    ts=time.time())))

        await nc.subscribe("orch.cmd.>", cb=on_cmd, pending_msgs_limit=1_000_000)

        # --- setup: prices, jobs, launches, registrations ----------------------------------------
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
        sem = asyncio.Semaphore(64)

        async def submit(i: int) -> None:
            async with sem:
                own = msgspec.structs.replace(spec.checkpoint, url=f"file:///tmp/bench-ckpt/{i:05d}")  # one root a job
                await client.submit(msgspec.structs.replace(spec, checkpoint=own), job_id=f"bench-{i:05d}")

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
        while len(gen) < len(nodes) * 0.95 and time.time() - t0 < 180:
            await asyncio.sleep(0.5)
        log(f"{len(gen)} nodes told to start a generation in {time.time() - t0:.1f}s")
        result["nodes_running"] = len(gen)

        seq = {nid: 0 for nid, _ in nodes}

        def heartbeat(nid: ev.NodeId) -> bytes:
            seq[nid] += 1
            job_id, g = gen.get(nid, (None, 0))
            hb = ev.Heartbeat(node_id=nid, seq=seq[nid], ts=time.time(),
                              state=ev.AgentState.TRAINING if g else ev.AgentState.IDLE,
                              job_id=job_id, generation=g, step=seq[nid], loss=2.0, tokens_per_s=1e5,
                              step_time_s=1.0, fencing_token=0)
            return ev.encode(hb)

        # --- latency phase: the stated load -----------------------------------------------------
        ids = [nid for nid, _ in nodes]
        noticed: dict[str, float] = {}
        offered = 0
        start_events = events_total(metrics_url)
        hist0 = {k: histogram_buckets(metrics_url, *v) for k, v in DAEMON_HISTOGRAMS.items()}
        lat_cpu0 = cpu_s(daemon.pid)
        t_start = time.time()
        notice_targets = iter(ids[:: args.job_nodes])  # one node of each job
        price_i = 1
        tick = 0.05  # send in 20 slices per second
        next_notice = t_start + 2.0
        while time.time() - t_start < args.seconds:
            slice_t0 = time.time()
            k = int(len(ids) * tick)
            base = int((slice_t0 - t_start) / tick) * k
            for j in range(k):
                nid = ids[(base + j) % len(ids)]
                await nc.publish(ev.subject_heartbeat(nid), heartbeat(nid))
            offered += k
            if int((slice_t0 - t_start) * args.price_rate) >= price_i:
                pool = POOLS[price_i % len(POOLS)]
                await js.publish_async(ev.subject_price("fake", "r1"), ev.encode(price_tick(pool, price_i)),
                                       headers={"Nats-Msg-Id": f"bp-{pool.name}-{price_i}"})
                price_i += 1
                offered += 1
            if slice_t0 >= next_notice:
                target = next(notice_targets, None)
                if target is not None:
                    n = ev.PreemptionNotice(id=f"bn-{target}", node_id=target, cloud="fake",
                                            deadline_ts=time.time() + 120, observed_ts=time.time())
                    noticed[target] = time.time()
                    await js.publish_async(ev.subject_notice("fake", target), ev.encode(n),
                                           headers={"Nats-Msg-Id": n.id})
                    offered += 1
                next_notice += 1.0 / args.notice_rate
            await nc.flush()
            await asyncio.sleep(max(0.0, tick - (time.time() - slice_t0)))
        elapsed = time.time() - t_start
        await asyncio.sleep(2.0)
        processed = events_total(metrics_url) - start_events
        lat = sorted((ckpt_arrival[n] - t) * 1000 for n, t in noticed.items() if n in ckpt_arrival)
        result.update(
            latency_phase_daemon_cpu_ratio=round((cpu_s(daemon.pid) - lat_cpu0) / (elapsed + 2.0), 2),
            offered_events_per_s=round(offered / elapsed, 1),
            latency_phase_s=round(elapsed, 1),
            latency_events_per_s=round(processed / (elapsed + 2.0), 1),
            notices=len(noticed),
            samples=len(lat),
            notice_to_command_p50_ms=round(statistics.median(lat), 2) if lat else None,
            notice_to_command_p99_ms=round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2) if lat else None,
            notice_to_command_max_ms=round(lat[-1], 2) if lat else None,
            notice_to_command_all_ms=[round(x, 1) for x in lat],
            **{k: histogram_quantiles(histogram_buckets(metrics_url, *v), hist0[k])
               for k, v in DAEMON_HISTOGRAMS.items()},
        )
        log(f"latency phase: {result}")

        # --- capacity phase: heartbeats as fast as they can be published --------------------------
        await asyncio.sleep(1.0)
        before = events_total(metrics_url)
        cpu0 = cpu_s(daemon.pid)
        t0 = time.time()
        sent = 0
        while sent < args.burst:
            for nid in ids:
                await nc.publish(ev.subject_heartbeat(nid), heartbeat(nid))
                sent += 1
                if sent % 5000 == 0:
                    await nc.flush()
                if sent >= args.burst:
                    break
        await nc.flush()
        t_pub = time.time() - t0
        last, last_t = before, time.time()
        while True:
            await asyncio.sleep(0.5)
            cur = events_total(metrics_url)
            if cur == last and cur - before >= sent * 0.5:
                break
            if cur != last:
                last, last_t = cur, time.time()
            if time.time() - t0 > 300:
                break
        done = last - before
        cpu = cpu_s(daemon.pid) - cpu0
        result.update(
            burst_published=sent,
            burst_publish_s=round(t_pub, 2),
            burst_publish_per_s=round(sent / t_pub, 1),
            events_processed=int(done),
            events_per_s=round(done / (last_t - t0), 1),
            capacity_phase_s=round(last_t - t0, 2),
            daemon_cpu_s=round(cpu, 2),
            daemon_cpu_us_per_event=round(cpu / done * 1e6, 1) if done else None,
            events_per_daemon_cpu_s=round(done / cpu, 1) if cpu else None,
            load_average=os.getloadavg()[0],
        )
        log(f"capacity phase: processed {done:.0f} of {sent} in {last_t - t0:.1f}s")
        await client.close()
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
        result["daemon_exit"] = daemon.returncode
        await nc.close()
        server.stop()
        if args.keep:
            result["tmp_dir"] = str(tmp)
        else:
            server.cleanup()
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    result["cpu_count"] = os.cpu_count()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--job-nodes", type=int, default=8, help="nodes per job")
    p.add_argument("--seconds", type=float, default=20.0, help="latency phase duration")
    p.add_argument("--notice-rate", type=float, default=2.0, help="notices per second in the latency phase")
    p.add_argument("--price-rate", type=float, default=1.0, help="price ticks per second")
    p.add_argument("--burst", type=int, default=200_000, help="heartbeats in the capacity phase")
    p.add_argument("--log-level", default="warning", help="orchd's log level (its log is in the temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (orchd.log) and print its path")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
