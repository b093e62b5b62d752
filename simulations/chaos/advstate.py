"""The adversarial drill's state comparison: the final state as a fresh process loads it, normalised so
that two runs of one scenario compare equal unless an attack changed something (docs/chaos.md section 4).

Role: ``load_fresh(url)`` runs ``python -m simulations.chaos.adversarial --load URL`` (``load`` there:
``Store.load`` + ``state_from_records`` on a stopped daemon's KV); ``normalise`` drops what differs between
two runs of one scenario; ``diff`` lists the paths where two normalised states differ.

Concurrency contract: ``load_fresh`` blocks (call it through ``anyio.to_thread``); the rest is pure.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import msgspec

from simulations.chaos.harness import ROOT

DROP = {"phase_ts", "submitted_ts", "gen_ts", "committed_ts", "cost_usd", "save_s", "step_time_s", "ckpt_interval_s",
        "price_eval_ts", "migrate_ts", "requested_ts", "launched_ts", "last_seen", "hb_seq", "loss", "cmd_seq",
        "price_ts", "cum_usd", "cum_ts", "exposure_h", "stats_ts", "changed_ts", "detect_paused_until"}
"""Timestamps, liveness, measured times and cost integrals: they differ between two runs of one scenario."""
PRESENCE = {"notice_deadline", "suspect_since", "noticed_until", "last_preempted_ts", "backoff_until"}
"""Times compared only as set / not set."""


async def load(url: str) -> dict:
    import nats  # the daemon's own load path, in this (fresh) process

    from orchestrator.bus import ensure_topology
    from orchestrator.core.records import state_from_records
    from orchestrator.daemon.store import Store

    nc = await nats.connect(url)
    try:
        records, _ = await Store(await ensure_topology(nc)).load(timeout_s=5.0)
    finally:
        await nc.close()
    st = state_from_records(records)
    return {"jobs": {k: msgspec.to_builtins(v) for k, v in st.jobs.items()},
            "nodes": {k: msgspec.to_builtins(v) for k, v in st.nodes.items()},
            "pools": {k: msgspec.to_builtins(v) for k, v in st.pools.items()},
            "meta": msgspec.to_builtins(st.meta)}


def load_fresh(url: str) -> dict | None:
    """The state as a fresh process loads it; None when that process fails."""
    p = subprocess.run([sys.executable, "-m", "simulations.chaos.adversarial", "--load", url], cwd=ROOT,
                       capture_output=True, timeout=60)
    if p.returncode != 0:
        return None
    out: dict = json.loads(p.stdout)
    return out


def normalise(state: dict, legit_ckpts: set[tuple[str, str]], instances: dict[str, str],
              live_jobs: set[str] | frozenset[str] = frozenset()) -> dict:
    """Drop what differs between two runs of one scenario; a checkpoint a legitimate agent of *this* run
    committed becomes ``<legit>`` (its step depends on timing), an instance the cloud launched for that
    very node ``<own>``. Anything else (another job's checkpoint, a foreign instance) stays as it is. A job of
    ``live_jobs`` (cancelled while training) loses its ``step``: progress at the moment it stopped."""
    def clean(rec: dict) -> dict:
        out = {}
        for k, v in rec.items():
            if k in DROP:
                continue
            out[k] = bool(v) if k in PRESENCE else (round(v, 2) if k == "preemptions" else v)
        return out

    jobs = {}
    for jid, j in state["jobs"].items():
        j = clean(j)
        if jid in live_jobs:
            j.pop("step", None)
        if (jid, j.get("committed_url")) in legit_ckpts:
            j["committed_url"] = j["committed_step"] = "<legit>"
        jobs[jid] = j
    nodes = {}
    for nid, n in state["nodes"].items():
        n = clean(n)
        n.pop("step", None)  # live progress
        if n.get("instance_id") and instances.get(n["instance_id"]) == nid:
            n["instance_id"] = "<own>"
        nodes[nid] = n
    return {"jobs": jobs, "nodes": nodes, "pools": {k: clean(p) for k, p in state["pools"].items()},
            "meta": clean(state["meta"])}


def _extremes(v: Any, path: str = "") -> list[str]:
    """Paths of extreme numbers in a record (what made an accepted hostile record hostile)."""
    if isinstance(v, dict):
        return [p for k, x in v.items() for p in _extremes(x, f"{path}.{k}")]
    if isinstance(v, int | float) and not isinstance(v, bool) and (abs(v) >= 1e15 or 0 < abs(v) < 1e-300):
        return [f"{path}={v!r}"]
    return []


def diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += diff(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{path}.{k}")
        return out
    if a == "<absent>" and isinstance(b, dict):
        return [f"{path}: new {', '.join(_extremes(b)) or 'record'}"[:300]]
    return [] if a == b else [f"{path}: {a!r} -> {b!r}"[:300]]
