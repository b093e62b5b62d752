"""``optimal``: the offline lower bound, by dynamic programming over the engine's transition system.

The schedule knows the whole trace. State per job and tick: (mode, remaining overhead r, progress p)
with the same modes, overhead table, quanta and billing as ``simulations.engine``; the value is the
least cost to reach that state. Every online policy's run is one path through this system, so
``optimal`` is never above a policy that met the deadline on the same inputs (tested by property
and by brute force on tiny traces).

Vectorised with numpy over jobs and progress: per tick O((Z + R) * |r| + R^2) array operations on
arrays of shape (jobs, ..., band), where the band holds the progress values that are reachable by
then and can still finish by the deadline. Memory: 2 x jobs x modes x |r| x W float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simulations.engine import Job, Modes
from simulations.overheads import Overheads, start_table
from simulations.scenario import Scenario


@dataclass(frozen=True, slots=True)
class _System:
    """The transition system of one batch of jobs: everything that is the same in every tick."""

    sc: Scenario
    md: Modes
    Q: int
    W: int
    D: int
    ovq: list[list[int]]  # the engine's start overhead table O, in quanta
    rvals: list[int]  # remaining-overhead values, 0 first
    ridx: dict[int, int]
    usable: np.ndarray
    starts: np.ndarray  # (J,) start tick of each job
    node_tick_h: float
    c_od: np.ndarray  # (R,) on-demand cost of one tick
    by_loc: list[list[int]]  # modes located in region g (for "leave from g" and "idle in g")
    targets: list[list[int]]  # running modes in region h
    pw: np.ndarray  # arange(W)

    @classmethod
    def build(cls, sc: Scenario, jobs: list[Job], ov: Overheads, usable: np.ndarray) -> _System:
        md = Modes(sc)
        Q = sc.quanta_per_tick
        ovq = start_table(ov, list(sc.regions), sc.quantum_s)
        rset = sorted({o - i * Q for row in ovq for o in row for i in range(1, o // Q + 2) if o - i * Q > 0})
        rvals = [0] + rset
        node_tick_h = sc.tick_s / 3600.0 * jobs[0].nodes
        zone_region = [int(x) for x in sc.zone_region]
        return cls(
            sc=sc, md=md, Q=Q, W=jobs[0].work_q, D=jobs[0].deadline_ticks, ovq=ovq, rvals=rvals,
            ridx={v: i for i, v in enumerate(rvals)}, usable=usable,
            starts=np.asarray([j.start_tick for j in jobs], dtype=np.int64), node_tick_h=node_tick_h,
            c_od=sc.od_price * node_tick_h,
            by_loc=[[m for m in range(md.M - 1) if md.loc[m] == g] for g in range(md.R)],
            targets=[[z for z in range(md.Z) if zone_region[z] == h] + [md.Z + h] for h in range(md.R)],
            pw=np.arange(jobs[0].work_q),
        )


def optimal_costs(sc: Scenario, jobs: list[Job], ov: Overheads, *, usable: np.ndarray | None = None) -> np.ndarray:
    """Least cost (USD) per job that finishes by its deadline; inf where none can."""
    if not jobs:
        return np.zeros(0)
    W, D, N = jobs[0].work_q, jobs[0].deadline_ticks, jobs[0].nodes
    if any((j.work_q, j.deadline_ticks, j.nodes) != (W, D, N) for j in jobs):
        raise ValueError("optimal_costs batches jobs of one shape (work, deadline, nodes)")
    sy = _System.build(sc, jobs, ov, sc.usable(N) if usable is None else usable)
    Q, md = sy.Q, sy.md
    V = np.full((len(jobs), md.M, len(sy.rvals), W), np.inf)
    V[:, md.FRESH, 0, 0] = 0.0
    spare = np.full_like(V, np.inf)
    best = np.full(len(jobs), np.inf)
    for k in range(D):
        # band of progress worth tracking: reachable (<= k*Q) and still able to finish (>= W-(D-k)*Q)
        lo = max(0, W - (D - k) * Q)
        hi = min(W, k * Q + 1)
        if lo >= hi:
            break
        hi2 = min(W, hi + Q)  # where this tick's transitions can land
        C = _tick_costs(sy, k, len(jobs))
        Vn = spare
        Vn[..., lo:hi2] = np.inf  # the next tick reads only [lo, hi2): older values elsewhere are never read
        Vb = V[..., lo:hi]
        _keep_running(sy, Vb, Vn, C, best, lo, hi)
        S = _checkpoint_values(sy, Vb)
        _idle(sy, Vb, Vn, S, lo, hi)
        _start_modes(sy, Vn, S, C, best, lo, hi, hi2)
        spare, V = V, Vn
    return best


def _tick_costs(sy: _System, k: int, J: int) -> np.ndarray:
    """(J, Z + R): the cost of running each mode in tick k of each job (inf: the zone has no nodes)."""
    Z = sy.md.Z
    t = (sy.starts + k) % sy.sc.n_ticks
    U = sy.usable[:, t].T  # (J, Z)
    C = np.empty((J, Z + sy.md.R))
    C[:, :Z] = np.where(U, sy.sc.spot_price[:, t].T * sy.node_tick_h, np.inf)
    C[:, Z:] = sy.c_od[None, :]
    return C


def _keep_running(sy: _System, Vb: np.ndarray, Vn: np.ndarray, C: np.ndarray, best: np.ndarray,
                  lo: int, hi: int) -> None:
    """1) keep running the same mode (finishing in this tick updates ``best``)."""
    Q, W, RUN = sy.Q, sy.W, sy.md.Z + sy.md.R
    for ri, rv in enumerate(sy.rvals):
        src = Vb[:, :RUN, ri, :] + C[:, :, None]  # (J, RUN, hi-lo)
        if rv >= Q:
            dst = Vn[:, :RUN, sy.ridx[rv - Q], lo:hi]
            np.minimum(dst, src, out=dst)
        else:
            g = Q - rv
            n = min(hi, W - g) - lo
            if n > 0:
                dst = Vn[:, :RUN, 0, lo + g : lo + g + n]
                np.minimum(dst, src[:, :, :n], out=dst)
            tlo = max(lo, W - g)
            if tlo < hi:
                frac = (rv + W - sy.pw[tlo:hi]) / Q  # quanta used in the finishing tick / Q
                term = Vb[:, :RUN, ri, tlo - lo :] + C[:, :, None] * frac[None, None, :]
                np.minimum(best, term.min(axis=(1, 2)), out=best)


def _checkpoint_values(sy: _System, Vb: np.ndarray) -> np.ndarray:
    """2) where the checkpoint is: min over the modes located in g and over r; (J, R + 1, hi - lo)."""
    Vr = Vb[:, :, 0, :] if len(sy.rvals) == 1 else Vb.min(axis=2)  # (J, M, hi-lo)
    return np.stack([Vr[:, sy.by_loc[g]].min(axis=1) for g in range(sy.md.R)] + [Vr[:, sy.md.FRESH]], axis=1)


def _idle(sy: _System, Vb: np.ndarray, Vn: np.ndarray, S: np.ndarray, lo: int, hi: int) -> None:
    """3) idle: no cost, no progress, the checkpoint stays where it is."""
    Z, R = sy.md.Z, sy.md.R
    for g in range(R):
        Vn[:, Z + R + g, 0, lo:hi] = S[:, g]
    Vn[:, sy.md.FRESH, 0, lo:hi] = Vb[:, sy.md.FRESH, 0, :]


def _start_modes(sy: _System, Vn: np.ndarray, S: np.ndarray, C: np.ndarray, best: np.ndarray,
                 lo: int, hi: int, hi2: int) -> None:
    """4) start a mode in region h from a checkpoint in g (or fresh)."""
    Q, W, R = sy.Q, sy.W, sy.md.R
    J, wb = S.shape[0], hi2 - lo
    for h in range(R):
        Th = np.full((J, len(sy.rvals), wb), np.inf)
        tgt = sy.targets[h]
        for g in range(R + 1):
            o = sy.ovq[g][h]
            gain0, r0 = max(0, Q - o), max(0, o - Q)
            Sg = S[:, g]
            n = min(hi, W - gain0) - lo
            if n > 0:
                dst = Th[:, sy.ridx[r0], gain0 : gain0 + n]
                np.minimum(dst, Sg[:, :n], out=dst)
            if gain0 > 0:
                tlo = max(lo, W - gain0)
                if tlo < hi:
                    frac = (o + W - sy.pw[tlo:hi]) / Q
                    term = Sg[:, None, tlo - lo :] + C[:, tgt, None] * frac[None, None, :]
                    np.minimum(best, term.min(axis=(1, 2)), out=best)
        for a in tgt:
            dst = Vn[:, a, :, lo:hi2]
            np.minimum(dst, Th + C[:, a, None, None], out=dst)


def od_work_cost(sc: Scenario, job: Job) -> float:
    return job.work_q * sc.quantum_s / 3600.0 * job.nodes * float(sc.od_price.min())
