"""Shard replicas benchmark: what they cost per step, in memory and on the wire, and what they save.

    python benchmarks/replicas.py --json [--size mini] [--nodes 3] [--ks 1,4] [--blocks 20] [--block 8]
                                         [--no-recovery]

Real gloo ranks of the built-in GPT (one per node, ``LOCAL_WORLD_SIZE=1``), real holder processes, one
run. Figures:

  overhead_k<k>              the step time with replicas every k steps over the step time without, on a
                             shared machine: one generation per k runs ``--blocks`` blocks of ``--block``
                             steps, without and with replicas in turn (benchmarks/replica_blocks.py: the
                             trainer's own step, only the replicator's k switched), and each block with
                             replicas is paired with the blocks on both sides of it; median of those
                             ratios, with p25/p75/min/max and n (goal <= 1.05 on CPU)
  cpu_overhead_k<k>          the same pairing for the CPU time per step: the ranks' (both threads) plus the
                             holders' (all of theirs counted against the steps with replicas)
  replicas_k<k>              step_s_off / step_s_on (median step time), the ranks' CPU per step, the
                             holders' CPU per step with replicas; sent, skipped (due while a copy was still
                             in flight), max_lag_on (the bound the ranks measured, k + 1 when copies keep
                             up), capture_ms (the training thread's copy per replica), send_ms (background)
  holder_k<k>                node 0's holder in units of one shard: at rest (after the last copy was
                             certified), its spare receive buffers at rest (pages given back with
                             MADV_FREE), the most sampled every 50 ms, the most held at once (stored plus
                             puts under way), and its process's peak and at-rest RSS (about 23 MB of
                             which is the empty holder)
  shard_bytes                one replica's tensor region (one rank's model + optimizer shard)
  bytes_per_copy             what one rank sends per replica: to its own holder and to its buddy's
  recovery_s.<path>          next generation's launch -> its first step done, after one node vanished:
                             replica (same world, the lost shard from its buddy over the network),
                             replica_resharded (the survivors alone, resharding the full world's replicas),
                             durable (the same world from the durable checkpoint), and the notice path
                             (emergency checkpoint request -> commit -> exit, then restart from it:
                             notice_save_s + notice_restart_s)
  lost_steps.<path>          steps the next generation runs again (the notice path loses none)
  replica_vs_durable         recovery_s.replica / recovery_s.durable (goal <= 1.0)
  resume_s.<path>            rank 0's ``trainer_start`` line -> its first step done: the restore and one
                             step without the process start all paths share (torch import, process
                             group), which on a loaded CPU host dominates recovery_s;
                             resume_replica_vs_durable = resume_s.replica / resume_s.durable
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrator.core.replicas import complete_steps  # noqa: E402
from trainer import contract  # noqa: E402
from trainer.launch import free_port  # noqa: E402
from trainer.replicas import protocol as p  # noqa: E402
from trainer.replicas.client import HolderClient, start_holder  # noqa: E402

SECRET = "replica-benchmark-secret-0123456789"
JOB = "bench"


@dataclass
class Node:
    name: str
    work: Path
    holder: subprocess.Popen[bytes] | None = None
    addr: str = ""

    def start(self, gen: int) -> Node:
        self.work.mkdir(parents=True, exist_ok=True)
        self.holder, self.addr = start_holder(JOB, SECRET, gen)
        return self

    def agent(self) -> HolderClient:
        return HolderClient(self.addr, JOB, 0, SECRET.encode(), role=p.ROLE_AGENT)

    def rss(self) -> int:
        assert self.holder is not None
        for line in Path(f"/proc/{self.holder.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        if self.holder is not None and self.holder.poll() is None:
            os.killpg(self.holder.pid, signal.SIGKILL)
            self.holder.wait()


@dataclass
class Gen:
    procs: list[subprocess.Popen[str]]
    lines: list[list[str]] = field(default_factory=list)
    times: list[list[float]] = field(default_factory=list)  # when each line arrived (monotonic)
    t0: float = field(default_factory=time.monotonic)

    def resume_s(self) -> float:
        """Rank 0: its ``trainer_start`` line (imports, process group, model built) -> its first step done:
        the restore plus one step, without the process start that every path shares."""
        lines, times = self.lines[0], self.times[0]
        start = next(t for x, t in zip(lines, times, strict=False) if x.startswith("trainer_start"))
        step = next(t for x, t in zip(lines, times, strict=False)
                    if isinstance(contract.parse_report(x), contract.StepReport))
        return step - start

    def steps(self, rank: int = 0) -> list[contract.StepReport]:
        out = (contract.parse_report(x) for x in list(self.lines[rank]))
        return [r for r in out if isinstance(r, contract.StepReport)]

    def max_step(self) -> int:
        return max((r.step for i in range(len(self.procs)) for r in self.steps(i)), default=0)

    def wait_step(self, step: int, timeout: float = 300.0) -> float:
        """Seconds from the launch until some rank reported ``step`` (0: any step)."""
        deadline = time.monotonic() + timeout
        while True:
            got = [r for i in range(len(self.procs)) for r in self.steps(i) if r.step >= step]
            if got:
                return time.monotonic() - self.t0
            if time.monotonic() > deadline or any(x.poll() is not None for x in self.procs):
                raise RuntimeError("generation ended or stalled:\n" + "\n".join(self.lines[0][-30:]))
            time.sleep(0.005)

    def wait(self) -> list[int]:
        return [x.wait(timeout=300) for x in self.procs]

    def kill(self) -> None:
        for x in self.procs:
            if x.poll() is None:
                os.killpg(x.pid, signal.SIGKILL)
        self.wait()


TRAINER = [sys.executable, "-m", "trainer"]
BLOCKS = [sys.executable, str(REPO / "benchmarks" / "replica_blocks.py")]


def launch(nodes: list[Node], gen: int, base: dict[str, str], every: int, replica_step: int = 0,
           argv: list[str] = TRAINER) -> Gen:
    port, ws = free_port(), len(nodes)
    g = Gen([])
    for r, node in enumerate(nodes):
        control = node.work / f"control{gen}"
        control.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **base,
               "RANK": str(r), "WORLD_SIZE": str(ws), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), contract.ENV_GENERATION: str(gen),
               contract.ENV_CONTROL_DIR: str(control), contract.ENV_JOB_ID: JOB}
        if every:
            env.update({p.ENV_HOLDER: node.addr, p.ENV_KEY: p.generation_key(SECRET, gen).hex(),
                        p.ENV_EVERY: str(every)})
            if replica_step:
                env[p.ENV_STEP] = str(replica_step)
        proc = subprocess.Popen(argv, env=env, cwd=REPO, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=1, start_new_session=True)
        lines: list[str] = []
        times: list[float] = []
        threading.Thread(target=_read, args=(proc, lines, times), daemon=True).start()
        g.procs.append(proc)
        g.lines.append(lines)
        g.times.append(times)
    return g


def _read(proc: subprocess.Popen[str], lines: list[str], times: list[float]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        times.append(time.monotonic())
        lines.append(line.rstrip("\n"))


def _env(tmp: Path, args: dict[str, Any], steps: int, ckpt: bool) -> dict[str, str]:
    return {contract.ENV_CKPT_URL: f"file://{tmp / 'ckpt'}" if ckpt else "", contract.ENV_RESUME_FROM: "",
            contract.ENV_TOTAL_STEPS: str(steps), contract.ENV_COLLECTIVE_TIMEOUT_S: "30",
            contract.ENV_TRAINER_ARGS: json.dumps(args)}


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds the processes used so far (/proc/<pid>/stat; 0 for one already gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14 and 15 of stat)
    return total


def _proc_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


class HolderSampler:
    """Node 0's holder during a run: its bytes every 50 ms."""

    def __init__(self, node: Node) -> None:
        self.node, self.stop = node, threading.Event()
        self.samples: list[int] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with self.node.agent() as c:
            while not self.stop.wait(0.05):
                self.samples.append(int(c.stats()["bytes"]))

    def close(self, shard: int) -> dict[str, Any]:
        """In units of one shard (one rank's replica): at rest (the run's last copy certified), the most
        sampled, the most the holder held at once (its replicas plus the puts under way), its peak RSS."""
        self.stop.set()
        self.thread.join()
        with self.node.agent() as c:
            stats = c.stats()
        assert self.node.holder is not None
        return {"at_rest_x_shard": round(stats["bytes"] / shard, 2),
                "spares_at_rest_x_shard": round(stats["spare_bytes"] / shard, 2),
                "max_sampled_x_shard": round(max(self.samples, default=0) / shard, 2),
                "peak_x_shard": round(stats["peak_bytes"] / shard, 2),
                "peak_rss_bytes": _proc_kb(self.node.holder.pid, "VmHWM"),
                "rss_at_rest_bytes": _proc_kb(self.node.holder.pid, "VmRSS")}


def _bench_steps(lines: list[str]) -> dict[int, dict[str, Any]]:
    return {int(x["step"]): x for x in (json.loads(line.split(" ", 1)[1]) for line in lines
                                       if line.startswith("bench_step "))}


def _replica_stats(lines: list[str]) -> dict[str, float]:
    for line in lines:
        if line.startswith("replica_stats "):
            return {k: float(v) for k, v in (x.split("=", 1) for x in line.split()[1:])}
    raise RuntimeError("no replica_stats line:\n" + "\n".join(lines[-20:]))


def _spread(xs: list[float]) -> dict[str, Any]:
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return {"median": round(statistics.median(xs), 4), "p25": round(q[0], 4), "p75": round(q[2], 4),
            "min": round(min(xs), 4), "max": round(max(xs), 4), "n": len(xs)}


def blocks(tmp: Path, a: argparse.Namespace, k: int) -> dict[str, Any]:
    """One generation of ``a.blocks`` blocks of ``a.block`` steps, without and with replicas every k steps in
    turn (benchmarks/replica_blocks.py). Each block with replicas is paired with the blocks without on both
    sides (their mean): its ratio of median step time, and of CPU per step - the ranks' (both threads) plus
    the holders' (all of it counted against the steps with replicas). The first step of every block is left
    out (it carries the previous block's last send or none), and so is the first pair (warm-up)."""
    nodes = [Node(f"n{i}", tmp / f"n{i}").start(1) for i in range(a.nodes)]
    try:
        g = launch(nodes, 1, {**_env(tmp, _args(a), a.blocks * a.block, ckpt=False), "BENCH_BLOCK": str(a.block)},
                   every=k, argv=BLOCKS)
        sampler = HolderSampler(nodes[0])
        holders = [n.holder.pid for n in nodes if n.holder is not None]
        h0 = _cpu_s(holders)
        codes = g.wait()
        h1 = _cpu_s(holders)
        if codes != [0] * a.nodes:
            raise RuntimeError("\n".join(g.lines[0][-30:]))
        stats = _replica_stats(g.lines[0])
        memory = sampler.close(int(stats["region_bytes"]))
    finally:
        for n in nodes:
            n.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    per_rank = [_bench_steps(x) for x in g.lines]
    steps = sorted(set.intersection(*(set(x) for x in per_rank)))
    wall = {s: per_rank[0][s]["wall_s"] for s in steps}
    cpu = {s: sum(x[s]["cpu_s"] for x in per_rank) for s in steps}
    on_steps = [s for s in steps if per_rank[0][s]["on"]]
    holder_per_on_step = (h1 - h0) / max(len(on_steps), 1)
    groups: dict[int, list[int]] = {}
    for s in steps:
        if (s - 1) % a.block:  # not a block's first step
            groups.setdefault((s - 1) // a.block, []).append(s)
    r_wall, r_cpu = [], []
    for b in range(3, a.blocks - 1, 2):  # blocks with replicas (odd), from the second pair on
        if not all(x in groups for x in (b - 1, b, b + 1)):
            continue
        off = [groups[b - 1], groups[b + 1]]
        base_wall = statistics.mean(statistics.median(wall[s] for s in g_) for g_ in off)
        base_cpu = statistics.mean(statistics.mean(cpu[s] for s in g_) for g_ in off)
        r_wall.append(statistics.median(wall[s] for s in groups[b]) / base_wall)
        r_cpu.append((statistics.mean(cpu[s] for s in groups[b]) + holder_per_on_step) / base_cpu)
    lags = [r.replica_lag for r in g.steps(0) if r.step in on_steps and (r.step - 1) % a.block >= 2
            and isinstance(r.replica_lag, int)]
    return {"overhead": _spread(r_wall), "cpu_overhead": _spread(r_cpu),
            "step_s_off": round(statistics.median(wall[s] for s in steps if s not in on_steps), 5),
            "step_s_on": round(statistics.median(wall[s] for s in on_steps), 5),
            "cpu_per_step_s_off": round(statistics.median(cpu[s] for s in steps if s not in on_steps), 5),
            "cpu_per_step_s_on": round(statistics.median(cpu[s] for s in on_steps), 5),
            "holder_cpu_per_step_on_s": round(holder_per_on_step, 5),
            "sent": int(stats["sent"]), "skipped": int(stats["skipped"]), "max_lag_on": max(lags, default=0),
            "capture_ms": round(1e3 * stats["capture_s"] / max(stats["sent"], 1), 3),
            "send_ms": round(1e3 * stats["send_s"] / max(stats["sent"], 1), 3),
            "shard_bytes": int(stats["region_bytes"]), "holder": memory}


def overhead(tmp: Path, a: argparse.Namespace, ks: list[int]) -> dict[str, Any]:
    """The block runs (``blocks``), one per k; the shard and what one copy sends."""
    out: dict[str, Any] = {}
    for k in ks:
        r = blocks(tmp / f"blocks-k{k}", a, k)
        shard = r.pop("shard_bytes")
        out[f"overhead_k{k}"] = r.pop("overhead")
        out[f"cpu_overhead_k{k}"] = r.pop("cpu_overhead")
        out[f"holder_k{k}"] = r.pop("holder")
        out[f"replicas_k{k}"] = r
    copies = 2 if a.nodes > 1 else 1
    out.update({"shard_bytes": shard, "copies_per_replica": copies, "bytes_per_copy": shard * copies})
    return out


def _args(a: argparse.Namespace) -> dict[str, Any]:
    return {"size": a.size, "seq_len": 64, "global_batch": 6 * a.nodes, "micro_batch": 6, "seed": 1}


def _vanish(g: Gen, nodes: list[Node], lost: int) -> int:
    nodes[lost].stop()
    os.killpg(g.procs[lost].pid, signal.SIGKILL)
    g.wait()
    return g.max_step()


def _chosen(members: list[Node], gen: int) -> tuple[int, int]:
    facts = []
    for n in members:
        with n.agent() as c:
            c.set_generation(gen)
            facts += [(n.name, r, s, ws) for (r, s, ws, _g) in c.inventory()]
    complete, why = complete_steps(facts, [n.name for n in members], len(members), not_before=1)
    if not complete:
        raise RuntimeError(f"no complete replica step: {why}")
    return next(iter(complete.items()))


RESUME: dict[str, float] = {}  # path -> Gen.resume_s of its restart


def _restart(nodes: list[Node], gen: int, env: dict[str, str], every: int, step: int = 0,
             path: str = "") -> tuple[float, Gen]:
    g = launch(nodes, gen, {**env, contract.ENV_RESUME_FROM: "latest"}, every, replica_step=step)
    t = g.wait_step(0)
    deadline = time.monotonic() + 60
    while not g.steps(0) and time.monotonic() < deadline:  # rank 0's own first step, for resume_s
        time.sleep(0.005)
    if path:
        RESUME[path] = round(g.resume_s(), 3)
    return t, g


def recovery(tmp: Path, a: argparse.Namespace) -> dict[str, Any]:
    """One node vanishes; the next generation from replicas (same world, resharded) or the durable checkpoint;
    and the notice path for comparison."""
    run = tmp / "rec"
    env = _env(run, {**_args(a), "ckpt_every": a.ckpt_every}, 10_000, ckpt=True)
    nodes = [Node(f"n{i}", run / f"n{i}").start(1) for i in range(a.nodes)]
    out: dict[str, Any] = {"recovery_s": {}, "lost_steps": {}}
    try:
        g = launch(nodes, 1, env, every=1)
        g.wait_step(a.ckpt_every + a.ckpt_every // 2)
        done = _vanish(g, nodes, a.nodes - 1)
        # what a recovery from the durable checkpoint would lose here (the restart below times its load)
        out["lost_steps"]["durable"] = done - max((int(x.name.split("_")[-1]) for x in (run / "ckpt").glob("step_*")),
                                                  default=0)
        nodes.append(Node("new", run / "new").start(2))
        full = [*nodes[:-2], nodes[-1]]  # the survivors and the replacement
        step, _ws = _chosen(full, 2)
        out["recovery_s"]["replica"], g = _restart(full, 2, env, 1, step, "replica")
        out["lost_steps"]["replica"] = done - step
        out["replica_load_s"] = _load_s(g)
        g.wait_step(step + 3)
        done = _vanish(g, full, len(full) - 1)  # the replacement vanishes in its turn
        step, ws = _chosen(nodes[:-2], 3)  # the survivors alone
        out["recovery_s"]["replica_resharded"], g = _restart(nodes[:-2], 3, env, 1, step, "replica_resharded")
        out["lost_steps"]["replica_resharded"] = done - step
        out["replica_resharded_load_s"], out["resharded_from_world_size"] = _load_s(g), ws
        g.kill()
        nodes.append(Node("new2", run / "new2").start(4))
        full = [*nodes[:-3], nodes[-1]]
        out["recovery_s"]["durable"], g = _restart(full, 4, env, 0, path="durable")
        out.update(_notice(g, full, env))
    finally:
        for n in nodes:
            n.stop()
    r = out["recovery_s"]
    r["notice"] = round(out["notice_save_s"] + out["notice_restart_s"], 3)
    out["lost_steps"]["notice"] = 0
    out["replica_vs_durable"] = round(r["replica"] / r["durable"], 3)
    out["replica_resharded_vs_durable"] = round(r["replica_resharded"] / r["durable"], 3)
    out["replica_vs_notice"] = round(r["replica"] / r["notice"], 3)
    out["recovery_s"] = {k: round(v, 3) for k, v in r.items()}
    out["resume_s"] = dict(RESUME)
    out["resume_replica_vs_durable"] = round(RESUME["replica"] / RESUME["durable"], 3)
    return out


def _load_s(g: Gen) -> float:
    for line in g.lines[0]:
        if line.startswith("replica_resumed"):
            return float(line.rsplit("load_s=", 1)[1])
    raise RuntimeError("no replica_resumed line:\n" + "\n".join(g.lines[0][-20:]))


def _notice(g: Gen, nodes: list[Node], env: dict[str, str]) -> dict[str, float]:
    """The notice path on generation ``g``: an emergency checkpoint at one agreed step, every rank exits 75;
    then the next generation from it."""
    g.wait_step(g.max_step() + 2)
    now = time.time()
    req = contract.CheckpointRequest(request_id="bench", reason="preemption_notice", deadline_ts=now + 60,
                                     issued_ts=now)
    t0 = time.monotonic()
    for node, proc in zip(nodes, g.procs, strict=True):
        contract.write_checkpoint_request(str(node.work / "control4"), req)
        proc.send_signal(signal.SIGUSR1)
    codes = g.wait()
    save_s = time.monotonic() - t0
    if codes != [contract.EXIT_PREEMPTED] * len(nodes):
        raise RuntimeError(f"notice path exits {codes}:\n" + "\n".join(g.lines[0][-20:]))
    restart_s, g2 = _restart(nodes, 5, env, 0, path="notice_restart")
    g2.kill()
    return {"notice_save_s": round(save_s, 3), "notice_restart_s": round(restart_s, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--size", default="mini")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--ks", default="1,4")
    ap.add_argument("--blocks", type=int, default=20, help="blocks of steps, without and with replicas in turn")
    ap.add_argument("--block", type=int, default=8, help="steps per block")
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--no-recovery", action="store_true", help="the overhead and memory only")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="orch-replicas-bench-"))
    t0 = time.monotonic()
    try:
        out = {"size": a.size, "nodes": a.nodes, "blocks": a.blocks, "block": a.block, "cpus": os.cpu_count(),
               "load_avg_1m": round(os.getloadavg()[0], 2)}
        out.update(overhead(tmp, a, [int(k) for k in a.ks.split(",")]))
        if not a.no_recovery:
            out.update(recovery(tmp, a))
        out["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
        out["wall_s"] = round(time.monotonic() - t0, 1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(out) if a.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
