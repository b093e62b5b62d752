"""The fake cloud: an in-memory ``CloudProvider`` for tests, chaos drills and benchmarks.

Not part of the production packages: orchd loads it as a provider plugin (``[providers] enabled =
["fake"]``, see orchestrator/daemon/registry.py) through ``from_settings``. With ``[providers.fake]
state_file = "..."`` it is a ``FileFakeCloud`` whose instances and idempotency tokens are kept in that
JSON file and a journal beside it (one line per call), so they survive a restart of orchd (the kill -9
drills count duplicates on the cloud side, from the files with ``read_fake_file``). Optional
``prices = [{pool..., price_usd_h, on_demand_usd_h}]``.

Its pools (``pools()``, what orchd may launch: registry.known_instance_types): the list it was built with
(``pools=``), else its catalog - every instance type of ``CATALOG_TYPES`` in region ``r1`` (zones
``r1a``-``r1c``), spot and on-demand - plus the pools of its configured ``prices``. An instance type
outside them is never a launch target, however it is quoted.

Role: a `CloudProvider` that behaves like a cloud at the API edge: it enforces idempotency tokens (the
same token twice returns the first call's instances), fulfils launches partially when capacity is
short, can inject capacity errors and transient failures per pool, and can preempt instances. Leaks and
duplicates are counted by listing it, never from orchd's state.

Concurrency contract: thread-safe (one lock); calls are cheap and never block.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import structlog

from providers.base import (
    TAG_CLUSTER,
    CapacityError,
    Instance,
    InstanceState,
    LaunchRequest,
    LaunchResult,
    PriceQuote,
    ProviderError,
    TransientError,
    check_owned,
    raise_refused,
)
from wire import FailureReason, InstanceId, Market, NodeId, PoolKey
from wire.config import load_checked

log = structlog.get_logger("orch.simulations.fakecloud")

CATALOG_TYPES = ("gpu.small", "gpu.alt", "gpu.a", "gpu.x1")
"""The instance types the fake cloud offers when it is built without a pool list."""
CATALOG_ZONES = ("r1a", "r1b", "r1c")

__all__ = ["FakeCloud", "FakeConfig", "FileFakeCloud", "TransientError", "from_settings", "journal_path",
           "load_fake_file", "read_fake_file"]


class FakeCloud:
    """A fake cloud. ``capacity[pool]`` limits live instances per pool (None = unlimited)."""

    def __init__(
        self,
        cloud: str = "fake",
        *,
        clock: Callable[[], float] | None = None,
        gpu_type: str = "A100",
        gpus_per_node: int = 1,
        pools: Sequence[PoolKey] | None = None,
    ) -> None:
        self.cloud = cloud
        # what it offers, like a real provider's catalog: only these pools are launchable (module doc)
        self._listed = tuple(pools) if pools is not None else None
        self._clock = clock or time.time
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._instances: dict[InstanceId, Instance] = {}
        self._by_token: dict[str, tuple[InstanceId, ...]] = {}
        self.capacity: dict[PoolKey, int | None] = {}
        self.prices_usd_h: dict[PoolKey, float] = {}
        self.on_demand_usd_h: dict[tuple[str, str], float] = {}  # (region, instance_type) -> price
        self.gpu_type = gpu_type
        self.gpus_per_node = gpus_per_node
        self._fail_next: dict[PoolKey, list[type[ProviderError]]] = {}
        self.launch_calls = 0
        self.terminate_calls = 0

    def pools(self) -> list[PoolKey]:
        if self._listed is not None:
            return list(self._listed)
        catalog = [PoolKey(cloud=self.cloud, region="r1", zone=z, instance_type=t, market=m)
                   for t in CATALOG_TYPES for z in CATALOG_ZONES for m in (Market.SPOT, Market.ON_DEMAND)]
        with self._lock:
            priced = [p for p in self.prices_usd_h if p not in catalog]
        return catalog + priced

    # --- fault injection -------------------------------------------------------------------------

    def fail_next(self, pool: PoolKey, error: type[ProviderError] = CapacityError, times: int = 1) -> None:
        """The next ``times`` launches in ``pool`` raise ``error`` (then launches work again)."""
        with self._lock:
            self._fail_next.setdefault(pool, []).extend([error] * times)

    def set_price(self, pool: PoolKey, price_usd_h: float, on_demand_usd_h: float | None = None) -> None:
        with self._lock:
            self.prices_usd_h[pool] = price_usd_h
            if on_demand_usd_h is not None:
                self.on_demand_usd_h[(pool.region, pool.instance_type)] = on_demand_usd_h

    def preempt(self, instance_id: InstanceId) -> Instance:
        """The cloud reclaims an instance (after its notice, or without one)."""
        with self._lock:
            inst = self._instances[instance_id]
            dead = _with_state(inst, InstanceState.TERMINATED)
            self._instances[instance_id] = dead
            return dead

    # --- CloudProvider ---------------------------------------------------------------------------

    def launch(self, request: LaunchRequest) -> LaunchResult:
        with self._lock:
            self.launch_calls += 1
            existing = self._by_token.get(request.idempotency_token)
            if existing is not None:
                return LaunchResult(instances=tuple(self._instances[i] for i in existing))
            queued = self._fail_next.get(request.pool)
            if queued:
                err = queued.pop(0)
                raise err(f"injected {err.__name__} in {request.pool.name}", pool=request.pool)
            cap = self.capacity.get(request.pool)
            room = request.count  # the live count is a scan of every instance: only where a cap is set
            if cap is not None:
                live = sum(1 for i in self._instances.values() if i.pool == request.pool and i.alive)
                room = max(0, min(request.count, cap - live))
            if room == 0:
                raise CapacityError(f"no capacity in {request.pool.name}", pool=request.pool)
            created = []
            for node_id in request.node_ids[:room]:
                iid = InstanceId(f"{self.cloud}-{next(self._ids):06d}")
                inst = Instance(
                    instance_id=iid,
                    node_id=NodeId(node_id),
                    pool=request.pool,
                    state=InstanceState.RUNNING,
                    tags=request.instance_tags(node_id),
                    launched_ts=self._clock(),
                    private_ip="127.0.0.1",
                )
                self._instances[iid] = inst
                created.append(inst)
            self._by_token[request.idempotency_token] = tuple(i.instance_id for i in created)
            missing = request.count - room
            return LaunchResult(
                instances=tuple(created),
                missing=missing,
                failure=FailureReason.CAPACITY if missing else None,
                message=f"{missing} short in {request.pool.name}" if missing else "",
            )

    def terminate(self, instance_ids: Sequence[InstanceId], cluster_id: str) -> None:
        """Like a cloud with a tag-conditioned terminate: only instances tagged with ``cluster_id``."""
        with self._lock:
            self.terminate_calls += 1
            described = [self._instances[i] for i in instance_ids if i in self._instances]
            ours, refused = check_owned(self.cloud, cluster_id, described, log.warning)
            for iid in ours:
                self._instances[iid] = _with_state(self._instances[iid], InstanceState.TERMINATED)
        raise_refused(self.cloud, cluster_id, refused)

    def add_instance(self, pool: PoolKey, tags: Mapping[str, str] | None = None) -> Instance:
        """An instance created outside orchd (another workload in the same account): tagged as given."""
        with self._lock:
            iid = InstanceId(f"{self.cloud}-{next(self._ids):06d}")
            inst = Instance(instance_id=iid, node_id=None, pool=pool, state=InstanceState.RUNNING,
                            tags=dict(tags or {}), launched_ts=self._clock())
            self._instances[iid] = inst
            return inst

    def list_instances(self, cluster_id: str) -> list[Instance]:
        with self._lock:
            return [i for i in self._instances.values() if i.alive and i.tags.get(TAG_CLUSTER) == cluster_id]

    def describe(self, instance_ids: Sequence[InstanceId]) -> list[Instance]:
        with self._lock:
            return [self._instances[i] for i in instance_ids if i in self._instances]

    def prices(self, pools: Sequence[PoolKey] | None = None) -> list[PriceQuote]:
        with self._lock:
            now = self._clock()
            wanted = pools if pools is not None else list(self.prices_usd_h)
            out = []
            for pool in wanted:
                if pool not in self.prices_usd_h:
                    continue
                od = self.on_demand_usd_h.get((pool.region, pool.instance_type))
                out.append(
                    PriceQuote(
                        pool=pool,
                        gpu_type=self.gpu_type,
                        gpus_per_node=self.gpus_per_node,
                        price_usd_h=(self.prices_usd_h[pool] if pool.market is Market.SPOT
                                     else (od or self.prices_usd_h[pool])),
                        on_demand_usd_h=od,
                        ts=now,
                    )
                )
            return out

    # --- inspection for tests --------------------------------------------------------------------

    def all_instances(self) -> list[Instance]:
        with self._lock:
            return list(self._instances.values())


def _with_state(inst: Instance, state: InstanceState) -> Instance:
    return msgspec.structs.replace(inst, state=state)


class FileFakeCloud(FakeCloud):
    """FakeCloud persisted to files after every change (and loaded at construction): a JSON snapshot
    (``state_file``: instances, idempotency tokens, launch calls) and an append-only journal beside it
    (``<state_file>.journal.jsonl``, ``JOURNAL_SUFFIX``), one line per call with what the call changed.
    A call appends its line (cost in proportion to the call, not to every instance the cloud holds); once
    the journal is as large as the snapshot (at least ``COMPACT_MIN_BYTES``), the snapshot is rewritten and
    the journal emptied: the bytes written stay within a small multiple of the bytes journaled.
    Readers (``read_fake_file``, ``load_fake_file``) apply the journal over the snapshot; a line cut short
    by a kill -9 (the last one) is ignored, like a snapshot replace that did not happen."""

    def __init__(self, state_file: str | os.PathLike[str], cloud: str = "fake", *, shared: bool = False,
                 **kw: Any) -> None:
        super().__init__(cloud, **kw)
        self.state_file = Path(state_file)
        self.journal_file = journal_path(self.state_file)
        self.shared = shared
        self.calls_file = self.state_file.with_suffix(".calls.jsonl")
        self._file_lock = threading.Lock()
        self._journal_bytes = self._snapshot_bytes = 0
        self._reload()

    def _reload(self) -> None:
        instances, tokens, launch_calls, journal_bytes = _load(self.state_file)
        if instances is None:
            return
        with self._lock:
            self._instances = instances
            self._by_token = tokens
            self.launch_calls = launch_calls
            self._ids = itertools.count(len(self._instances) + 1)
        self._journal_bytes = journal_bytes
        self._snapshot_bytes = self.state_file.stat().st_size if self.state_file.exists() else 0

    @contextlib.contextmanager
    def _shared(self, op: str, what: Sequence[str]) -> Iterator[None]:
        """Shared mode: the whole call under an exclusive file lock, on the file's current content, and
        one line per call in ``calls_file`` (pid, op, ids, time): several processes (an HA leader and
        its standby) act on one cloud, and the partition drills attribute every call to its caller."""
        if not self.shared:
            yield
            return
        with open(self.state_file.with_suffix(".lock"), "a") as lk:
            fcntl.flock(lk, fcntl.LOCK_EX)
            try:
                self._reload()
                with open(self.calls_file, "a") as calls:
                    calls.write(json.dumps({"pid": os.getpid(), "op": op, "ids": list(what), "ts": time.time()}) + "\n")
                yield
            finally:
                fcntl.flock(lk, fcntl.LOCK_UN)

    def _save(self, ids: Sequence[InstanceId] = (), token: str | None = None) -> None:
        """Journal what a call changed: the instances ``ids`` as they are now, the idempotency ``token``'s
        instances, the launch call count; the snapshot is rewritten when the journal is as long as it."""
        with self._file_lock:  # one writer at a time; what is written is taken under the cloud's lock
            with self._lock:
                launched = self._by_token.get(token) if token is not None else None
                ids = (*ids, *(launched or ()))
                entry: dict[str, Any] = {"instances": [self._instances[i] for i in dict.fromkeys(ids)
                                                       if i in self._instances],
                                         "launch_calls": self.launch_calls}
                if token is not None and launched is not None:
                    entry["tokens"] = {token: list(launched)}
                line = msgspec.json.encode(entry) + b"\n"
                compact = self._journal_bytes + len(line) >= max(COMPACT_MIN_BYTES, self._snapshot_bytes)
                snapshot = _snapshot(self) if compact or not self.state_file.exists() else None
            with open(self.journal_file, "ab") as j:
                j.write(line)  # one write: a kill -9 leaves the line whole or cut short
            self._journal_bytes += len(line)
            if snapshot is not None:
                # The line went to the journal first: a reader that read the journal before it is emptied
                # and the snapshot after it is replaced applies lines whose last word on each instance is
                # what the snapshot holds (readers read the journal first).
                tmp = self.state_file.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
                tmp.write_bytes(snapshot)
                tmp.replace(self.state_file)
                with open(self.journal_file, "wb"):
                    pass
                self._journal_bytes, self._snapshot_bytes = 0, len(snapshot)

    def launch(self, request: LaunchRequest) -> LaunchResult:
        with self._shared("launch", request.node_ids):
            try:
                return super().launch(request)
            finally:
                self._save(token=request.idempotency_token)

    def terminate(self, instance_ids: Sequence[InstanceId], cluster_id: str) -> None:
        with self._shared("terminate", instance_ids):
            try:
                super().terminate(instance_ids, cluster_id)
            finally:
                self._save(instance_ids)

    def list_instances(self, cluster_id: str) -> list[Instance]:
        with self._shared("list", ()):
            return super().list_instances(cluster_id)

    def describe(self, instance_ids: Sequence[InstanceId]) -> list[Instance]:
        with self._shared("describe", instance_ids):
            return super().describe(instance_ids)

    def add_instance(self, pool: PoolKey, tags: Mapping[str, str] | None = None) -> Instance:
        out = super().add_instance(pool, tags)
        self._save((out.instance_id,))
        return out

    def preempt(self, instance_id: InstanceId) -> Instance:
        with self._shared("preempt", (instance_id,)):
            out = super().preempt(instance_id)
            self._save((instance_id,))
            return out


JOURNAL_SUFFIX = ".journal.jsonl"
COMPACT_MIN_BYTES = 256 * 1024
"""The journal is folded into the snapshot once it holds this many bytes, or as many as the snapshot."""


def journal_path(state_file: str | os.PathLike[str]) -> Path:
    """The journal beside a FileFakeCloud's snapshot file."""
    p = Path(state_file)
    return p.with_name(p.name + JOURNAL_SUFFIX)


def _snapshot(cloud: FileFakeCloud) -> bytes:
    return msgspec.json.encode({"instances": list(cloud._instances.values()),  # noqa: SLF001 - its own class
                                "tokens": {k: list(v) for k, v in cloud._by_token.items()},  # noqa: SLF001
                                "launch_calls": cloud.launch_calls})


def _load(path: Path) -> tuple[dict[InstanceId, Instance] | None, dict[str, tuple[InstanceId, ...]], int, int]:
    """Snapshot plus journal: (instances or None when neither file exists, tokens, launch calls, the
    journal's size in bytes)."""
    journal = journal_path(path)
    try:  # the journal before the snapshot: a compaction in between loses nothing (``FileFakeCloud._save``)
        raw_journal = journal.read_bytes()
    except FileNotFoundError:
        raw_journal = b""
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        if not raw_journal:
            return None, {}, 0, 0
        data = {}
    entries = [data]  # the snapshot, then each journal line: the same record, the last word wins
    for line in raw_journal.split(b"\n") if raw_journal else ():
        try:
            entry = json.loads(line) if line else None
        except ValueError:  # a line cut short by a kill -9 (the last one): the call never returned
            entry = None
        if isinstance(entry, dict):
            entries.append(entry)
    instances: dict[InstanceId, Instance] = {}
    tokens: dict[str, tuple[InstanceId, ...]] = {}
    launch_calls: int = 0
    for entry in entries:
        for raw in entry.get("instances", []):
            inst = msgspec.convert(raw, Instance)
            instances[inst.instance_id] = inst
        tokens.update({k: tuple(v) for k, v in entry.get("tokens", {}).items()})
        launch_calls = entry.get("launch_calls", launch_calls)
    return instances, tokens, launch_calls, len(raw_journal)


def load_fake_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A FileFakeCloud's whole record as one JSON-like dict (``instances`` as ``Instance``, ``tokens``,
    ``launch_calls``): the snapshot with the journal applied (empty when neither file exists)."""
    instances, tokens, launch_calls, _ = _load(Path(path))
    return {"instances": list((instances or {}).values()), "tokens": {k: list(v) for k, v in tokens.items()},
            "launch_calls": launch_calls}


def read_fake_file(path: str | os.PathLike[str]) -> list[Instance]:
    """The instances a FileFakeCloud recorded (for tests counting launches on the cloud side)."""
    return list((_load(Path(path))[0] or {}).values())


@dataclass(frozen=True, slots=True, kw_only=True)
class FakePrice:
    """One row of ``[providers.fake] prices``."""

    pool: PoolKey
    price_usd_h: float
    on_demand_usd_h: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class FakeConfig:
    """``[providers.fake]``."""

    state_file: str = ""
    """Keep instances and idempotency tokens in this JSON file (a FileFakeCloud): they survive a restart."""
    shared: bool = False
    """Several processes share ``state_file`` (HA orchd): each call re-reads it under a file lock and is
    logged to ``<state_file stem>.calls.jsonl`` with the caller's pid."""
    prices: tuple[FakePrice, ...] = ()
    gpu_type: str = "A100"
    gpus_per_node: int = 1


def from_settings(table: Mapping[str, Any]) -> FakeCloud:
    """``[providers.fake]`` -> FakeCloud (FileFakeCloud with a ``state_file``); one SettingsError with
    every problem (``wire.config.load_checked``)."""
    cfg = load_checked(FakeConfig, table, "providers.fake")
    cloud = (FileFakeCloud(cfg.state_file, shared=cfg.shared, gpu_type=cfg.gpu_type, gpus_per_node=cfg.gpus_per_node)
             if cfg.state_file
             else FakeCloud(gpu_type=cfg.gpu_type, gpus_per_node=cfg.gpus_per_node))
    for row in cfg.prices:
        cloud.set_price(row.pool, row.price_usd_h, row.on_demand_usd_h)
    return cloud
