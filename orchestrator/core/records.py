"""Persistence records: one msgspec-JSON value per key, and the exact inverse.

Keys: ``job.<job_id>``, ``node.<node_id>``, ``pool.<pool name with / replaced by _>``, ``meta``.
``Decision.dirty`` names the keys a decision changed; ``state_to_records(state, dirty)`` gives their new
values, with ``b""`` for a record that no longer exists (the shell deletes that key).
``state_from_records(state_to_records(s)) == s`` for every state: a restarted daemon continues exactly.

Non-finite floats: JSON has none (msgspec writes inf/nan as ``null``, which a non-optional float field
then refuses to load: one such value would brick every restart). ``state_to_records`` therefore raises
``NonFiniteRecord`` instead of encoding one, and ``Tx.decision`` runs the same check
(``check_records``) on every record a decision wrote, so a decision that would carry one raises inside
``decide`` - the shell skips that event as a core error and keeps the previous state - and such a value
can never reach the state, the KV store or a restart.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from functools import cache

import immutables
import msgspec
import msgspec.inspect as mi

from orchestrator.core.model import Job, Meta, Node, PoolStats, pool_record_key
from orchestrator.core.state import State
from orchestrator.core.timers import build as build_timers

_enc = msgspec.json.Encoder()
_dec_job = msgspec.json.Decoder(Job)
_dec_node = msgspec.json.Decoder(Node)
_dec_pool = msgspec.json.Decoder(PoolStats)
_dec_meta = msgspec.json.Decoder(Meta)


class NonFiniteRecord(ValueError):
    """A record would carry inf or nan in a float field: a bug upstream (an unbounded input or an
    overflow), refused before it can be persisted."""


def _has_float(t: mi.Type, seen: frozenset[type]) -> bool:
    if isinstance(t, mi.FloatType):
        return True
    if isinstance(t, mi.StructType):
        return t.cls not in seen and any(_has_float(f.type, seen | {t.cls}) for f in t.fields)
    if isinstance(t, mi.UnionType):
        return any(_has_float(x, seen) for x in t.types)
    if isinstance(t, mi.TupleType):
        return any(_has_float(x, seen) for x in t.item_types)
    if isinstance(t, (mi.VarTupleType, mi.ListType, mi.SetType, mi.FrozenSetType)):
        return _has_float(t.item_type, seen)
    if isinstance(t, mi.DictType):
        return _has_float(t.value_type, seen)
    return isinstance(t, mi.AnyType)


@cache
def _float_fields(cls: type[msgspec.Struct]) -> tuple[str, ...]:
    """The fields of ``cls`` whose values can hold a float (directly or nested)."""
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return tuple(f.name for f in info.fields if _has_float(f.type, frozenset({cls})))


def _non_finite(value: object, path: str) -> tuple[str, float] | None:
    """(path, value) of the first inf/nan float inside ``value``, or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, value)
    if isinstance(value, msgspec.Struct):
        for name in _float_fields(type(value)):
            bad = _non_finite(getattr(value, name), f"{path}.{name}")
            if bad is not None:
                return bad
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            bad = _non_finite(item, f"{path}[{i}]")
            if bad is not None:
                return bad
    elif isinstance(value, dict):
        for k, item in value.items():
            bad = _non_finite(item, f"{path}[{k!r}]")
            if bad is not None:
                return bad
    return None


def check_finite(key: str, rec: msgspec.Struct) -> None:
    """Raise ``NonFiniteRecord`` when the record for ``key`` holds inf or nan anywhere."""
    if _finite_since(rec, None):
        return
    bad = _non_finite(rec, key)
    if bad is not None:
        raise NonFiniteRecord(f"non-finite float {bad[1]!r} at {bad[0]}: refused (JSON cannot carry it)")


_Found = tuple[msgspec.Struct | None, dict[str, str] | None]


def _record(state: State, key: str, pool_index: dict[str, str] | None) -> _Found:
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
    return rec, pool_index


def _finite_since(value: object, old: object) -> bool:
    """No inf/nan in ``value``, skipping what it shares (by identity) with ``old``, a record already
    checked: fast, no paths (``_non_finite`` finds the path once this says there is one)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, msgspec.Struct):
        same_type = type(old) is type(value)
        for name in _float_fields(type(value)):
            v = getattr(value, name)
            if same_type and v is getattr(old, name):
                continue
            if not _finite_since(v, None):
                return False
        return True
    if isinstance(value, (tuple, list)):
        return all(_finite_since(item, None) for item in value)
    if isinstance(value, dict):
        return all(_finite_since(item, None) for item in value.values())
    return True


_POOL_NAMES: dict[str, str] = {}  # pool record key -> pool name, a memo of names seen (pure: names are stable)


def _pool_by_key(state: State, key: str) -> PoolStats | None:
    name = _POOL_NAMES.get(key)
    if name is None or name not in state.pools or pool_record_key(name) != key:
        _POOL_NAMES.update(_pool_index(state))
        name = _POOL_NAMES.get(key)
    return state.pools.get(name) if name is not None else None


def _lookup(state: State, key: str) -> msgspec.Struct | None:
    kind, _, ident = key.partition(".")
    if key == "meta":
        return state.meta
    if kind == "job":
        return state.jobs.get(ident)
    if kind == "node":
        return state.nodes.get(ident)
    return _pool_by_key(state, key) if kind == "pool" else None


def check_records(state: State, keys: Iterable[str], before: State | None = None) -> None:
    """``check_finite`` on the records of ``keys`` (those that exist): what ``Tx.decision`` runs on the
    records a decision wrote. ``before``: the state they were derived from, whose records were checked
    when written (or decoded from JSON, which has no inf/nan): parts they share are not walked again."""
    for key in keys:
        rec = _lookup(state, key)
        if rec is not None and not _finite_since(rec, _lookup(before, key) if before is not None else None):
            check_finite(key, rec)


def all_keys(state: State) -> list[str]:
    keys = ["meta"]
    keys.extend("job." + j for j in state.jobs)
    keys.extend("node." + n for n in state.nodes)
    keys.extend(pool_record_key(p) for p in state.pools)
    return keys


def _pool_index(state: State) -> dict[str, str]:
    return {pool_record_key(name): name for name in state.pools}


def state_to_records(state: State, keys: Iterable[str] | None = None) -> dict[str, bytes]:
    """msgspec JSON per key (every record when ``keys`` is None); ``b""`` for a key with no record.
    Raises ``NonFiniteRecord`` rather than encode inf/nan (JSON would carry ``null``)."""
    if keys is None:
        keys = all_keys(state)
    out: dict[str, bytes] = {}
    pool_index: dict[str, str] | None = None
    for key in keys:
        rec, pool_index = _record(state, key, pool_index)
        if rec is None:
            out[key] = b""
            continue
        check_finite(key, rec)
        out[key] = _enc.encode(rec)
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
    jm, nm, pm = jobs.finish(), nodes.finish(), pools.finish()
    return State(jm, nm, pm, meta, build_timers(jm, nm))
