"""Fuzzer: malformed and hostile messages on every subject orchd reads and on its admin service.

Targets (real node ids, the real job and pool, so that anything accepted would change real state):

    price        orch.price.<cloud>.<region>     JetStream (ORCH_MARKET)
    notice       orch.notice.<cloud>.<node>      JetStream (ORCH_EVENTS)
    node_event   orch.node.<node>.event          JetStream (ORCH_EVENTS): the five node event types
    heartbeat    orch.node.<node>.hb             core NATS
    admin        orch.admin.v1.<resource>.<verb> request/reply, every endpoint
    command_ack  replies to orch.cmd.<node>      hostile answers of an agent (``SimFleet.garbage_replies``)

Mutations (seeded): ``bad_json`` (truncated, garbage, empty), ``wrong_version``, ``wrong_type`` (a field's
value of another JSON type), ``missing_field``, ``unknown_type`` (a type tag no record has, or a record of
another subject), ``huge`` (> 256 KiB, rare), ``bad_value`` (negative/impossible numbers, empty ids),
``subject_mismatch`` (a node publishing another node's event, a price on another cloud's subject),
``unknown_id`` / ``invalid_spec`` (admin), ``replay`` (an earlier JetStream message again with the same
Nats-Msg-Id: the stream drops it, seen by the PubAck's ``duplicate`` flag, counted apart).

Every message must be rejected with a counted reason: the drill checks that the daemon's
``orchd_messages_rejected_total`` grows by exactly (sent - dropped as duplicates by the server), that
every admin request got an error answer, that orchd's pid is the same, and that the state (jobs, nodes,
pools; volatile liveness fields left out) and the commands the agents receive are unchanged.
"""

from __future__ import annotations

import random
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec

import wire as ev
from orchestrator.cli.client import AdminClient
from orchestrator.natsserver import NatsServer
from simulations.chaos import common
from simulations.chaos.agents import SimFleet
from simulations.chaos.harness import POOL_A, Orchd, job_spec

HUGE = 300 * 1024
EVIL = "evil-n9"
WRONG_TYPES: tuple[Any, ...] = ("x", [], {}, True, 1.5, [1, 2])
TARGET_WEIGHTS = (("heartbeat", 35), ("node_event", 25), ("price", 13), ("notice", 12), ("admin", 10),
                  ("replay", 5))
MUTATIONS = ("bad_json", "wrong_version", "wrong_type", "missing_field", "unknown_type", "bad_value",
             "subject_mismatch", "huge")


@dataclass(frozen=True, slots=True)
class Shot:
    target: str  # price | notice | node_event | heartbeat | admin
    mutation: str
    subject: str
    data: bytes
    msg_id: str | None = None  # JetStream only


@dataclass
class FuzzResult:
    seed: str
    fuzzed_messages: int = 0
    by_target: dict[str, int] = field(default_factory=dict)
    by_mutation: dict[str, int] = field(default_factory=dict)
    deduplicated: int = 0  # replays dropped by the stream (PubAck duplicate)
    publish_errors: int = 0
    rejected_counted: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    counters_add_up: bool = False
    admin_error_replies: int = 0
    admin_accepted: int = 0
    state_unchanged: bool = False
    state_diff: list[str] = field(default_factory=list)
    commands_during_fuzz: int = 0
    daemon_crashes: int = 0
    daemon_same_pid: bool = False
    seconds: float = 0.0
    fuzz_seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


# --- generation (pure, seeded) ------------------------------------------------------------------------


def _required(cls: type) -> list[str]:
    return [f.encode_name for f in msgspec.structs.fields(cls) if f.required]


class Generator:
    """Seeded hostile messages about one real job (``job_id``), its nodes and pool."""

    def __init__(self, rng: random.Random, job_id: str, nodes: list[str], pool: ev.PoolKey = POOL_A) -> None:
        self.rng = rng
        self.job_id = job_id
        self.nodes = nodes
        self.pool = pool
        self.n = 0
        self.recent_js: list[Shot] = []

    def base(self, target: str, node: str) -> tuple[type, dict]:
        now = time.time()
        r = self.rng
        node_id, job_id = ev.NodeId(node), ev.JobId(self.job_id)
        if target == "price":
            m: Any = ev.PriceTick(id=f"fz-{self.n}", pool=self.pool, gpu_type="A100", gpus_per_node=1,
                                  price_usd_h=1.0, on_demand_usd_h=3.0, ts=now)
        elif target == "notice":
            m = ev.PreemptionNotice(id=f"fz-{self.n}", node_id=node_id, cloud="fake", deadline_ts=now + 120,
                                    observed_ts=now)
        elif target == "heartbeat":
            m = ev.Heartbeat(node_id=node_id, seq=10**6 + self.n, ts=now, state=ev.AgentState.TRAINING,
                             job_id=job_id, generation=1, step=5)
        else:
            kind = r.randrange(5)
            common_kw: dict[str, Any] = dict(id=f"fz-{self.n}", node_id=node_id, ts=now)
            if kind == 0:
                m = ev.NodeRegistered(instance_id=ev.InstanceId("fake-999999"), pool=self.pool, host="6.6.6.6",
                                      **common_kw)
            elif kind == 1:
                m = ev.GenerationStarted(job_id=job_id, generation=1, first_step=0, **common_kw)
            elif kind == 2:
                m = ev.CheckpointCommitted(job_id=job_id, generation=1, step=10**6, checkpoint_id="evil",
                                           url="file:///evil", save_s=0.1, **common_kw)
            elif kind == 3:
                m = ev.RanksExited(job_id=job_id, generation=1, exit_code=0, reason="completed",
                                   last_step=10**9, **common_kw)
            else:
                m = ev.NodeLeaving(reason="evil", **common_kw)
        return type(m), msgspec.json.decode(msgspec.json.encode(m))  # JSON types only (no tuples)

    def subject(self, target: str, node: str) -> str:
        if target == "price":
            return ev.subject_price(self.pool.cloud, self.pool.region)
        if target == "notice":
            return ev.subject_notice("fake", node)
        if target == "heartbeat":
            return ev.subject_heartbeat(node)
        return ev.subject_node_event(node)

    def next(self) -> Shot:
        r = self.rng
        self.n += 1
        target = r.choices([t for t, _ in TARGET_WEIGHTS], [w for _, w in TARGET_WEIGHTS])[0]
        if target == "replay":
            if self.recent_js:
                old = r.choice(self.recent_js)
                return Shot(old.target, "replay", old.subject, old.data, old.msg_id)
            target = "node_event"
        if target == "admin":
            return self.admin()
        mutation = r.choice(MUTATIONS)
        if mutation == "huge" and r.random() > 0.02:  # huge ones are rare: 300 KiB each
            mutation = "bad_value"
        node = r.choice(self.nodes)
        cls, d = self.base(target, node)
        subject = self.subject(target, node)
        data = self.mutate(target, cls, d, mutation)
        if mutation == "subject_mismatch":
            if target == "price":
                subject = ev.subject_price(r.choice(("fake", "aws", "evil")), r.choice(("r2", "r9", "us-east-1")))
                if subject == ev.subject_price(self.pool.cloud, self.pool.region):
                    subject = ev.subject_price("fake", "r2")
            elif target == "notice":
                subject = r.choice((ev.subject_notice("fake", EVIL), ev.subject_notice("aws", node)))
            else:
                other = [n for n in self.nodes if n != node] + [EVIL]
                subject = (ev.subject_heartbeat if target == "heartbeat" else ev.subject_node_event)(r.choice(other))
        shot = Shot(target, mutation, subject, data, None if target == "heartbeat" else f"fz-{self.n}")
        if shot.msg_id is not None:
            self.recent_js.append(shot)
            if len(self.recent_js) > 500:
                del self.recent_js[:250]
        return shot

    def mutate(self, target: str, cls: type, d: dict, mutation: str) -> bytes:
        r = self.rng
        enc = msgspec.json.encode
        match mutation:
            case "bad_json":
                good = enc(d)
                return r.choice((good[: r.randrange(0, len(good) - 1)], b"{", b"not json", b"\xff\xfe\x00",
                                 good.replace(b":", b"=", 1), good + b"}", b'{"type":' * 50))
            case "wrong_version":
                d["v"] = r.choice((0, 2, 99, -1, 10**6))
            case "wrong_type":
                key = r.choice([k for k in d if k not in ("type", "v")])
                # never a value of the field's own type (None: an optional field, where a number is fine)
                d[key] = r.choice([w for w in WRONG_TYPES if type(w) is not type(d[key])
                                   and not (isinstance(d[key], float) and type(w) is int)
                                   and not (d[key] is None and type(w) is float)])
            case "missing_field":
                del d[r.choice(_required(cls))]
            case "unknown_type":
                d["type"] = r.choice(("evil_event", "", "heartbeat" if target != "heartbeat" else "price_tick",
                                      "command_ack"))
            case "huge":
                d["pad"] = "x" * HUGE
            case "bad_value":
                self._bad_value(target, cls, d)
            case "subject_mismatch":
                pass  # a valid payload; the subject is changed by the caller
        return enc(d)

    def _bad_value(self, target: str, cls: type, d: dict) -> None:
        r = self.rng
        value: Any
        if target == "price":
            key, value = r.choice((("price_usd_h", -1.0), ("price_usd_h", -1e300), ("on_demand_usd_h", -3.0),
                                   ("capacity_hint", 7.0), ("capacity_hint", -0.5), ("gpus_per_node", 0),
                                   ("gpus_per_node", -8), ("ts", -1.0), ("id", ""), ("price_usd_h", 1e308),
                                   ("on_demand_usd_h", 1e308)))
        elif target == "notice":
            # never timestamps: a notice is not refused for them (a wrong clock still gets its checkpoint)
            key, value = ("id", "")
        elif target == "heartbeat":
            key, value = r.choice((("seq", -1), ("step", -7), ("generation", -2)))
        else:
            options = [("ts", -1.0), ("id", "")]
            for k in ("generation", "first_step", "step", "last_step"):
                if k in d:
                    options.append((k, -r.randint(1, 10**6)))
            if "save_s" in d:
                options.append(("save_s", -0.5))
            key, value = r.choice(options)
        d[key] = value

    def admin(self) -> Shot:
        r = self.rng
        (resource, verb), (req_type, _) = r.choice(list(ev.ADMIN_ENDPOINTS.items()))
        subject = ev.admin_subject(resource, verb)
        fields = [f for f in msgspec.structs.fields(req_type) if f.name != "v"]
        d: dict = {"v": 1}
        for f in fields:  # a plausible request first
            if f.name == "job_id":
                d[f.name] = self.job_id
            elif f.name == "node_id":
                d[f.name] = self.nodes[0]
            elif f.name == "spec":
                d[f.name] = msgspec.to_builtins(job_spec("fuzz", nodes=1, total_steps=10))
        options = ["bad_json", "wrong_version", "huge"]
        if fields:
            options.append("wrong_type")
        if any(f.required for f in fields):
            options.append("missing_field")
        if "job_id" in d and req_type is ev.JobRequest:
            options.append("unknown_id")
        if "node_id" in d:
            options.append("unknown_id")
        if "spec" in d:
            options.append("invalid_spec")
        mutation = r.choice(options)
        if mutation == "huge" and r.random() > 0.05:
            mutation = "bad_json"
        if mutation == "bad_json":
            data = r.choice((b"{", b"[]", b"null", b"not json", b"\xff", b"{" * 40, b'{"v":1'))
        elif mutation == "wrong_version":
            d["v"] = r.choice((0, 2, 42, -1))
            data = msgspec.json.encode(d)
        elif mutation == "wrong_type":
            key = r.choice([f.name for f in fields])
            d[key] = r.choice([w for w in ("x", [1], {"a": 1}, 3.5) if type(w) is not type(d.get(key))
                               and not (key == "reason" and isinstance(w, str))])
            if key in ("reason",) and isinstance(d[key], str):
                d[key] = 7
            data = msgspec.json.encode(d)
        elif mutation == "missing_field":
            for f in fields:
                if f.required:
                    d.pop(f.name, None)
            data = msgspec.json.encode(d)
        elif mutation == "unknown_id":
            if "node_id" in d:
                d["node_id"] = f"no-such-node-{self.n}"
            else:
                d["job_id"] = f"no-such-job-{self.n}"
            data = msgspec.json.encode(d)
        elif mutation == "invalid_spec":
            d["spec"]["total_steps"] = r.choice((-1, 0))
            d["spec"]["nodes_max"] = 0
            data = msgspec.json.encode(d)
        else:
            d["pad"] = "x" * HUGE
            data = msgspec.json.encode(d)
        return Shot("admin", mutation, subject, data)


# --- the drill ----------------------------------------------------------------------------------------


async def _snapshot(client: Any) -> dict:
    jobs = {}
    for j in (await common.call(client, "jobs")).jobs:
        rec = dict((await common.call(client, "job", j["job_id"])).job)
        rec.pop("price_eval_ts", None)  # the Tick's own throttle clock
        jobs[j["job_id"]] = rec
    nodes = {n["node_id"]: {k: n[k] for k in ("job_id", "phase", "pool", "instance_id", "generation", "rank")}
             for n in (await common.call(client, "nodes")).nodes}
    pools = {p["pool"]: {k: p[k] for k in ("gpu_type", "gpus_per_node", "price_usd_h", "on_demand_usd_h",
                                           "backoff_until")}
             for p in (await common.call(client, "prices")).pools}
    return {"jobs": jobs, "nodes": nodes, "pools": pools}


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += _diff(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{path}.{k}")
        return out
    return [] if a == b else [f"{path}: {a!r} -> {b!r}"[:300]]


async def run(seed: int, root: Path, *, n_messages: int = 100_000, garbage_replies: int = 2,
              settle_s: float = 180.0) -> FuzzResult:
    tag = f"{seed}-fuzz"
    rng = random.Random(tag)
    res = FuzzResult(seed=tag)
    t_begin = time.monotonic()
    work = root / "fuzz"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    server = NatsServer(work / "nats").start()
    # No per-sender limit: the fuzzer speaks as the fleet's own nodes (it bypasses the NATS permissions
    # that would stop it), so a limit would also drop those nodes' legitimate heartbeats and break the
    # count below. The limit has its own test (tests/integration/test_sender_limit.py).
    orchd = Orchd(work, server.url, daemon_extra="sender_rate_per_s = 0")
    nc = pub = None
    job_id = "chaos-fuzz-j0"
    try:
        await anyio.to_thread.run_sync(orchd.start)
        nc = await common.connect(server.url, "chaos-agents")
        pub = await common.connect(server.url, "chaos-fuzzer")
        fleet = SimFleet(nc, orchd.fake_file, step_s=0.05, garbage_replies=garbage_replies)
        async with anyio.create_task_group() as tg:
            await tg.start(fleet.run)
            await common.publish_prices(fleet.js, tag)
            client = await common.admin(server.url, timeout_s=20.0)
            status0 = await common.call(client, "status")
            await _start_job(client, fleet, job_id)
            nodes = sorted(fleet.nodes)
            before = await _snapshot(client)
            t_cmds = time.time()
            shooter = _Shooter(pub, res)
            await shooter.fire(Generator(rng, job_id, nodes), n_messages, orchd)
            res.fuzzed_messages = sum(shooter.by_target.values()) + fleet.garbage_total
            shooter.by_target["command_ack"] = fleet.garbage_total
            res.by_target, res.by_mutation = dict(shooter.by_target), dict(shooter.by_mutation)
            expected = res.fuzzed_messages - res.deduplicated - res.publish_errors
            await _wait_counted(orchd, expected, settle_s)
            if orchd.crashed() or not orchd.alive():
                res.problems.append("orchd died: " + orchd.tail(800))
            else:
                await anyio.sleep(1.0)
                _check_counted(orchd, expected, res)
                await _check_unchanged(client, before, status0, res)
                res.commands_during_fuzz = len([c for t, c in fleet.commands if t >= t_cmds])
                if res.commands_during_fuzz:
                    res.problems.append(f"{res.commands_during_fuzz} command(s) decided during the fuzz")
            await client.close()
            tg.cancel_scope.cancel()
        await anyio.to_thread.run_sync(orchd.stop)
    finally:
        await common.shutdown(orchd, server, nc, pub)
    res.daemon_crashes = orchd.crashes
    res.seconds = round(time.monotonic() - t_begin, 2)
    return res


async def _start_job(client: AdminClient, fleet: SimFleet, job_id: str) -> None:
    """The real job the fuzz is about: 2 nodes training, then a quiet state (acks, liveness flush, gauges)."""
    await common.call(client, "submit", job_spec(job_id, nodes=2, total_steps=10**6), job_id=job_id)
    with anyio.fail_after(60):
        while len([n for n in fleet.nodes.values() if n.training]) < 2 or not fleet.idle():
            await anyio.sleep(0.1)
        while (await common.call(client, "job", job_id)).summary["phase"] != "running":
            await anyio.sleep(0.1)
    await anyio.sleep(1.5)


class _Shooter:
    """Sends the generator's shots: heartbeats as core NATS publishes, the rest to JetStream (acks
    settled in batches: duplicates and publish errors counted) or as admin requests (50 at a time)."""

    def __init__(self, pub: Any, res: FuzzResult) -> None:
        self.pub, self.res = pub, res
        self.js = pub.jetstream(timeout=10.0)
        self.by_target: Counter[str] = Counter()
        self.by_mutation: Counter[str] = Counter()
        self.admin_pending: list[Shot] = []
        self.js_pending: list[Any] = []

    async def fire(self, gen: Generator, n_messages: int, orchd: Orchd) -> None:
        t_fuzz = time.monotonic()
        for i in range(n_messages):
            shot = gen.next()
            self.by_target[shot.target] += 1
            self.by_mutation[shot.mutation] += 1
            if shot.target == "admin":
                self.admin_pending.append(shot)
                if len(self.admin_pending) >= 50:
                    await self.settle_admin()
            elif shot.target == "heartbeat":
                await self.pub.publish(shot.subject, shot.data)
            else:
                self.js_pending.append(await self.js.publish_async(shot.subject, shot.data,
                                                                   headers={"Nats-Msg-Id": shot.msg_id}))
                if len(self.js_pending) >= 1000:
                    await self.settle_js()
            if i % 2000 == 1999:
                await self.pub.flush()
                await self.settle_js()
                if not orchd.alive():
                    break
        await self.settle_js()
        await self.settle_admin()
        await self.pub.flush()
        self.res.fuzz_seconds = round(time.monotonic() - t_fuzz, 2)

    async def admin_call(self, shot: Shot) -> None:
        res = self.res
        try:
            reply = await self.pub.request(shot.subject, shot.data, timeout=30.0)
        except Exception as e:
            res.problems.append(f"admin {shot.subject} {shot.mutation}: no reply ({type(e).__name__})")
            return
        if reply.headers and reply.headers.get("Nats-Service-Error-Code"):
            res.admin_error_replies += 1
        else:
            res.admin_accepted += 1
            res.problems.append(f"admin accepted {shot.mutation} on {shot.subject}: {shot.data[:120]!r}")

    async def settle_js(self) -> None:
        for fut in self.js_pending:
            try:
                ack = await fut
                if ack.duplicate:
                    self.res.deduplicated += 1
            except Exception:
                self.res.publish_errors += 1
        self.js_pending.clear()

    async def settle_admin(self) -> None:
        async with anyio.create_task_group() as atg:
            for shot in self.admin_pending:
                atg.start_soon(self.admin_call, shot)
        self.admin_pending.clear()


async def _wait_counted(orchd: Orchd, expected: int, settle_s: float) -> None:
    """Until the daemon has counted every rejection, stops counting for 15 s, dies, or ``settle_s`` passed."""
    last, still = -1, time.monotonic()
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline and orchd.alive():
        counted = sum(orchd.rejected().values())
        if counted >= expected:
            return
        if counted != last:
            last, still = counted, time.monotonic()
        elif time.monotonic() - still > 15:
            return
        await anyio.sleep(0.5)


def _check_counted(orchd: Orchd, expected: int, res: FuzzResult) -> None:
    reasons = orchd.rejected()
    res.rejected_counted = sum(reasons.values())
    res.rejected_by_reason = {f"{k}/{r}": v for (k, r), v in sorted(reasons.items())}
    res.counters_add_up = res.rejected_counted == expected
    if not res.counters_add_up:
        res.problems.append(f"rejected_counted {res.rejected_counted} != expected {expected} "
                            f"(sent {res.fuzzed_messages}, deduplicated {res.deduplicated}, "
                            f"publish errors {res.publish_errors})")


async def _check_unchanged(client: AdminClient, before: dict, status0: Any, res: FuzzResult) -> None:
    after = await _snapshot(client)
    res.state_diff = _diff(before, after)[:20]
    res.state_unchanged = not res.state_diff
    status1 = await common.call(client, "status")
    res.daemon_same_pid = status1.pid == status0.pid


def as_dict(r: FuzzResult) -> dict[str, Any]:
    return asdict(r)
