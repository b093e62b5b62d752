"""Hostile names for the adversarial drill (``hostile.py``): every name field of every record and admin body.

Role: ``BadNames(rng, ctx, fresh_id).next()`` builds one message from a real sender (a node's own event,
heartbeat and log subjects, a gone node's notice subject, the price feed, an admin client) whose one name
field holds a string that is neither a token nor a dotted key (``wire.names``):

    node_event   node_id, job_id, instance_id, pool.cloud / region / zone / instance_type
    heartbeat    node_id, job_id
    notice       node_id, cloud (on the subject of a node already noticed or gone)
    price        pool.cloud / region / zone / instance_type (on the feed's real subject)
    log          line, job_id, node_id, stream (on the sender's own ``orch.logs.<job>.<node>``)
    admin        job_id / node_id of every verb that takes one; ``jobs.submit``: the job id, an entry of
                 clouds / regions / zones / instance_types, sweep_id, tracking.server / uri / experiment /
                 run_name (a fresh valid job id otherwise: such a submit must be refused for the name)

The subject is always a real one (a subject with white space or a wildcard is not even deliverable): the
hostile string is in the payload. ``NAMES`` are the strings (``label -> string``): white space, ``..``, a
leading or trailing dot, wildcards, non-ASCII, control characters, 5,000 characters, empty; a token field
also gets a dotted name. ``used`` counts them by label.

Pure: builds bytes, sends nothing.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec

import wire as ev
from simulations.chaos.harness import PRICES, job_spec

NAMES: dict[str, str] = {
    "space": "gpu evil", "tab": "gpu\tx", "newline": "gpu\nx", "double_dot": "gpu..x", "leading_dot": ".gpu",
    "trailing_dot": "gpu.", "star": "*", "gt": ">", "wildcard_key": "orch.*.>", "non_ascii": "gpü-ä",
    "cjk": "节点", "nul": "gpu\x00x", "escape": "\x1b[31mx", "del": "gpu\x7f", "long_5000": "x" * 5000,
    "empty": "",
}
"""Neither a token nor a dotted key (``wire.names``)."""
DOTTED = ("dotted", "gpu.small")
"""A dotted key: a fine instance type, never a token (job, node, cloud, region, zone, sweep)."""
TRACKING_URIS = {"metadata": "http://169.254.169.254/latest/meta-data", "credentials": "http://u:pw@evil.example/",
                 "file": "file:///etc/passwd", "space_host": "http://evil host/"}
"""Besides ``NAMES``: tracking URIs orchd must never contact (its config lists no such server)."""
TOKEN_FIELDS = {"node_id", "job_id", "cloud", "region", "zone", "sweep_id", "clouds", "regions", "zones"}
ID_VERBS = {("jobs", "show"): "job_id", ("jobs", "explain"): "job_id", ("jobs", "cancel"): "job_id",
            ("nodes", "list"): "job_id", ("nodes", "drain"): "node_id", ("nodes", "preempt"): "node_id",
            ("nodes", "kill"): "node_id"}
"""Admin verbs that take a job or node id (a hostile one names nothing: never a valid mutation)."""
SUBMIT_FIELDS = ("job_id", "clouds", "regions", "zones", "instance_types", "sweep_id", "tracking.server",
                 "tracking.uri", "tracking.experiment", "tracking.run_name")


class BadNames:
    """One hostile-name message at a time; ``ctx`` (a ``hostile.Ctx``) says which senders are real."""

    def __init__(self, rng: random.Random, ctx: Any, fresh_id: Callable[[], str]) -> None:
        self.rng, self.ctx, self.fresh_id = rng, ctx, fresh_id
        self.used: Counter[str] = Counter()

    def name(self, field: str) -> str:
        pool = list(NAMES.items()) + ([DOTTED] if field.rsplit(".", 1)[-1] in TOKEN_FIELDS else [])
        if field == "tracking.uri":
            pool += list(TRACKING_URIS.items())
        label, value = self.rng.choice(pool)
        self.used[label] += 1
        return value

    def next(self) -> tuple[str, str, str, bytes]:
        """(field, target, subject, data); ``field`` is ``<target>.<field>`` (``admin.<resource>.<verb>.<field>``)."""
        target = self.rng.choice(("node_event", "node_event", "heartbeat", "notice", "price", "log", "admin", "admin"))
        if target == "notice" and not self._gone():
            target = "node_event"
        field, subject, d = getattr(self, target)()
        return f"{target}.{field}", "admin" if target == "admin" else target, subject, msgspec.json.encode(d)

    # --- records ----------------------------------------------------------------------------------

    def _sender(self) -> str:
        return self.rng.choice(sorted(self.ctx.job_of))

    def _gone(self) -> list[str]:
        return sorted((set(self.ctx.instance_of) - self.ctx.live) | self.ctx.noticed)

    def node_event(self) -> tuple[str, str, dict]:
        r, c = self.rng, self.ctx
        s = self._sender()
        job = c.job_of[s]
        field = r.choice(("node_id", "job_id", "instance_id", "pool.cloud", "pool.region", "pool.zone",
                          "pool.instance_type"))
        if field == "job_id" or (field == "node_id" and r.random() < 0.5):
            gen = max(1, c.generation.get(job, 1))
            m: Any = r.choice((
                ev.GenerationStarted(id=self.fresh_id(), node_id=ev.NodeId(s), job_id=ev.JobId(job), generation=gen,
                                     first_step=0, ts=time.time()),
                ev.RanksExited(id=self.fresh_id(), node_id=ev.NodeId(s), job_id=ev.JobId(job), generation=gen,
                               exit_code=0, reason="completed", last_step=10**6, ts=time.time())))
            d = msgspec.to_builtins(m)
            d[field] = self.name(field)
            return field, ev.subject_node_event(s), d
        inst, pool = c.instance_of.get(s, ("fake-none", PRICES[0][0]))
        m = ev.NodeRegistered(id=self.fresh_id(), node_id=ev.NodeId(s), instance_id=ev.InstanceId(inst), pool=pool,
                              agent_version="evil", host="6.6.6.6", ts=time.time())
        d = msgspec.to_builtins(m)
        if field.startswith("pool."):
            d["pool"][field[5:]] = self.name(field[5:])
        else:
            d[field] = self.name(field)
        return field, ev.subject_node_event(s), d

    def heartbeat(self) -> tuple[str, str, dict]:
        s = self._sender()
        field = self.rng.choice(("node_id", "job_id"))
        job = self.ctx.job_of[s]
        hb = ev.Heartbeat(node_id=ev.NodeId(s), seq=1, ts=time.time(), state=ev.AgentState.TRAINING,
                          job_id=ev.JobId(job), generation=self.ctx.generation.get(job, 1), step=10**6)
        d = msgspec.to_builtins(hb)
        d[field] = self.name(field)
        return field, ev.subject_heartbeat(s), d

    def notice(self) -> tuple[str, str, dict]:
        node = self.rng.choice(self._gone())
        field = self.rng.choice(("node_id", "cloud"))
        m = ev.PreemptionNotice(id=self.fresh_id(), node_id=ev.NodeId(node), cloud="fake", observed_ts=time.time(),
                                deadline_ts=time.time() + 120)
        d = msgspec.to_builtins(m)
        d[field] = self.name(field)
        return field, ev.subject_notice("fake", node), d

    def price(self) -> tuple[str, str, dict]:
        pool, usd, od = self.rng.choice(PRICES)
        d = msgspec.to_builtins(ev.PriceTick(id=self.fresh_id(), pool=pool, gpu_type="A100", gpus_per_node=1,
                                             price_usd_h=usd * 0.5, on_demand_usd_h=od, ts=time.time()))
        part = self.rng.choice(("cloud", "region", "zone", "instance_type"))
        d["pool"][part] = self.name(part)
        return f"pool.{part}", ev.subject_price(pool.cloud, pool.region), d

    def log(self) -> tuple[str, str, dict]:
        s = self._sender()
        job = self.ctx.job_of[s]
        field = self.rng.choice(("line", "line", "job_id", "node_id", "stream"))
        d = msgspec.to_builtins(ev.LogLine(job_id=ev.JobId(job), node_id=ev.NodeId(s), generation=1, rank=0,
                                           seq=self.rng.randint(1, 10**6), line="step 1", ts=time.time()))
        d[field] = self.name(field)
        return field, ev.subject_logs(job, s), d

    # --- admin ------------------------------------------------------------------------------------

    def admin(self) -> tuple[str, str, dict]:
        if self.rng.random() < 0.5:
            return self.submit()
        (resource, verb), key = self.rng.choice(sorted(ID_VERBS.items()))
        d = {"v": 1, key: self.name(key)}
        return f"{resource}.{verb}.{key}", ev.admin_subject(resource, verb), d

    def submit(self) -> tuple[str, str, dict]:
        """A submit that must be refused for its one hostile name: a fresh valid job id otherwise."""
        field = self.rng.choice(SUBMIT_FIELDS)
        spec = msgspec.to_builtins(job_spec("adv", nodes=1, total_steps=50))
        job_id = f"adv-names-{self.fresh_id()}"
        if field == "job_id":
            job_id = self.name(field)
        elif field.startswith("tracking."):
            key = field.split(".", 1)[1]
            spec["tracking"] = {"experiment": "adv", key: self.name(field)}
        else:
            spec[field] = [*spec.get(field, ()), self.name(field)]
        return f"jobs.submit.{field}", ev.admin_subject("jobs", "submit"), {"v": 1, "spec": spec, "job_id": job_id}
