"""What comes due, in time order: the index that lets a Tick touch only what is due.

Role: a derived, immutable index over the state (``State.timers``), never persisted: ``build`` makes it
from the records (on load, or for a state built by hand), ``Tx.decision`` keeps it current for the
records a decision wrote, and the Tick (tick.py) pops from it what may be due now. It
changes the cost of a Tick, never what a Tick decides: every popped item is checked with the same
predicate the full scan used, so the index only has to be *complete* - whatever can be due at time t
has an entry at or before t. Early or duplicate entries are harmless (the check says "not yet" and the
item is re-armed); a missing one would be a bug (``tests/core/test_timers.py`` compares decisions with
the incrementally kept index against a freshly built one after every event of random runs).

Queues (each an ``immutables.Map`` slot -> set of keys, a slot = ``SLOT_S`` seconds of the *base* time;
the base is a record field, so an entry never depends on the configuration):

- ``launch``: nodes requested/booting, at ``requested_ts`` (due ``launch_timeout_s`` later);
- ``notice``: noticed nodes, at ``notice_deadline + NOTICE_GRACE_S`` (then surely gone);
- ``hb``: watched nodes, at ``last_seen`` (due ``heartbeat_timeout_s`` later), or at ``suspect_since``
  for a suspect one (checked with the provider again a heartbeat timeout later). The
  heartbeat fast path moves ``last_seen`` forward without touching the index: the old entry stays a
  lower bound, and when it pops the node is re-armed at its real ``last_seen`` - so a node that keeps
  heartbeating costs one pop per heartbeat timeout, not one visit per Tick;
- ``jobs``: sleeping jobs, at the time their Tick may do something again;
- ``sweeps``: every job of each sweep (any phase), and the sweeps that may still have an unfinished job
  (``open_sweeps``): the sweep pass of a Tick (sweeps.py) visits only those, never the other jobs.

Pools are few (they do not grow with jobs or nodes) and a pending price is confirmed only by a second
PriceTick (confirm.py), never by a Tick: the index keeps no queue for them.

Jobs are *awake* (ticked on every Tick, as before) or *asleep*. A job falls asleep only after a Tick
that did nothing to it (no record, command or audit entry changed), and only in the situations where
the next Ticks provably do nothing either until a known time or a change this index sees (never a job of
a sweep: ``deadline_driven``):

- ``PRICE``: running with its target nodes, no budget and no deadline fallback: until its next price
  evaluation (``price_eval_ts + price_eval_interval_s``) or a change of a confirmed price of any pool;
- ``POOLS``: pending or paused with no nodes and no deadline fallback: placement/resume found no pool;
  until a pool write that can make a pool a launch target again (``pool_change``), or the next expiry
  of a pool's launch backoff or notice skip.

A write of the job, or of any of its nodes, wakes it; a finished job leaves the index (at its next
Tick). A change of the
core's configuration drops the index (rebuilt by the next ``decide``).
"""

from __future__ import annotations

import math
from typing import Final

import immutables

from orchestrator.core.model import TERMINAL_JOB_PHASES, Job, Node, NodePhase, PoolStats
from wire.messages import MarketPolicy

SLOT_S: Final = 1.0
NOTICE_GRACE_S: Final = 60.0  # after a notice deadline passes, the instance is surely gone
WATCHED: Final = frozenset({NodePhase.REGISTERED, NodePhase.RUNNING, NodePhase.NOTICED, NodePhase.DRAINING})
_INFLIGHT: Final = frozenset({NodePhase.REQUESTED, NodePhase.BOOTING})

PRICE: Final = 1  # asleep until a price evaluation is due, or a confirmed price changes
POOLS: Final = 2  # asleep until a pool write may make a pool a launch target, or a backoff / notice skip expires

_Keys = immutables.Map[str, None]
Queue = immutables.Map[int, _Keys]
Sweeps = immutables.Map[str, _Keys]
_NO_KEYS: Final[_Keys] = immutables.Map()
_NO_SWEEPS: Final[Sweeps] = immutables.Map()
_EMPTY_Q: Final[Queue] = immutables.Map()
_EMPTY_SLEEP: Final[immutables.Map[str, int]] = immutables.Map()


def _slot(t: float) -> int | None:
    return math.floor(t / SLOT_S) if math.isfinite(t) else None


def _add(q: Queue, t: float, key: str) -> Queue:
    s = _slot(t)
    if s is None:
        return q
    keys = q.get(s, _NO_KEYS)
    return q if key in keys else q.set(s, keys.set(key, None))


def _pop(q: Queue, limit: float) -> tuple[Queue, list[str]]:
    """Every key whose base time may be <= ``limit`` (one slot of margin: float rounding in the exact
    predicates must never hide a due item), removed from the queue."""
    if not q or not math.isfinite(limit):
        return q, []
    top = math.floor(limit / SLOT_S) + 1
    due = [s for s in q if s <= top]
    if not due:
        return q, []
    out: list[str] = []
    m = q.mutate()
    for s in due:
        out.extend(q[s])
        del m[s]
    return m.finish(), out


def _add_many(q: Queue, items: list[tuple[float, str]]) -> Queue:
    if not items:
        return q
    groups: dict[int, dict[str, None]] = {}
    for t, key in items:
        s = _slot(t)
        if s is not None:
            groups.setdefault(s, {})[key] = None
    m = q.mutate()
    for s, keys in groups.items():
        m[s] = m.get(s, _NO_KEYS).update(keys)
    return m.finish()


def _spread(node_id: str) -> float:
    """0-7 s, fixed per node: how much earlier than needed a node written by a decision is first
    checked for silence. Nodes registered at the same moment (a fleet built at once, a restart) would
    otherwise be checked all in the same Tick, every heartbeat timeout; spread, their checks fall into
    different Ticks and stay there (a popped node goes back in at its real ``last_seen``)."""
    return float(sum(node_id.encode()) % 8) * SLOT_S


def node_times(node: Node) -> tuple[float | None, float | None, float | None]:
    """(launch base, notice base, heartbeat base) of a node: where it belongs in each queue."""
    phase = node.phase
    if phase in _INFLIGHT:
        return node.requested_ts, None, None
    if phase not in WATCHED:
        return None, None, None
    notice = (
        node.notice_deadline + NOTICE_GRACE_S
        if phase == NodePhase.NOTICED and node.notice_deadline is not None else None
    )
    return None, notice, (node.last_seen if node.suspect_since is None else node.suspect_since)


def pool_change(before: PoolStats | None, after: PoolStats | None) -> frozenset[int]:
    """The sleepers a pool write concerns: a changed confirmed price wakes both kinds; a change that
    can make the pool a launch target again for a waiting job (placement.ranked: capacity, GPU, a
    shorter backoff or notice skip, a new or deleted pool) wakes POOLS. Statistics, live counts and
    pending prices concern neither (they change the ranking, never whether a pool is feasible)."""
    if before is None or after is None:
        return _BOTH
    if before.price_usd_h != after.price_usd_h or before.on_demand_usd_h != after.on_demand_usd_h:
        return _BOTH
    if (
        before.capacity_hint != after.capacity_hint or before.gpu_type != after.gpu_type
        or before.gpus_per_node != after.gpus_per_node or before.pool != after.pool
        or after.backoff_until < before.backoff_until or after.noticed_until < before.noticed_until
    ):
        return _POOLS_ONLY
    return _NONE


_BOTH: Final = frozenset({PRICE, POOLS})
_POOLS_ONLY: Final = frozenset({POOLS})
_NONE: Final[frozenset[int]] = frozenset()


class Timers:
    """The index (immutable: every operation returns a new one). Equal to any other index: it is
    derived from the records, so two states with equal records compare equal whatever it holds."""

    __slots__ = ("launch", "notice", "hb", "jobs", "awake", "asleep", "sweeps", "open_sweeps")

    def __init__(
        self,
        launch: Queue = _EMPTY_Q,
        notice: Queue = _EMPTY_Q,
        hb: Queue = _EMPTY_Q,
        jobs: Queue = _EMPTY_Q,
        awake: _Keys = _NO_KEYS,
        asleep: immutables.Map[str, int] = _EMPTY_SLEEP,
        sweeps: Sweeps = _NO_SWEEPS,
        open_sweeps: _Keys = _NO_KEYS,
    ) -> None:
        self.launch = launch
        self.notice = notice
        self.hb = hb
        self.jobs = jobs
        self.awake = awake  # job ids ticked on every Tick
        self.asleep = asleep  # job id -> PRICE | POOLS
        self.sweeps = sweeps  # sweep id -> the ids of every job of it (any phase: jobs never leave the state)
        self.open_sweeps = open_sweeps  # sweep ids that may have a job not finished (a superset)

    def __eq__(self, other: object) -> bool:
        return other is None or isinstance(other, Timers)

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return f"Timers(awake={len(self.awake)}, asleep={len(self.asleep)})"

    # --- nodes and pools ---------------------------------------------------------------------------

    def arm_nodes(self, nodes: list[Node], spread: bool = True) -> Timers:
        """Put nodes in their queues; ``spread``: their first heartbeat check a few seconds early
        (``_spread``), for nodes written by a decision - not for the ones a Tick just checked."""
        if not nodes:
            return self
        launch: list[tuple[float, str]] = []
        notice: list[tuple[float, str]] = []
        hb: list[tuple[float, str]] = []
        for n in nodes:
            lt, nt, ht = node_times(n)
            if lt is not None:
                launch.append((lt, n.node_id))
            if nt is not None:
                notice.append((nt, n.node_id))
            if ht is not None:
                hb.append((ht - _spread(n.node_id) if spread else ht, n.node_id))
        return Timers(_add_many(self.launch, launch), _add_many(self.notice, notice), _add_many(self.hb, hb),
                      self.jobs, self.awake, self.asleep, self.sweeps, self.open_sweeps)

    def rearm_hb(self, groups: dict[int, dict[str, None]]) -> Timers:
        """Nodes a Tick popped and checked, back in the heartbeat queue: slot -> node ids."""
        if not groups:
            return self
        m = self.hb.mutate()
        for s, keys in groups.items():
            m[s] = m.get(s, _NO_KEYS).update(keys)
        return Timers(self.launch, self.notice, m.finish(), self.jobs, self.awake, self.asleep, self.sweeps,
                      self.open_sweeps)

    def pop_nodes(self, now: float, launch_timeout_s: float, heartbeat_timeout_s: float,
                  detect: bool) -> tuple[Timers, set[str]]:
        """Nodes that may be due now (a superset of the due ones). Heartbeat entries stay while failure
        detection is off: they pop, and are checked, once it is on again."""
        launch, a = _pop(self.launch, now - launch_timeout_s)
        notice, b = _pop(self.notice, now)
        hb, c = _pop(self.hb, now - heartbeat_timeout_s) if detect else (self.hb, [])
        if not (a or b or c):
            return self, set()
        return Timers(launch, notice, hb, self.jobs, self.awake, self.asleep, self.sweeps,
                      self.open_sweeps), {*a, *b, *c}

    # --- jobs --------------------------------------------------------------------------------------

    def pop_jobs(self, now: float) -> tuple[Timers, list[str]]:
        """The jobs to tick now, sorted: the awake ones and the sleepers whose time came (woken)."""
        q, woken = _pop(self.jobs, now)
        if not woken:
            return self, sorted(self.awake)
        t, _ = Timers(self.launch, self.notice, self.hb, q, self.awake, self.asleep, self.sweeps,
                      self.open_sweeps).update_jobs(
            set(woken), frozenset())
        return t, sorted(t.awake)

    def sleep(self, jid: str, kind: int, until: float | None) -> Timers:
        """Put an awake job to sleep (PRICE | POOLS) until ``until`` (None: only a change wakes it)."""
        awake = self.awake.delete(jid) if jid in self.awake else self.awake
        asleep = self.asleep.set(jid, kind)
        jobs = self.jobs if until is None else _add(self.jobs, until, jid)
        return Timers(self.launch, self.notice, self.hb, jobs, awake, asleep, self.sweeps, self.open_sweeps)

    def update_jobs(self, wake: set[str], wake_kinds: frozenset[int]) -> tuple[Timers, set[str]]:
        """Wake ``wake`` (written jobs, jobs of written nodes, sleepers whose time came) and every
        sleeper of ``wake_kinds``. Also returns the job ids that were asleep and are awake now."""
        asleep0 = self.asleep
        woken: set[str] = set()
        if wake_kinds and asleep0:
            woken.update(jid for jid, kind in asleep0.items() if kind in wake_kinds)
        awake0 = self.awake
        fresh = [jid for jid in wake if jid not in awake0]
        if not fresh and not woken:
            return self, woken
        awake, asleep = awake0.mutate(), asleep0.mutate()
        for jid in fresh:
            if jid in asleep0:
                woken.add(jid)
            awake[jid] = None
        for jid in woken:
            del asleep[jid]
            awake[jid] = None
        return Timers(self.launch, self.notice, self.hb, self.jobs, awake.finish(), asleep.finish(), self.sweeps,
                      self.open_sweeps), woken

    def retire(self, jids: list[str]) -> Timers:
        """Finished jobs leave the index."""
        if not jids:
            return self
        awake, asleep = self.awake.mutate(), self.asleep.mutate()
        for jid in jids:
            if jid in awake:
                del awake[jid]
            if jid in asleep:
                del asleep[jid]
        return Timers(self.launch, self.notice, self.hb, self.jobs, awake.finish(), asleep.finish(), self.sweeps,
                      self.open_sweeps)

    # --- sweeps ------------------------------------------------------------------------------------

    def add_sweep_jobs(self, jobs: list[Job]) -> Timers:
        """Written jobs of sweeps: each under its sweep, and the sweep open while the job is not finished
        (a sweep stays open from the write of any unfinished job of it until a Tick finds none left)."""
        sweeps, opened = self.sweeps, self.open_sweeps
        for job in jobs:
            sid = job.spec.sweep_id
            if not isinstance(sid, str):
                continue
            ids = sweeps.get(sid, _NO_KEYS)
            if job.job_id not in ids:
                sweeps = sweeps.set(sid, ids.set(job.job_id, None))
            if job.phase not in TERMINAL_JOB_PHASES and sid not in opened:
                opened = opened.set(sid, None)
        if sweeps is self.sweeps and opened is self.open_sweeps:
            return self
        return Timers(self.launch, self.notice, self.hb, self.jobs, self.awake, self.asleep, sweeps, opened)

    def close_sweeps(self, sids: list[str]) -> Timers:
        """Sweeps none of whose jobs is left to finish leave the open ones (their members stay)."""
        if not sids:
            return self
        opened = self.open_sweeps.mutate()
        for sid in sids:
            if sid in opened:
                del opened[sid]
        return Timers(self.launch, self.notice, self.hb, self.jobs, self.awake, self.asleep, self.sweeps,
                      opened.finish())


def build(jobs: immutables.Map[str, Job], nodes: immutables.Map[str, Node]) -> Timers:
    """The index of a state from its records alone: every active job awake, every node in its queues
    (the first Tick puts the quiet jobs to sleep), every job of a sweep under its sweep."""
    awake = _NO_KEYS.mutate()
    swept: list[Job] = []
    for jid, job in jobs.items():
        if job.phase not in TERMINAL_JOB_PHASES:
            awake[jid] = None
        if isinstance(job.spec.sweep_id, str):
            swept.append(job)
    return Timers(awake=awake.finish()).add_sweep_jobs(swept).arm_nodes(list(nodes.values()))


def deadline_driven(job: Job) -> bool:
    """A deadline under spot_with_fallback: the slack shrinks with time, so the job never sleeps. Nor does a
    job of a sweep: every Tick checks its sweep's total budget and deadline (sweeps.py)."""
    spec = job.spec
    return (spec.deadline_ts is not None and spec.market == MarketPolicy.SPOT_WITH_FALLBACK) or isinstance(
        spec.sweep_id, str)
