"""The partition drills' session and scoring: the drill record, what the agents and the cloud recorded,
orchd's audit and metrics as an operator reads them, and the split-brain count.

Role: everything here reads observations (the agents' ``records.jsonl``, the fake cloud's call log,
``orchctl explain`` entries, ``/metrics`` scraped over the bridge); the faults are in ``partdrills``.
Concurrency contract: async helpers run on the driver's loop; blocking reads are quick file reads.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from simulations.chaos import common
from simulations.chaos.nsworld import World, instances_of, job_spec

TERMINAL = ("succeeded", "failed", "cancelled", "stopped")
ZERO = ("lost_jobs", "duplicate_launches", "split_brain_actions", "needless_recoveries", "lost_events",
        "two_generations", "commits_from_given_up", "late_commands", "daemon_crashes")
NOTICE_S = 30.0
"""The notice of the drills: GCP's and Azure's (about 30 s); AWS gives 2 minutes."""


@dataclass
class Drill:
    """One drill's outcome: the figures (goal 0 each, ``ZERO``), what it measured (``facts``) and each
    assertion that failed (``problems``)."""

    name: str
    job_id: str = ""
    lost_jobs: int = 0
    duplicate_launches: int = 0
    split_brain_actions: int = 0
    needless_recoveries: int = 0
    lost_events: int = 0
    two_generations: int = 0
    commits_from_given_up: int = 0
    late_commands: int = 0  # checkpoint commands that missed the notice deadline
    daemon_crashes: int = 0
    facts: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.problems and all(getattr(self, k) == 0 for k in ZERO)


# --- scoring helpers --------------------------------------------------------------------------------


def records_of(records: list[dict[str, Any]], kind: str, typ: str, job: str | None = None,
               since: float = 0.0) -> list[dict[str, Any]]:
    """The agents' records of one kind (``cmd`` | ``event``) and message type, of ``job``, from ``since``."""
    return [r for r in records if r["kind"] == kind and r["msg"].get("type") == typ and r["t"] >= since
            and (job is None or r["msg"].get("job_id") == job)]


def two_generations(records: list[dict[str, Any]], job: str) -> int:
    """Pairs of (host, generation) training intervals of one job that overlap with different generations:
    two generations training at once (from the agents' own events, never orchd's view)."""
    spans: dict[tuple[str, int], list[float]] = {}
    for r in records:
        m = r["msg"]
        if r["kind"] != "event" or m.get("job_id") != job:
            continue
        key = (r["host"], m["generation"])
        if m["type"] == "generation_started":
            spans[key] = [r["t"], float("inf")]
        elif m["type"] in ("ranks_exited", "vm_gone") and key in spans:
            spans[key][1] = min(spans[key][1], r["t"])
    items = sorted(spans.items())
    n = 0
    for i, ((h1, g1), (a1, b1)) in enumerate(items):
        for (h2, g2), (a2, b2) in items[i + 1:]:
            if g1 != g2 and h1 != h2 and max(a1, a2) < min(b1, b2):
                n += 1
    return n


def recoveries(records: list[dict[str, Any]], job: str, since: float, generation: int) -> list[str]:
    """What a recovery sends an agent of ``job`` after ``since``: abandon, checkpoint, a newer generation."""
    out = [f"abandon g{r['msg']['generation']}" for r in records_of(records, "cmd", "abandon_generation", job, since)]
    out += [f"checkpoint g{r['msg']['generation']}" for r in records_of(records, "cmd", "checkpoint", job, since)]
    out += [f"start g{r['msg']['generation']}" for r in records_of(records, "cmd", "start_generation", job, since)
            if r["msg"]["generation"] > generation]
    return out


def duplicate_commands(records: list[dict[str, Any]]) -> int:
    """Commands executed twice: distinct cmd_ids of one kind for one (node, job, generation)."""
    seen: dict[tuple[str, str, str, int], set[str]] = {}
    for r in records:
        if r["kind"] != "cmd":
            continue
        m = r["msg"]
        key = (m["node_id"], m["type"], m.get("job_id") or "", m.get("generation") or 0)
        seen.setdefault(key, set()).add(m["cmd_id"])
    return sum(len(v) - 1 for v in seen.values())


# --- the session --------------------------------------------------------------------------------


class Session:
    """The running world, an admin client (as orchctl's) and the seed, shared by the drills of a run."""

    def __init__(self, world: World, seed: int, client: Any) -> None:
        self.w, self.client = world, client
        self.t = world.t
        self.seed = seed

    def rng(self, d: Drill) -> random.Random:
        """The drill's own seeded choices (drills of one group run at once: no shared sequence)."""
        return random.Random(f"{self.seed}-{d.name}")

    async def submit(self, job_id: str, *, nodes: int, total_steps: int) -> None:
        await common.call(self.client, "submit", job_spec(job_id, nodes=nodes, total_steps=total_steps,
                                                          root=self.w.ckpt_root),
                          job_id=job_id, retry_s=60)

    async def training(self, job_id: str, nodes: int, timeout_s: float = 90) -> int:
        """Wait until ``nodes`` agents have trained ``job_id``'s newest generation for 1 s; its number."""
        with anyio.fail_after(timeout_s):
            while True:
                recs = self.w.records()
                started = records_of(recs, "event", "generation_started", job_id)
                if started:
                    g = max(r["msg"]["generation"] for r in started)
                    hosts = {r["host"] for r in started if r["msg"]["generation"] == g}
                    if len(hosts) >= nodes and time.time() - max(r["t"] for r in started) > 1.0:
                        return g
                await anyio.sleep(0.1)

    async def leader(self, timeout_s: float = 30.0) -> tuple[str, int] | None:
        """The leading orchd and its token, waiting up to ``timeout_s`` for one (after a failover)."""
        with anyio.move_on_after(timeout_s):
            while (lead := await self.w.leader()) is None:
                await anyio.sleep(0.2)
            return lead
        return None

    async def job(self, job_id: str) -> dict[str, Any] | None:
        try:
            return (await self.client.job(job_id)).summary
        except Exception:
            return None

    async def finish(self, job_id: str, timeout_s: float) -> dict[str, Any] | None:
        """The job's summary once terminal (None: not terminal within ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            s = await self.job(job_id)
            if s is not None and s.get("phase") in TERMINAL:
                return s
            await anyio.sleep(0.3)
        return None

    async def explain(self, job_id: str) -> list[dict[str, Any]]:
        try:
            return (await common.call(self.client, "explain", job_id, retry_s=20)).entries
        except Exception:
            return []

    async def end_job(self, d: Drill, job_id: str, nodes: int, timeout_s: float = 90) -> dict[str, Any] | None:
        s = await self.finish(job_id, timeout_s)
        if s is None:
            d.lost_jobs += 1
            d.problems.append(f"{job_id} not finished in {timeout_s} s: {await self.job(job_id)}")
        elif s["phase"] != "succeeded":
            d.lost_jobs += 1
            d.problems.append(f"{job_id} {s['phase']} ({s.get('reason')})")
        recs = self.w.records()
        d.two_generations += two_generations(recs, job_id)
        by_node: dict[str, list[Any]] = {}
        for inst in instances_of(self.w.fake_file, job_id):  # counted on the cloud side: one instance a node id
            by_node.setdefault(str(inst.node_id), []).append(inst)
        d.duplicate_launches += sum(len(v) - 1 for v in by_node.values())
        late = given_up_commits(self.w.ckpt_root / job_id, recs, await self.explain(job_id), job_id)
        d.commits_from_given_up += len(late)
        if late:
            d.problems.append(f"{job_id} went on from checkpoints written by nodes orchd had given up on: {late}")
        return s


def store_writes(root: Path) -> list[dict[str, Any]]:
    """Every checkpoint save in a job's root, as the trainer (``parttrainer``) recorded it in the checkpoint
    itself: ``{"step", "rank", "generation", "node_id", "t", "url"}`` (the url is the checkpoint's)."""
    out = []
    for f in sorted(root.glob("step_*/rank*.json")):
        with contextlib.suppress(OSError, ValueError):
            out.append({**json.loads(f.read_text()), "url": f"file://{f.parent}"})
    return out


def given_up_commits(root: Path, records: list[dict[str, Any]], entries: list[dict[str, Any]], job: str) -> list[str]:
    """Checkpoints orchd accepted as committed (its audit) or the job resumed from (a generation's
    ``resume_from``) that hold a save by a node after orchd removed that node as lost: read from the
    checkpoint store, not from what any node reported."""
    lost = {(e.get("details") or {}).get("node_id"): e.get("ts", 0.0) for e in audit(entries, "remove_node")
            if (e.get("details") or {}).get("lost")}
    used = {r["msg"].get("resume_from") for r in records_of(records, "cmd", "start_generation", job)}
    used |= {(e.get("details") or {}).get("url") for e in audit(entries, "checkpoint_committed")}
    return sorted({w["url"] for w in store_writes(root)
                   if w.get("node_id") in lost and w.get("t", 0.0) > lost[w["node_id"]] and w["url"] in used})


async def sample(s: Session, orchd: str | None, metric: str, label: str, seconds: float) -> list[float]:
    """``metric`` series holding ``label`` on ``orchd``'s /metrics, every 0.5 s for ``seconds``."""
    out: list[float] = []
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        m = await anyio.to_thread.run_sync(s.w.scrape, orchd) if orchd else None
        out += [v for k, v in (m or {}).items() if (k == metric or k.startswith(metric + "{")) and label in k]
        await anyio.sleep(0.5)
    return out


def metric_sum(m: dict[str, float] | None, metric: str, label: str = "") -> float | None:
    """The sum of ``metric``'s series holding ``label`` in one scrape (None: not scraped)."""
    if m is None:
        return None
    return sum(v for k, v in m.items() if (k == metric or k.startswith(metric + "{")) and label in k)


def checked(w: World, host: str, since: float) -> bool:
    """orchd asked the provider about the instance of the agent on ``host`` after ``since``."""
    inst = next((i for i, h in w.agents.items() if h == host), None)
    return any(c["op"] == "describe" and inst in c["ids"] and c["ts"] >= since for c in w.cloud_calls())


def audit(entries: list[dict[str, Any]], action: str, node: str | None = None) -> list[dict[str, Any]]:
    """orchd's decision audit (``orchctl explain``) entries of one action, for one node if given."""
    return [e for e in entries if e.get("action") == action
            and (node is None or (e.get("details") or {}).get("node_id") == node)]


def metrics_seen(m: dict[str, float] | None) -> dict[str, float] | str:
    """What Prometheus would see of one orchd: its leadership gauges, or that it cannot be scraped."""
    if m is None:
        return "unreachable"
    return {k: v for k, v in m.items() if k in ("orchd_up", "orchd_lease_revision", "orchd_nats_connected")}


def split_brain(s: Session, d: Drill, old_pid: int, old_token: int, t_fault: float) -> None:
    """Count what a leader cut off at ``t_fault`` did after its lease ran out (``t_fault`` + TTL at the
    latest): launch/terminate calls the cloud logged from its pid, commands carrying its token that an
    agent received; and instances that two daemons terminated."""
    w = s.w
    expiry = t_fault + s.t.lease_ttl_s
    calls = [c for c in w.cloud_calls()
             if c["pid"] == old_pid and c["ts"] > expiry and c["op"] in ("launch", "terminate")]
    stale = [r for r in w.records()
             if r["kind"] == "cmd" and r["t"] > expiry and r["msg"]["fencing_token"] <= old_token]
    by_instance: dict[str, set[int]] = {}
    for c in w.cloud_calls():
        if c["op"] == "terminate":
            for i in c["ids"]:
                by_instance.setdefault(i, set()).add(c["pid"])
    twice = sum(1 for p in by_instance.values() if len(p) > 1)
    d.split_brain_actions += len(calls) + len(stale) + twice
    d.facts.update(fenced_cloud_calls=len(calls), fenced_commands_received=len(stale), terminated_by_two_daemons=twice)
    if calls or stale or twice:
        d.problems.append(f"split brain: {len(calls)} cloud call(s), {len(stale)} command(s) from the fenced leader, "
                          f"{twice} instance(s) terminated by two daemons")
