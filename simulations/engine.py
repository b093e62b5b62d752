"""The tick engine: the transition system of the offline optimum, and the online policies' interface.

Role: define the modes, overhead table and billing that ``policies.optimal`` solves exactly (with the
least overheads of the faithful world, so it bounds every policy run there), and the ``Policy`` /
``Run`` interface the baselines decide through. The replay runs the baselines in the faithful world
(``world_policy``), not here; ``run_job`` steps a policy through this engine for the optimum's tests.

Modes (integers, so the DP can index arrays with them): spot in zone z (0..Z-1), on-demand in region
g (Z+g), idle with the checkpoint in region g (Z+R+g), FRESH (never ran, Z+2R). Policies may also
answer IDLE or OD, which mean "idle / on-demand where the checkpoint is".

Per tick (``tick_s`` = Q progress quanta), with state (mode, progress p, remaining overhead r):
- keep running the same mode (spot only while the zone has the nodes): gain Q - r (at least 0), r
  shrinks by Q; cost = price x nodes x tick;
- start another mode a: overhead o = O[loc(mode)][region(a)] quanta; gain max(0, Q - o), r = o - Q;
  billed for the whole tick;
- idle: no cost, no progress, the checkpoint stays where it was.
The tick in which the work completes is billed for the quanta it used. A spot zone without the
nodes in a tick cannot be launched into (the launch fails, the job idles that tick) and a job
running there is preempted at the tick's start. After the deadline the engine finishes the job on
on-demand and records the deadline as missed.

Single-threaded, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from simulations.overheads import Overheads, start_table
from simulations.scenario import Scenario

IDLE = -1
OD = -2


@dataclass(frozen=True, slots=True)
class Job:
    start_tick: int
    work_q: int  # progress quanta needed
    deadline_ticks: int  # must be done within this many ticks of the start
    nodes: int = 1


@dataclass(slots=True)
class JobResult:
    cost_usd: float
    od_work_cost_usd: float  # the same work on on-demand, without overheads (the denominator)
    done_ticks: float  # ticks from the start to completion (fractional)
    deadline_met: bool
    preemptions: int
    overhead_q: int  # quanta paid for (re)starts, saves, migrations
    billed_q: int  # quanta billed (running)
    starts: int
    timeline: list[tuple[int, int, int]] | None = None  # (tick, mode, progress_q)
    od_share: float | None = None  # on-demand node-hours / billed node-hours (world runs; None: the bound)
    spot_returns: int = 0  # moves from on-demand back to spot (world runs)


class Modes:
    """Mode numbering for one scenario."""

    def __init__(self, sc: Scenario) -> None:
        self.Z = len(sc.zones)
        self.R = len(sc.regions)
        self.FRESH = self.Z + 2 * self.R
        self.M = self.FRESH + 1
        zr = [int(x) for x in sc.zone_region]
        # loc: region index of the checkpoint for each mode; R for FRESH
        self.loc = zr + list(range(self.R)) + list(range(self.R)) + [self.R]
        self.running_region = zr + list(range(self.R))

    def od(self, g: int) -> int:
        return self.Z + g

    def idle(self, g: int) -> int:
        return self.Z + self.R + g

    def is_running(self, m: int) -> bool:
        return 0 <= m < self.Z + self.R

    def name(self, m: int, sc: Scenario) -> str:
        if m < self.Z:
            return f"spot:{sc.zones[m].name}"
        if m < self.Z + self.R:
            return f"od:{sc.regions[m - self.Z][1]}"
        if m < self.FRESH:
            return "idle"
        return "fresh"


@dataclass(slots=True)
class Run:
    """What a policy may see in a tick: its own state and the CURRENT tick's market (no lookahead)."""

    sc: Scenario
    job: Job
    modes: Modes
    ov: Overheads
    ovq: list[list[int]]  # the start overhead table O in quanta, [src loc][dst region] (overheads.start_table)
    k: int = 0  # ticks since the job started
    t: int = 0  # tick index into the (cyclic) trace
    mode: int = 0
    p: int = 0
    r: int = 0
    usable: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool), repr=False)  # (Z,) bool this tick
    prices: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)  # (Z,) spot USD/node-h this tick
    preempted: bool = False  # the job's spot zone lost its nodes at this tick
    preemptions: int = 0

    @property
    def Q(self) -> int:
        return self.sc.quanta_per_tick

    def ticks_left(self) -> int:
        return self.job.deadline_ticks - self.k

    def od_start_q(self) -> int:
        """Overhead (quanta) of starting on-demand where the checkpoint is."""
        m = self.modes
        src = m.loc[self.mode]
        dst = src if src < m.R else int(np.argmin(self.sc.od_price))
        return self.ovq[src][dst]

    def start_q(self, zone: int) -> int:
        return self.ovq[self.modes.loc[self.mode]][int(self.sc.zone_region[zone])]


class Policy:
    """An online policy: ``act`` returns a mode (or IDLE / OD) for the current tick."""

    name = "policy"

    def reset(self, run: Run) -> None:
        pass

    def act(self, run: Run) -> int:
        raise NotImplementedError


def cheapest_od_region(sc: Scenario) -> int:
    return int(np.argmin(sc.od_price))


def run_job(
    policy: Policy,
    sc: Scenario,
    job: Job,
    ov: Overheads,
    *,
    usable: np.ndarray | None = None,
    record: bool = False,
) -> JobResult:
    modes = Modes(sc)
    if usable is None:
        usable = sc.usable(job.nodes)
    ovq = start_table(ov, list(sc.regions), sc.quantum_s)
    run = Run(sc=sc, job=job, modes=modes, ov=ov, ovq=ovq, mode=modes.FRESH)
    policy.reset(run)
    tally = _Tally(timeline=[] if record else None)
    done = _simulate(policy, run, usable, tally)
    od_work = job.work_q * sc.quantum_s / 3600.0 * job.nodes * float(sc.od_price[cheapest_od_region(sc)])
    return JobResult(
        cost_usd=tally.cost,
        od_work_cost_usd=od_work,
        done_ticks=done,
        deadline_met=done <= job.deadline_ticks + 1e-9,
        preemptions=run.preemptions,
        overhead_q=tally.overhead_q,
        billed_q=tally.billed_q,
        starts=tally.starts,
        timeline=tally.timeline,
    )


@dataclass(slots=True)
class _Tally:
    """What a run is charged, summed tick by tick."""

    cost: float = 0.0
    overhead_q: int = 0
    billed_q: int = 0
    starts: int = 0
    timeline: list[tuple[int, int, int]] | None = None


def _simulate(policy: Policy, run: Run, usable: np.ndarray, tally: _Tally) -> float:
    """Step ``run`` tick by tick until the job's work is done; returns the (fractional) ticks it took."""
    sc, job, modes = run.sc, run.job, run.modes
    Z, FRESH, T, Q, W = modes.Z, modes.FRESH, sc.n_ticks, sc.quanta_per_tick, job.work_q
    node_tick_h = sc.tick_s / 3600.0 * job.nodes
    spot_price, od_price, loc = sc.spot_price, sc.od_price, modes.loc
    timeline = tally.timeline
    mode, p, r, k = FRESH, 0, 0, 0
    while True:
        t = (job.start_tick + k) % T
        col = usable[:, t]
        run.k, run.t, run.mode, run.p, run.r = k, t, mode, p, r
        run.usable = col
        run.prices = spot_price[:, t]
        run.preempted = mode < Z and not col[mode]
        if run.preempted:
            run.preemptions += 1
        a = _action(policy, run, col)
        if a == IDLE:
            mode = FRESH if mode == FRESH else modes.idle(loc[mode])
            r = 0
            if timeline is not None:
                timeline.append((k, mode, p))
            k += 1
            continue
        gain, over, r, started = _transition(run, a, mode, r)
        tally.starts += started
        price = spot_price[a, t] if a < Z else od_price[a - Z]
        if timeline is not None:
            timeline.append((k, a, p))
        if p + gain >= W:  # done in this tick: billed for the quanta it used
            used = over + (W - p)
            tally.cost += price * node_tick_h * used / Q
            tally.billed_q += used
            tally.overhead_q += over
            return k + used / Q
        tally.cost += price * node_tick_h
        tally.billed_q += Q
        tally.overhead_q += over
        p += gain
        mode = a
        k += 1


def _action(policy: Policy, run: Run, col: np.ndarray) -> int:
    """The running mode of this tick (the policy's answer, resolved), or IDLE."""
    modes, mode = run.modes, run.mode
    Z, R = modes.Z, modes.R
    # past the deadline: finish on on-demand
    a = policy.act(run) if run.k < run.job.deadline_ticks else (mode if Z <= mode < Z + R else OD)
    if a == OD:
        src = modes.loc[mode]
        a = Z + (src if src < R else cheapest_od_region(run.sc))
    if 0 <= a < Z and not col[a]:
        return IDLE  # launch fails: no capacity
    if a == IDLE or a >= Z + R:
        return IDLE
    return a


def _transition(run: Run, a: int, mode: int, r: int) -> tuple[int, int, int, int]:
    """Running ``a`` for one tick after ``mode`` with ``r`` quanta of overhead left:
    (progress gained, overhead paid, overhead left, 1 if ``a`` was started)."""
    Q = run.sc.quanta_per_tick
    if a == mode:
        if r >= Q:
            return 0, Q, r - Q, 0
        return Q - r, r, 0, 0
    Z = run.modes.Z
    dst = int(run.sc.zone_region[a]) if a < Z else a - Z
    o = run.ovq[run.modes.loc[mode]][dst]
    return max(0, Q - o), min(o, Q), max(0, o - Q), 1
