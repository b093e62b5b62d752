"""Adversarial messages built from a real run's ids (``simulations.chaos.adversarial``).

Where the fuzzer (``fuzz.py``) mutates values inside known shapes, this generator sends *well-formed
attacks*: each message comes from a real sender (a node's own subjects, the price feed, an admin
client) and carries one of

    foreign_job        an event or heartbeat naming another job (and its current generation): e.g.
                       ``CheckpointCommitted`` / ``RanksExited(completed)`` for a job the node is not in
    old_generation     an event for the sender's job at a generation that ended (or one never started)
    replay             a legitimate event of this run again (same or fresh event id, fresh Nats-Msg-Id)
                       once its generation is over or its job finished
    foreign_instance   ``NodeRegistered`` naming another node's (live or terminated) instance
    ckpt_outside_root  ``CheckpointCommitted`` for the sender's own generation with a URL outside the
                       job's checkpoint root (another job's root, ``..``, another scheme)
    dead_notice        a notice for a node already noticed or gone, with an absurd deadline
    extreme_price      a price tick for a real pool with 1e308 / -1e308 / 5e-324 / 2**63 in one field
    admin_*            admin requests with hostile bodies (never a valid mutating request)
    bad_name           a name field of a record or an admin body that is neither a token nor a dotted key
                       (``names.py``: white space, ``..``, wildcards, non-ASCII, control characters, 5,000
                       characters, empty), sent unwrapped; log lines on the sender's own log subject too

each optionally wrapped in a hostile structure: ``deep_nest`` (a field replaced by a 1,000-deep JSON
list nest, 2 KB), ``huge_array`` (a field replaced by 100,000 zeros, about 200 KB: under the 256 KiB
limit), ``duplicate_keys`` (a key repeated with a hostile value last), ``unknown_fields``, and
``extreme`` (one numeric field set to 1e308, -1e308, 5e-324, 2**63, -2**63 or 2**64).

A notice for a *live* node on its own subject, or a heartbeat with a newer ``seq`` for the sender's own
node, is something the node's owner may legitimately say: not generated (see docs/chaos.md).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

import wire as ev
from simulations.chaos.harness import PRICES, job_spec
from simulations.chaos.names import BadNames

NEST = b"[" * 1000 + b"]" * 1000
HUGE_ARRAY = b"[" + b",".join([b"0"] * 100_000) + b"]"
EXTREME_FLOATS = (1e308, -1e308, 5e-324, -5e-324)
EXTREME_INTS = (2**63, -(2**63), 2**64, 2**63 - 1)
WRAPPERS = ("none", "none", "deep_nest", "huge_array", "duplicate_keys", "unknown_fields", "extreme")
KINDS = (("foreign_job", 18), ("old_generation", 14), ("replay", 12), ("foreign_instance", 10),
         ("ckpt_outside_root", 10), ("dead_notice", 8), ("extreme_price", 8), ("admin", 20), ("bad_name", 20))
READ_ONLY = {("status", "get"), ("jobs", "list"), ("jobs", "show"), ("jobs", "explain"), ("nodes", "list"),
             ("prices", "list"), ("events", "tail"), ("dead", "list")}


@dataclass(frozen=True, slots=True)
class Shot:
    kind: str  # "<kind>/<wrapper>"
    target: str  # node_event | heartbeat | notice | price | log | admin
    subject: str
    data: bytes


@dataclass
class Ctx:
    """What the legitimate run has produced so far (real ids only)."""

    job_of: dict[str, str]  # node id -> job id
    instance_of: dict[str, tuple[str, ev.PoolKey]]  # node id -> (instance id, pool), live or not
    live: set[str]  # node ids whose instance is alive
    generation: dict[str, int]  # job id -> current generation
    roots: dict[str, str]  # job id -> checkpoint root URL
    terminal: set[str]  # finished job ids
    noticed: set[str]  # node ids already noticed
    events: list[Any] = field(default_factory=list)  # the legitimate node events so far


class Hostile:
    def __init__(self, rng: random.Random, ctx: Ctx, tag: str, skip: tuple[str, ...] = (),
                 huge_budget: int | None = None) -> None:
        self.rng, self.ctx, self.tag = rng, ctx, tag
        self.kinds = [(k, w) for k, w in KINDS if k not in skip]
        self.skip = skip
        self.n = 0
        self.huge_left = huge_budget  # at most this many ~200 KB huge_array messages (None: no cap)
        self.names = BadNames(rng, ctx, self._id)

    def _id(self) -> str:
        self.n += 1
        return f"adv-{self.tag}-{self.n}"

    def next(self) -> Shot:
        r = self.rng
        kind = r.choices([k for k, _ in self.kinds], [w for _, w in self.kinds])[0]
        if kind == "admin":
            return self.admin()
        if kind == "bad_name":  # unwrapped: the name is the attack
            self.names.ctx = self.ctx
            field, target, subject, data = self.names.next()
            return Shot(f"bad_name/{field}", target, subject, data)
        built = getattr(self, kind)()
        if built is None:  # nothing of that kind exists yet (e.g. no replayable event): an event of another job
            kind, built = "foreign_job", self.foreign_job()
        target, subject, d = built
        wrapper = r.choice(WRAPPERS)
        if wrapper == "huge_array" and self.huge_left is not None:
            if self.huge_left <= 0:
                wrapper = "deep_nest"  # a volume run: the bytes of a million 200 KB messages are not the point
            else:
                self.huge_left -= 1
        return Shot(f"{kind}/{wrapper}", target, subject, self.wrap(d, wrapper, target))

    # --- references ------------------------------------------------------------------------------

    def _sender(self) -> str:
        return self.rng.choice(sorted(self.ctx.job_of))

    def _event(self, cls: type, node: str, job: str, gen: int, **kw: Any) -> dict:
        now = time.time()
        base: dict[str, Any] = dict(id=self._id(), node_id=node, ts=now)
        if cls is ev.GenerationStarted:
            m: Any = ev.GenerationStarted(job_id=ev.JobId(job), generation=gen, first_step=kw.get("step", 0), **base)
        elif cls is ev.CheckpointCommitted:
            step = kw.get("step", 10)
            url = kw.get("url", f"{self.ctx.roots.get(job, 'file:///x').rstrip('/')}/step_{step:09d}")
            m = ev.CheckpointCommitted(job_id=ev.JobId(job), generation=gen, step=step,
                                       checkpoint_id=f"step_{step:09d}", url=url, save_s=0.2, emergency=True, **base)
        else:
            m = ev.RanksExited(job_id=ev.JobId(job), generation=gen, exit_code=0, reason=kw.get("reason", "completed"),
                               last_step=kw.get("step", 10**6), **base)
        return msgspec.to_builtins(m)

    def foreign_job(self) -> tuple[str, str, dict]:
        r, c = self.rng, self.ctx
        s = self._sender()
        others = sorted({j for j in c.generation if j != c.job_of[s]}) or [f"no-such-job-{self.n}"]
        job = r.choice(others)
        gen = c.generation.get(job, 1)
        if r.random() < 0.25:
            hb = ev.Heartbeat(node_id=ev.NodeId(s), seq=1, ts=time.time(), state=ev.AgentState.TRAINING,
                              job_id=ev.JobId(job), generation=gen, step=10**6)
            return "heartbeat", ev.subject_heartbeat(s), msgspec.to_builtins(hb)
        cls = r.choice((ev.GenerationStarted, ev.CheckpointCommitted, ev.RanksExited))
        return "node_event", ev.subject_node_event(s), self._event(cls, s, job, gen, step=10**5)

    def old_generation(self) -> tuple[str, str, dict] | None:
        r, c = self.rng, self.ctx
        s = self._sender()
        job, cur = c.job_of[s], c.generation.get(c.job_of[s], 0)
        gen = r.randint(1, cur - 1) if cur > 1 else (cur + r.randint(5, 50) if r.random() < 0.5 else None)
        if gen is None:
            return None
        cls = r.choice((ev.GenerationStarted, ev.CheckpointCommitted, ev.RanksExited))
        reason = r.choice(("completed", "failed", "emergency_checkpoint"))
        return "node_event", ev.subject_node_event(s), self._event(cls, s, job, gen, step=10**5, reason=reason)

    def replay(self) -> tuple[str, str, dict] | None:
        c = self.ctx
        stale = [e for e in c.events if getattr(e, "job_id", None) in c.terminal
                 or (getattr(e, "generation", None) is not None and e.generation < c.generation.get(e.job_id, 0))
                 or (isinstance(e, ev.NodeRegistered) and str(e.node_id) not in c.live)]
        if not stale:
            return None
        e = self.rng.choice(stale)
        d = msgspec.to_builtins(e)
        if self.rng.random() < 0.5:
            d["id"] = self._id()  # past the core's event-id memory: only the generation/phase can refuse it
        subject = ev.subject_notice("fake", e.node_id) if isinstance(e, ev.PreemptionNotice) \
            else ev.subject_node_event(e.node_id)
        return ("notice" if isinstance(e, ev.PreemptionNotice) else "node_event"), subject, d

    def foreign_instance(self) -> tuple[str, str, dict] | None:
        c = self.ctx
        s = self._sender()
        victims = sorted(n for n in c.instance_of if n != s)
        if not victims:
            return None
        inst, pool = c.instance_of[self.rng.choice(victims)]
        m = ev.NodeRegistered(id=self._id(), node_id=ev.NodeId(s), instance_id=ev.InstanceId(inst), pool=pool,
                              agent_version="evil", host="6.6.6.6", ts=time.time())
        return "node_event", ev.subject_node_event(s), msgspec.to_builtins(m)

    def ckpt_outside_root(self) -> tuple[str, str, dict]:
        r, c = self.rng, self.ctx
        s = self._sender()
        job = c.job_of[s]
        root = c.roots.get(job, "file:///tmp/x").rstrip("/")
        others = [u for j, u in c.roots.items() if j != job] or ["file:///tmp/other"]
        url = r.choice((f"{r.choice(others).rstrip('/')}/step_000000010", f"{root}/../../etc/step_000000010",
                        "file:///etc/passwd", "s3://attacker-bucket/step_000000010", f"{root}x/step_000000010",
                        "http://169.254.169.254/latest/meta-data", ""))
        gen = max(1, c.generation.get(job, 1))
        return "node_event", ev.subject_node_event(s), self._event(ev.CheckpointCommitted, s, job, gen, step=10,
                                                                   url=url)

    def dead_notice(self) -> tuple[str, str, dict] | None:
        c = self.ctx
        dead = sorted((set(c.instance_of) - c.live) | c.noticed)
        if not dead:
            return None
        node = self.rng.choice(dead)
        m = ev.PreemptionNotice(id=self._id(), node_id=ev.NodeId(node), cloud="fake", observed_ts=time.time(),
                                deadline_ts=self.rng.choice((*EXTREME_FLOATS, 0.0, time.time() + 10**9)))
        d = msgspec.to_builtins(m)
        d["observed_ts"] = self.rng.choice((*EXTREME_FLOATS, d["observed_ts"]))
        return "notice", ev.subject_notice("fake", node), d

    def extreme_price(self) -> tuple[str, str, dict]:
        r = self.rng
        pool, usd, od = r.choice(PRICES)
        d = msgspec.to_builtins(ev.PriceTick(id=self._id(), pool=pool, gpu_type="A100", gpus_per_node=1,
                                             price_usd_h=usd, on_demand_usd_h=od, ts=time.time()))
        key = r.choice([k for k in ("price_usd_h", "on_demand_usd_h", "capacity_hint", "ts", "gpus_per_node")
                        if f"price.{k}" not in self.skip])
        d[key] = r.choice(EXTREME_INTS if key == "gpus_per_node" else EXTREME_FLOATS)
        return "price", ev.subject_price(pool.cloud, pool.region), d

    # --- structures ------------------------------------------------------------------------------

    def wrap(self, d: dict, wrapper: str, target: str) -> bytes:
        r = self.rng
        keys = [k for k in d if k not in ("type", "v")]
        if wrapper == "extreme":
            nums = [k for k in keys if isinstance(d[k], int | float) and not isinstance(d[k], bool)]
            if nums:
                k = r.choice(nums)
                d[k] = r.choice(EXTREME_INTS if isinstance(d[k], int) else EXTREME_FLOATS)
            return msgspec.json.encode(d)
        if wrapper == "unknown_fields":
            d.update({"evil": {"x": [1, 2]}, "fencing_token_override": 2**62, "admin": True, "__proto__": {}})
            return msgspec.json.encode(d)
        body = msgspec.json.encode(d)
        if wrapper in ("deep_nest", "huge_array"):
            k = r.choice(keys)
            return _set_raw(d, k, NEST if wrapper == "deep_nest" else HUGE_ARRAY)
        if wrapper == "duplicate_keys":
            k = r.choice([x for x in ("node_id", "job_id", "type", "v", "generation", "instance_id") if x in d]
                         or keys)
            value = r.choice((b'"' + r.choice(sorted(self.ctx.job_of)).encode() + b'"', b"2", b'"price_tick"',
                              b"null", NEST[:20] + b"]" * 10))
            return body[:-1] + b',"' + k.encode() + b'":' + value + b"}"
        return body

    # --- admin -----------------------------------------------------------------------------------

    def admin(self) -> Shot:
        r, c = self.rng, self.ctx
        (resource, verb), (req_type, _) = r.choice(list(ev.ADMIN_ENDPOINTS.items()))
        subject = ev.admin_subject(resource, verb)
        read_only = (resource, verb) in READ_ONLY
        d: dict[str, Any] = {"v": 1}
        for f in msgspec.structs.fields(req_type):
            if f.name == "job_id":
                d["job_id"] = r.choice(sorted(c.generation))
            elif f.name == "node_id":
                d["node_id"] = r.choice(sorted(c.job_of))
        if (resource, verb) == ("jobs", "submit"):
            return self._admin_submit(subject)
        keys = [k for k in d if k != "v"] or ["v"]
        how = r.choice(("deep_nest", "huge_array", "duplicate_keys", "whole_nest", "extreme")
                       + (("unknown_fields",) if read_only else ()))
        if how == "whole_nest":
            data = NEST
        elif how in ("deep_nest", "huge_array"):
            data = _set_raw(d, r.choice(keys), NEST if how == "deep_nest" else HUGE_ARRAY)
        elif how == "duplicate_keys":  # the hostile value last: never a valid mutating request
            k = r.choice(keys)
            data = msgspec.json.encode(d)[:-1] + b',"' + k.encode() + b'":' + r.choice((b"[1,2]", b"{}", b"1e308"))
            data += b"}"
        elif how == "extreme":  # on a mutating endpoint only where it invalidates the request (or names no id)
            names = [f.name for f in msgspec.structs.fields(req_type)
                     if read_only or f.name in ("v", "job_id", "node_id", "seq", "dry_run")]
            d[r.choice(names)] = r.choice(EXTREME_FLOATS + EXTREME_INTS)
            data = msgspec.json.encode(d)
        else:
            d.update({"evil": [1] * 10, "__proto__": {"admin": True}})
            data = msgspec.json.encode(d)
        return Shot(f"admin_{how}/{resource}.{verb}", "admin", subject, data)

    def _admin_submit(self, subject: str) -> Shot:
        """A submit with one extreme value in an otherwise valid spec (a fresh job id: accepting it would
        launch), or an existing job's id with another spec (a reference to another job)."""
        r, c = self.rng, self.ctx
        spec = msgspec.to_builtins(job_spec("adv", nodes=1, total_steps=50))
        if (r.random() < 0.3 or "admin_extreme_spec" in self.skip) and c.generation:
            spec["nodes"] = spec["nodes_max"] = 2
            spec["total_steps"] = 7
            return Shot("admin_other_job/jobs.submit", "admin", subject,
                        msgspec.json.encode({"v": 1, "spec": spec, "job_id": r.choice(sorted(c.generation))}))
        key = r.choice(("total_steps", "step_time_s_estimate", "gpus_per_node", "nodes", "nodes_min", "nodes_max",
                        "deadline_ts", "budget_usd", "checkpoint.interval_s", "checkpoint.save_s_estimate"))
        target = spec
        if "." in key:
            outer, key = key.split(".")
            target = spec[outer]
        is_int = key in ("total_steps", "gpus_per_node", "nodes", "nodes_min", "nodes_max")
        target[key] = r.choice(EXTREME_INTS if is_int else EXTREME_FLOATS)
        body = {"v": 1, "spec": spec, "job_id": f"adv-{self.tag}-job-{self._id()}"}
        return Shot(f"admin_extreme_spec/jobs.submit.{key}", "admin", subject, msgspec.json.encode(body))


def _set_raw(d: dict, key: str, raw: bytes) -> bytes:
    """``d`` as JSON with ``key``'s value replaced by the raw JSON text ``raw``."""
    marker = "@@RAW@@"
    d = {**d, key: marker}
    return msgspec.json.encode(d).replace(b'"' + marker.encode() + b'"', raw, 1)
