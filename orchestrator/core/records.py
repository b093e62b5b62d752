"""Persistence records: one msgspec-JSON value per key, and the exact inverse.

Keys: ``job.<job_id>``, ``node.<node_id>``, ``pool.<pool name with / replaced by _>``, ``meta``.
``Decision.dirty`` names the keys a decision changed; ``state_to_records(state, dirty)`` gives their new
values, with ``b""`` for a record that no longer exists (the shell deletes that key).
``state_from_records(state_to_records(s)) == s`` for every state: a restarted daemon continues exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import immutables
import msgspec

from orchestrator.core.model import Job, Meta, Node, PoolStats, State, pool_record_key

_enc = msgspec.json.Encoder()
_dec_job = msgspec.json.Decoder(Job)
_dec_node = msgspec.json.Decoder(Node)
_dec_pool = msgspec.json.Decoder(PoolStats)
_dec_meta = msgspec.json.Decoder(Meta)


def all_keys(state: State) -> list[str]:
    keys = ["meta"]
    keys.extend("job." + j for j in state.jobs)
    keys.extend("node." + n for n in state.nodes)
    keys.extend(pool_record_key(p) for p in state.pools)
    return keys


def _pool_index(state: State) -> dict[str, str]:
    return {pool_record_key(name): name for name in state.pools}


def state_to_records(state: State, keys: Iterable[str] | None = None) -> dict[str, bytes]:
    """msgspec JSON per key (every record when ``keys`` is None); ``b""`` for a key with no record."""
    if keys is None:
        keys = all_keys(state)
    out: dict[str, bytes] = {}
    pool_index: dict[str, str] | None = None
    for key in keys:
        kind, _, ident = key.partition(".")
        rec: msgspec.Struct | None
        if key == "meta":
            rec = state.meta
        elif kind == "job":
            rec = state.jobs.get(ident)
        elif kind == "node":
            rec = state.nodes.get(ident)
        elif kind == "pool":
            if pool_index is None:
                pool_index = _pool_index(state)
            name = pool_index.get(key)
            rec = state.pools.get(name) if name is not None else None
        else:
            rec = None
        out[key] = _enc.encode(rec) if rec is not None else b""
    return out


def state_from_records(records: Mapping[str, bytes]) -> State:
    """Rebuild the State from its records (empty values are deleted records and are skipped)."""
    meta = Meta()
    empty_jobs: immutables.Map[str, Job] = immutables.Map()
    empty_nodes: immutables.Map[str, Node] = immutables.Map()
    empty_pools: immutables.Map[str, PoolStats] = immutables.Map()
    jobs, nodes, pools = empty_jobs.mutate(), empty_nodes.mutate(), empty_pools.mutate()
    for key, data in records.items():
        if not data:
            continue
        kind = key.partition(".")[0]
        if key == "meta":
            meta = _dec_meta.decode(data)
        elif kind == "job":
            job = _dec_job.decode(data)
            jobs[job.job_id] = job
        elif kind == "node":
            node = _dec_node.decode(data)
            nodes[node.node_id] = node
        elif kind == "pool":
            ps = _dec_pool.decode(data)
            pools[ps.pool.name] = ps
    return State(jobs.finish(), nodes.finish(), pools.finish(), meta)
