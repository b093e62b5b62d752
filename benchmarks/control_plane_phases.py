"""The parts of ``benchmarks/control_plane.py``: the simulated agents and load, the phases of a run, and
the helpers that read orchd's figures (its /metrics, its CPU time). See that script for what each phase
measures; this module only holds them so that each file stays short.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import raw_nats  # benchmarks/raw_nats.py, beside this script
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

import wire as ev
from orchestrator import bus
from orchestrator.cli.client import AdminClient

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


def rounded(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


async def raw_process(role: str, *args: str) -> subprocess.Popen[bytes]:
    """A ``benchmarks/raw_nats.py`` process, once it printed ``ready``."""
    proc = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "raw_nats.py"), role, *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line = await asyncio.to_thread(proc.stdout.readline)
    if line.strip() != b"ready":
        raise RuntimeError(f"raw_nats.py {role} did not start: {line!r}")
    return proc


def stop_process(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def latency_phase(args: argparse.Namespace, nc: Client, js: JetStreamContext,
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
        notice_to_command_p50_ms=rounded(quantile(lat, 0.5)),
        notice_to_command_p99_ms=rounded(p99),
        notice_to_command_max_ms=rounded(max(lat, default=None)),
        notice_to_command_all_ms=[round(x, 1) for x in sorted(lat)],
        bus_samples=len(bus_lat),
        bus_p50_ms=rounded(quantile(bus_lat, 0.5)),
        bus_p99_ms=rounded(bus_p99),
        bus_all_ms=[round(x, 1) for x in sorted(bus_lat)],
        notice_p99_over_bus_ms=rounded(p99 - bus_p99) if p99 is not None and bus_p99 is not None else None,
        noticed_jobs={j for j in job_of.values() if j is not None},
        **{k: histogram_quantiles(histogram_buckets(metrics_url, *v), hist0[k]) for k, v in DAEMON_HISTOGRAMS.items()},
    )


async def notice_burst(args: argparse.Namespace, js: JetStreamContext, agents: Agents,
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
        burst_notice_to_ack_p50_ms=rounded(quantile(per_node, 0.5)),
        burst_notice_to_ack_p99_ms=rounded(quantile(per_node, 0.99)),
    )


async def drained(js: JetStreamContext, client: AdminClient, timeout_s: float) -> dict:
    """Wait (with no load offered) until orchd is idle: both JetStream consumers have nothing pending or
    unacked, no command is in flight and ``events_decided`` has not moved for 1 s. Returns the wait
    (``drain_s``) and whether it was reached (``drained``) within ``timeout_s``."""
    t0 = time.time()
    last, still_since = -1, time.time()
    while True:
        st = await client.status()
        busy = st.commands_in_flight > 0
        for stream, consumer in ((bus.STREAM_EVENTS, bus.CONSUMER_EVENTS), (bus.STREAM_MARKET, bus.CONSUMER_MARKET)):
            info = await js.consumer_info(stream, consumer)
            busy = busy or bool(info.num_pending) or bool(info.num_ack_pending)
        if st.events_decided != last or busy:
            last, still_since = st.events_decided, time.time()
        elif time.time() - still_since >= 1.0:
            return {"drain_s": round(time.time() - t0, 2), "drained": True}
        if time.time() - t0 > timeout_s:
            return {"drain_s": round(time.time() - t0, 2), "drained": False}
        await asyncio.sleep(0.1)


async def capacity_phase(args: argparse.Namespace, nc: Client, load: Load, client: AdminClient,
                          pid: int) -> dict:
    """``--burst`` heartbeats as fast as they can be published; events_per_s = events decided and persisted
    (orchd's counter, read through ``orchctl status``'s call: a /metrics scrape of 10,000 nodes' series
    would cost orchd more CPU than the events) / the time until the counter stopped moving."""

    async def events() -> int:
        return (await client.status()).events_decided

    before = await events()
    cpu0 = cpu_s(pid)
    t0 = time.time()
    sent = await publish_heartbeats(nc, load, args.burst, ev.subject_heartbeat)
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


async def publish_heartbeats(nc: Client, load: Load, n: int, subject: Callable[[str], str]) -> int:
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


async def raw_phase(args: argparse.Namespace, nc: Client, load: Load, pid: int) -> dict:
    """The same heartbeats, published the same way, to a raw nats-py subscriber (``raw_nats.py count``,
    process ``pid``) on the same server: its rate, measured like orchd's (received / time from the first
    publish to the last message received), and its CPU per message."""
    cpu0 = cpu_s(pid)
    t0 = time.time()
    sent = await publish_heartbeats(nc, load, args.burst, lambda nid: f"{raw_nats.RAW_HB}.{nid}.hb")
    last = -1
    seen: dict = {}
    while time.time() - t0 < 300:
        await asyncio.sleep(0.25)
        seen = json.loads((await nc.request(raw_nats.RAW_CTL, b"", timeout=10)).data)
        if seen["count"] == last and seen["count"] >= sent * 0.5:
            break
        last = seen["count"]
    span = seen.get("last_ts", 0.0) - t0
    n = seen.get("count", 0)
    return dict(raw_received=n, raw_events_per_s=round(n / span, 1) if n and span > 0 else None,
                raw_cpu_us_per_event=round((cpu_s(pid) - cpu0) / n * 1e6, 1) if n else None)
