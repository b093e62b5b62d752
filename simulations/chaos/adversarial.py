"""Adversarial drill: the same seeded legitimate run twice, without and with hostile messages.

Role: ``run(seed, root, n_hostile)`` drives a fixed scenario against a real orchd, nats-server and the
file-backed fake cloud, once clean and once with ``n_hostile`` messages from ``hostile.Hostile`` sent in
three batches at fixed points of the scenario, then compares:

* the final state, loaded **in a fresh process** (``python -m simulations.chaos.adversarial --load URL``:
  ``Store.load`` + ``state_from_records`` on the stopped daemon's KV), normalised by ``normalise``;
* the fake cloud's instances (node id, pool, alive), counted from its file: launches the clean run does
  not have, instances terminated during a batch while their job was still running;
* orchd alive after every batch (and its state loadable in a fresh process), no crash at the end.

Scenario (both runs): prices for two pools; jobs ``adv-a`` (2 nodes) and ``adv-b`` (1 node) of
``TOTAL_STEPS`` steps; once both train, a preemption notice to ``adv-a``'s first node; once its
replacement trains and the noticed instance is gone: batch 1, then batch 2; once both jobs finished and
no instance is alive: batch 3.

Concurrency contract: one drill at a time per ``root``; everything on the caller's asyncio loop.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec

import wire as ev
from orchestrator import bus
from orchestrator.natsserver import NatsServer
from simulations.chaos import common
from simulations.chaos.advstate import diff, load, load_fresh, normalise
from simulations.chaos.agents import SimFleet
from simulations.chaos.harness import POOL_A, Orchd, job_spec
from simulations.chaos.hostile import Ctx, Hostile, Shot
from simulations.chaos.wedge import WEDGE_MAX_S, bound_s, notice_to_command_s, wedges
from simulations.fakecloud import read_fake_file

TOTAL_STEPS = 400
STEP_S = 0.03
JOBS = {"adv-a": 2, "adv-b": 1}
PROBE = "adv-probe"
PROBES = tuple(f"{PROBE}-{k}" for k in (1, 2, 3))
"""One-node jobs that train through the whole scenario in both runs: after batch k a notice for the node of
the k-th measures whether orchd still decides (``wedge.py``); never a sender or a target of the attacks.
On demand in one pool, each noticed once: where they run again and what the pool counts (one preemption
per job) do not depend on how long a batch took."""
PROBE_STEPS = 10**7
VOLUME = 3000
"""Above this many hostile messages a run is a volume run: at most ``HUGE_BUDGET`` ~200 KB huge arrays."""
HUGE_BUDGET = 2000
ADMIN_IN_FLIGHT = 64
EXPECTED_FAILURES: tuple[str, ...] = (
    # a PriceTick with capacity_hint = 5e-324 (seed 1): accepted into the pool. A capacity hint in 0..1 is
    # within a feed's rights (it changes no decision: any hint > 0 means capacity), but it differs from
    # the clean run's state, which the oracle compares exactly.
    "price.capacity_hint",
)
"""Hostile kinds known to break the oracle, each with the bug it shows. The default drill does not send
them (``--adversarial-all`` does), so that the oracle itself stays exact for every other kind."""


@dataclass
class AdvResult:
    seed: str
    skipped_kinds: list[str] = field(default_factory=list)  # EXPECTED_FAILURES not sent
    hostile_messages: int = 0
    hostile_send_s: float = 0.0
    hostile_drain_s: float = 0.0
    hostile_messages_per_s: float = 0.0  # sent / (send + drain): what orchd got through
    by_kind: dict[str, int] = field(default_factory=dict)
    by_target: dict[str, int] = field(default_factory=dict)
    admin_errors: int = 0
    admin_ok: int = 0  # read-only requests with unknown fields, an idempotent re-submit: answered, harmless
    admin_internal_errors: dict[str, int] = field(default_factory=dict)  # 5xx answers by kind: handler bugs
    crashes: int = 0
    alive_after_batches: list[bool] = field(default_factory=list)
    fresh_loads_ok: list[bool] = field(default_factory=list)
    unjustified_state_changes: list[str] = field(default_factory=list)
    unjustified_launches: list[str] = field(default_factory=list)
    unjustified_terminations: list[str] = field(default_factory=list)
    wedges: list[str] = field(default_factory=list)  # batches after which a healthy notice was not decided in time
    notice_to_command_s: dict[str, Any] = field(default_factory=dict)  # unattacked and per batch, both runs
    bad_names: dict[str, int] = field(default_factory=dict)  # hostile names sent, by what they hold
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    clean_jobs: dict[str, str] = field(default_factory=dict)
    hostile_jobs: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


@dataclass
class _Run:
    """What one run leaves: the normalised final state, the cloud, rejections, and its hostile tallies."""

    state: dict = field(default_factory=dict)
    cloud: Counter = field(default_factory=Counter)
    rejected: Counter = field(default_factory=Counter)
    sent: int = 0
    send_s: float = 0.0  # sending the hostile messages
    drain_s: float = 0.0  # after sending, until orchd's consumers had nothing pending
    by_kind: Counter = field(default_factory=Counter)
    by_target: Counter = field(default_factory=Counter)
    terminated_in_batch: list[str] = field(default_factory=list)
    alive: list[bool] = field(default_factory=list)
    loads: list[bool] = field(default_factory=list)
    admin_errors: int = 0
    admin_ok: int = 0
    crashes: int = 0
    bad_names: Counter = field(default_factory=Counter)
    admin_internal: Counter = field(default_factory=Counter)  # 5xx replies (not 503: not the leader) by kind
    before_s: float | None = None  # the scenario's own notice, before any batch: unattacked
    probe_s: list[float | None] = field(default_factory=list)  # the probe's notice after each batch
    problems: list[str] = field(default_factory=list)


def _probe_node(node_id: str) -> bool:
    return node_id.startswith(f"{PROBE}-")


# --- one run ---------------------------------------------------------------------------------------


def _cloud(orchd: Orchd) -> list[Any]:
    try:
        return read_fake_file(orchd.fake_file)
    except (OSError, ValueError):
        return []


def _ctx(fleet: SimFleet, orchd: Orchd, terminal: set[str], noticed: set[str]) -> Ctx:
    insts = [i for i in _cloud(orchd) if not _probe_node(str(i.node_id))]
    gens: dict[str, int] = {j: 0 for j in JOBS}
    for e in fleet.events_of(ev.GenerationStarted):
        gens[e.job_id] = max(gens.get(e.job_id, 0), e.generation)
    return Ctx(job_of={n.node_id: str(n.job_id or next(iter(JOBS))) for n in fleet.nodes.values()
                       if not _probe_node(n.node_id)},
               instance_of={str(i.node_id): (i.instance_id, i.pool) for i in insts if i.node_id},
               live={str(i.node_id) for i in insts if i.alive},
               generation=gens, roots={j: job_spec(j, nodes=1, total_steps=1).checkpoint.url for j in JOBS},
               terminal=set(terminal), noticed=set(noticed),
               events=[e for e in fleet.events if not _probe_node(str(e.node_id))])


async def _wait(pred: Any, what: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"scenario stuck: {what}")
        await anyio.sleep(0.1)


class _Scenario:
    def __init__(self, seed: int, work: Path, n_hostile: int, skip: tuple[str, ...] = ()) -> None:
        self.seed, self.work, self.n_hostile, self.skip = seed, work, n_hostile, skip
        self.run = _Run()
        self.noticed: set[str] = set()

    async def main(self) -> _Run:
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        server = NatsServer(self.work / "nats").start()
        # The per-sender rate limit is off here: the oracle replays the same legitimate traffic, and the
        # limiter would rightly refuse a flooding node's own legitimate messages too (it has its own tests,
        # tests/integration/test_sender_limit.py). This drill is about what lies behind it.
        orchd = self.orchd = Orchd(self.work, server.url, daemon_extra="sender_rate_per_s = 0")
        self.url = server.url
        nc = pub = None
        try:
            await anyio.to_thread.run_sync(orchd.start)
            nc = await common.connect(server.url, "chaos-agents")
            pub = self.pub = await common.connect(server.url, "chaos-adversary")
            fleet = self.fleet = SimFleet(nc, orchd.fake_file, step_s=STEP_S)
            client = self.client = await common.admin(server.url, timeout_s=20.0)
            gen = self.gen = Hostile(random.Random(f"{self.seed}-adversarial"), _ctx(fleet, orchd, set(), set()),
                          str(self.seed), self.skip, huge_budget=None if self.n_hostile <= VOLUME else HUGE_BUDGET)
            async with anyio.create_task_group() as tg:
                await tg.start(fleet.run)
                try:
                    await self.legit_and_batches(gen)
                except TimeoutError as e:  # the state and the cloud as they are are still compared
                    self.run.problems.append(f"{e}; orchd log: {orchd.tail(300)}")
                tg.cancel_scope.cancel()
            self.run.rejected = orchd.rejected()
            self.run.bad_names = Counter(gen.names.used)
            await client.close()
            await anyio.to_thread.run_sync(orchd.stop)
            state = await anyio.to_thread.run_sync(load_fresh, server.url)
            if state is None:
                self.run.problems.append("final state does not load in a fresh process")
                state = {"jobs": {}, "nodes": {}, "pools": {}, "meta": {}}
            insts = _cloud(orchd)
            legit = {(str(e.job_id), e.url) for e in fleet.events_of(ev.CheckpointCommitted)}
            own = {i.instance_id: str(i.node_id) for i in insts}
            self.run.state = normalise(state, legit, own, live_jobs=set(PROBES))
            self.run.cloud = Counter((str(i.node_id), i.pool.name) for i in insts)
        except Exception as e:  # a stuck scenario or a dead daemon: reported, the comparison then fails
            inner: BaseException = e
            while isinstance(inner, BaseExceptionGroup) and inner.exceptions:
                inner = inner.exceptions[0]
            self.run.problems.append(f"{type(inner).__name__}: {inner}; orchd log: {orchd.tail(600)}")
        finally:
            await common.shutdown(orchd, server, nc, pub)
        self.run.crashes = orchd.crashes
        return self.run

    async def jobs(self) -> dict[str, str]:
        return {j["job_id"]: j["phase"] for j in (await common.call(self.client, "jobs")).jobs}

    async def legit_and_batches(self, gen: Hostile) -> None:
        await self.setup()
        per = [self.n_hostile // 3 + (1 if k < self.n_hostile % 3 else 0) for k in range(3)]
        for k in range(2):
            await self.batch(gen, per[k], set(), PROBES[k])
        orchd = self.orchd

        async def finished() -> bool:
            phases = await self.jobs()
            return all(phases.get(j) == "succeeded" for j in JOBS) and not any(
                i.alive for i in _cloud(orchd) if not _probe_node(str(i.node_id)))
        await _wait(finished, "both jobs succeeded, no instance of theirs alive", 45.0)
        await anyio.sleep(1.0)
        await self.batch(gen, per[2], set(JOBS), PROBES[2])
        for job in PROBES:
            await common.call(self.client, "cancel", job)

        async def probe_gone() -> bool:
            phases = await self.jobs()
            return all(phases.get(j) == "cancelled" for j in PROBES) and not any(i.alive for i in _cloud(orchd))
        await _wait(probe_gone, "the probe jobs cancelled, no instance alive")
        await anyio.sleep(1.0)

    async def setup(self) -> None:
        """Prices; the jobs and the probe job placed and training; the scenario's notice (timed: the
        unattacked notice-to-command time) and ``adv-a`` regrown after it."""
        fleet, orchd = self.fleet, self.orchd
        await common.publish_prices(fleet.js, "adv")
        probe = msgspec.structs.replace(job_spec(PROBE, nodes=1, total_steps=PROBE_STEPS),
                                        market=ev.MarketPolicy.ON_DEMAND, instance_types=(POOL_A.instance_type,))
        specs = {**{j: job_spec(j, nodes=n, total_steps=TOTAL_STEPS) for j, n in JOBS.items()},
                 **{j: msgspec.structs.replace(probe, name=j, checkpoint=job_spec(j, nodes=1, total_steps=1).checkpoint)
                    for j in PROBES}}
        for job_id, spec in specs.items():  # one after the other: node ids (a global sequence) as in the other run
            await common.call(self.client, "submit", spec, job_id=job_id)

            async def placed(job_id: str = job_id, n: int = spec.nodes) -> bool:
                nodes = (await common.call(self.client, "nodes")).nodes
                return len([x for x in nodes if x["job_id"] == job_id]) >= n
            await _wait(placed, f"{job_id} placed")

        async def training() -> bool:
            return len([n for n in fleet.nodes.values() if n.training]) == sum(JOBS.values()) + len(PROBES) \
                and fleet.idle()
        await _wait(training, "the jobs training")
        victim = sorted(n.node_id for n in fleet.nodes.values() if n.job_id == "adv-a")[0]
        self.run.before_s = await notice_to_command_s(fleet, victim, limit_s=60.0)
        self.noticed.add(victim)
        if self.run.before_s is None:
            raise TimeoutError("scenario stuck: the unattacked notice was not decided in 60 s")

        async def regrown() -> bool:
            dead = not any(i.alive for i in _cloud(orchd) if str(i.node_id) == victim)
            return dead and any(e.generation >= 2 and e.job_id == "adv-a"
                                for e in fleet.events_of(ev.GenerationStarted)) and fleet.idle()
        await _wait(regrown, "adv-a regrown after the notice")

    async def probe(self, job: str) -> None:
        """After a batch (in the clean run at the same point): a notice for probe job ``job``'s training node,
        timed to its checkpoint command (``wedge.py``); then until that job trains on a new node."""
        fleet, orchd = self.fleet, self.orchd

        def training() -> list[str]:
            return sorted(n.node_id for n in fleet.nodes.values() if n.job_id == job and n.training and n.alive)

        async def ready() -> bool:
            return bool(training()) and fleet.idle()
        await _wait(ready, "the probe job training")
        node = training()[0]
        t = await notice_to_command_s(fleet, node, WEDGE_MAX_S)
        self.run.probe_s.append(t)
        if t is None:
            return  # a wedge: judged by the oracle; the scenario goes on as far as it can

        async def regrown() -> bool:
            gone = not any(i.alive for i in _cloud(orchd) if str(i.node_id) == node)
            return gone and any(n != node for n in training()) and fleet.idle()
        await _wait(regrown, "the probe job regrown after its notice")

    async def batch(self, gen: Hostile, n: int, terminal: set[str], probe: str) -> None:
        await self.attack(gen, n, terminal)  # the clean run (n = 0): the same checks, so the probe's conditions
        await self.probe(probe)

    async def attack(self, gen: Hostile, n: int, terminal: set[str]) -> None:
        gen.ctx = _ctx(self.fleet, self.orchd, terminal, self.noticed)
        alive0 = {(str(i.node_id), i.instance_id) for i in _cloud(self.orchd) if i.alive}
        limiter = anyio.CapacityLimiter(ADMIN_IN_FLIGHT)
        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            for k in range(n):
                shot = gen.next()
                self.run.sent += 1
                self.run.by_kind[shot.kind] += 1
                self.run.by_target[shot.target] += 1
                if shot.target == "admin":
                    tg.start_soon(self.admin_call, shot, limiter)
                    await anyio.sleep(0)
                    continue
                # fire and forget, as a hostile sender would: on a JetStream subject the stream stores it
                # (a fresh Nats-Msg-Id: never dropped as a duplicate); no wait for the stream's ack
                msg_id = f"adv-{self.seed}-{self.run.sent}-{k}"
                headers = None if shot.target == "heartbeat" else {"Nats-Msg-Id": msg_id}
                await self.pub.publish(shot.subject, shot.data, headers=headers)
                if k % 500 == 499 or len(shot.data) > 65536:
                    await self.pub.flush()
        await self.pub.flush()
        t1 = time.monotonic()
        await self.drained(timeout_s=120.0 + n / 2000)
        self.run.send_s += t1 - t0
        self.run.drain_s += time.monotonic() - t1
        await anyio.sleep(1.5)  # the daemon's tick is 0.25 s: decisions on what was accepted are made by then
        phases = await self.jobs()
        for node, inst in sorted(alive0 - {(str(i.node_id), i.instance_id) for i in _cloud(self.orchd) if i.alive}):
            job = self.fleet.nodes[node].job_id if node in self.fleet.nodes else None
            if phases.get(str(job)) not in ("succeeded", "failed", "cancelled"):
                self.run.terminated_in_batch.append(f"{inst} of {node} ({job}, {phases.get(str(job))})")
        alive = self.orchd.alive() and not self.orchd.crashed()
        self.run.alive.append(alive)
        loaded = alive and await anyio.to_thread.run_sync(load_fresh, self.url) is not None
        self.run.loads.append(loaded)

    async def drained(self, timeout_s: float) -> None:
        """Until orchd's consumers have nothing pending or unacknowledged (every hostile JetStream message
        decided, refused or terminated); a timeout is a problem of the run."""
        js = self.pub.jetstream(timeout=10.0)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            infos = [await js.consumer_info(stream, consumer) for stream, consumer in
                     ((bus.STREAM_EVENTS, bus.CONSUMER_EVENTS), (bus.STREAM_MARKET, bus.CONSUMER_MARKET))]
            if all(i.num_pending == 0 and i.num_ack_pending == 0 for i in infos):
                return
            await anyio.sleep(0.5)
        self.run.problems.append(f"orchd's consumers not drained after {timeout_s:.0f} s")

    async def admin_call(self, shot: Shot, limiter: anyio.CapacityLimiter) -> None:
        try:
            async with limiter:
                reply = await self.pub.request(shot.subject, shot.data, timeout=30.0)
        except Exception as e:
            self.run.problems.append(f"admin {shot.kind}: no reply ({type(e).__name__})")
            return
        code = reply.headers.get("Nats-Service-Error-Code") if reply.headers else None
        if code:
            self.run.admin_errors += 1
            if code.startswith("5") and code != "503":  # a handler that failed: a bug, never an answer
                self.run.admin_internal[shot.kind] += 1
        else:
            self.run.admin_ok += 1


# --- the drill -------------------------------------------------------------------------------------


async def run(seed: int, root: Path, n_hostile: int, include_expected: bool = False) -> AdvResult:
    t0 = time.monotonic()
    res = AdvResult(seed=f"{seed}-adversarial")
    res.skipped_kinds = [] if include_expected else list(EXPECTED_FAILURES)
    clean = await _Scenario(seed, root / "adv-clean", 0).main()
    hostile = await _Scenario(seed, root / "adv-hostile", n_hostile, tuple(res.skipped_kinds)).main()
    res.hostile_messages = hostile.sent
    res.hostile_send_s, res.hostile_drain_s = round(hostile.send_s, 1), round(hostile.drain_s, 1)
    busy = hostile.send_s + hostile.drain_s
    res.hostile_messages_per_s = round(hostile.sent / busy) if busy > 0 else 0.0
    res.by_kind = dict(sorted(hostile.by_kind.items()))
    res.by_target = dict(sorted(hostile.by_target.items()))
    res.admin_errors, res.admin_ok = hostile.admin_errors, hostile.admin_ok
    res.admin_internal_errors = dict(sorted((clean.admin_internal + hostile.admin_internal).items()))
    res.crashes = clean.crashes + hostile.crashes + sum(1 for a in hostile.alive if not a)
    res.alive_after_batches, res.fresh_loads_ok = hostile.alive, hostile.loads
    res.unjustified_state_changes = diff(clean.state, hostile.state)[:50]
    res.unjustified_launches = sorted(f"{n} in {p} x{c}" for (n, p), c in (hostile.cloud - clean.cloud).items())
    res.unjustified_terminations = hostile.terminated_in_batch + sorted(
        f"{n} in {p}: never launched" for (n, p), c in (clean.cloud - hostile.cloud).items())
    _judge_wedges(res, clean, hostile)
    res.bad_names = dict(sorted(hostile.bad_names.items()))
    res.rejected_by_reason = {f"{k}/{r}": v for (k, r), v in sorted((hostile.rejected - clean.rejected).items())}
    res.clean_jobs = {j: s.get("phase", "?") for j, s in clean.state.get("jobs", {}).items()}
    res.hostile_jobs = {j: s.get("phase", "?") for j, s in hostile.state.get("jobs", {}).items()}
    res.problems = [f"clean: {p}" for p in clean.problems] + [f"hostile: {p}" for p in hostile.problems]
    if any(res.clean_jobs.get(j) != "succeeded" for j in JOBS):
        res.problems.append(f"the clean run did not finish its jobs: {res.clean_jobs}")
    res.seconds = round(time.monotonic() - t0, 1)
    return res


def _judge_wedges(res: AdvResult, clean: _Run, hostile: _Run) -> None:
    """The wedge oracle: each batch's probe against 5x the slowest unattacked notice (the clean run's, before
    and after its batch points, and the hostile run's before its first batch), at most 5 s."""
    unattacked = [t for t in (clean.before_s, *clean.probe_s, hostile.before_s) if t is not None]
    base = max(unattacked) if unattacked else None
    res.wedges = wedges(base, hostile.probe_s)
    res.notice_to_command_s = {
        "clean_before": clean.before_s, "clean_after_batches": clean.probe_s, "hostile_before": hostile.before_s,
        "hostile_after_batches": hostile.probe_s, "unattacked_s": base,
        "bound_s": round(bound_s(base), 3) if base is not None else WEDGE_MAX_S}
    if None in clean.probe_s:
        res.problems.append(f"clean: a probe notice was not decided in {WEDGE_MAX_S} s: {clean.probe_s}")
    if len(hostile.probe_s) < 3:
        res.problems.append(f"hostile: {len(hostile.probe_s)} of 3 batches probed")


def passed(r: AdvResult) -> bool:
    return (not r.crashes and not r.wedges and not r.admin_internal_errors and all(r.alive_after_batches)
            and all(r.fresh_loads_ok) and not r.problems
            and not r.unjustified_state_changes and not r.unjustified_launches and not r.unjustified_terminations)


def as_dict(r: AdvResult) -> dict[str, Any]:
    out = asdict(r)
    out["passed"] = passed(r)
    out["expected_failures"] = list(EXPECTED_FAILURES)
    return out


if __name__ == "__main__" and sys.argv[1:2] == ["--load"]:
    print(json.dumps(anyio.run(load, sys.argv[2])))
