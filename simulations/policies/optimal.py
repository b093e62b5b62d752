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

import numpy as np

from simulations.engine import Job, Modes
from simulations.overheads import Overheads, start_table
from simulations.scenario import Scenario


def optimal_costs(sc: Scenario, jobs: list[Job], ov: Overheads, *, usable: np.ndarray | None = None) -> np.ndarray:
    """Least cost (USD) per job that finishes by its deadline; inf where none can."""
    if not jobs:
        return np.zeros(0)
    W, D, N = jobs[0].work_q, jobs[0].deadline_ticks, jobs[0].nodes
    if any((j.work_q, j.deadline_ticks, j.nodes) != (W, D, N) for j in jobs):
        raise ValueError("optimal_costs batches jobs of one shape (work, deadline, nodes)")
    md = Modes(sc)
    Z, R, FRESH, M = md.Z, md.R, md.FRESH, md.M
    Q = sc.quanta_per_tick
    T = sc.n_ticks
    O = start_table(ov, list(sc.regions), sc.quantum_s)
    rset = sorted({o - i * Q for row in O for o in row for i in range(1, o // Q + 2) if o - i * Q > 0})
    rvals = [0] + rset
    ridx = {v: i for i, v in enumerate(rvals)}
    NR = len(rvals)
    if usable is None:
        usable = sc.usable(N)
    J = len(jobs)
    starts = np.asarray([j.start_tick for j in jobs], dtype=np.int64)
    node_tick_h = sc.tick_s / 3600.0 * N
    c_od = sc.od_price * node_tick_h  # (R,)
    zone_region = [int(x) for x in sc.zone_region]
    RUN = Z + R
    # modes located in region g (for "leave from g" and "idle in g")
    by_loc = [[m for m in range(M - 1) if md.loc[m] == g] for g in range(R)]
    targets = [[z for z in range(Z) if zone_region[z] == h] + [Z + h] for h in range(R)]

    inf = np.inf
    V = np.full((J, M, NR, W), inf)
    V[:, FRESH, 0, 0] = 0.0
    spare = np.full_like(V, inf)
    best = np.full(J, inf)
    pw = np.arange(W)
    for k in range(D):
        # band of progress worth tracking: reachable (<= k*Q) and still able to finish (>= W-(D-k)*Q)
        lo = max(0, W - (D - k) * Q)
        hi = min(W, k * Q + 1)
        if lo >= hi:
            break
        hi2 = min(W, hi + Q)  # where this tick's transitions can land
        t = (starts + k) % T
        U = usable[:, t].T  # (J, Z)
        C = np.empty((J, RUN))
        C[:, :Z] = np.where(U, sc.spot_price[:, t].T * node_tick_h, inf)
        C[:, Z:] = c_od[None, :]
        Vn = spare
        Vn[..., lo:hi2] = inf  # the next tick reads only [lo, hi2): older values elsewhere are never read
        Vb = V[..., lo:hi]
        # 1) keep running the same mode
        for ri, rv in enumerate(rvals):
            src = Vb[:, :RUN, ri, :] + C[:, :, None]  # (J, RUN, hi-lo)
            if rv >= Q:
                dst = Vn[:, :RUN, ridx[rv - Q], lo:hi]
                np.minimum(dst, src, out=dst)
            else:
                g = Q - rv
                n = min(hi, W - g) - lo
                if n > 0:
                    dst = Vn[:, :RUN, 0, lo + g : lo + g + n]
                    np.minimum(dst, src[:, :, :n], out=dst)
                tlo = max(lo, W - g)
                if tlo < hi:
                    frac = (rv + W - pw[tlo:hi]) / Q  # quanta used in the finishing tick / Q
                    term = Vb[:, :RUN, ri, tlo - lo :] + C[:, :, None] * frac[None, None, :]
                    np.minimum(best, term.min(axis=(1, 2)), out=best)
        # 2) where the checkpoint is: min over modes located in g and over r
        Vr = Vb[:, :, 0, :] if NR == 1 else Vb.min(axis=2)  # (J, M, hi-lo)
        S = np.stack([Vr[:, by_loc[g]].min(axis=1) for g in range(R)] + [Vr[:, FRESH]], axis=1)  # (J, R+1, hi-lo)
        # 3) idle
        for g in range(R):
            Vn[:, Z + R + g, 0, lo:hi] = S[:, g]
        Vn[:, FRESH, 0, lo:hi] = Vb[:, FRESH, 0, :]
        # 4) start a mode in region h from a checkpoint in g (or fresh)
        wb = hi2 - lo
        for h in range(R):
            Th = np.full((J, NR, wb), inf)
            tgt = targets[h]
            for g in range(R + 1):
                o = O[g][h]
                gain0, r0 = max(0, Q - o), max(0, o - Q)
                Sg = S[:, g]
                n = min(hi, W - gain0) - lo
                if n > 0:
                    dst = Th[:, ridx[r0], gain0 : gain0 + n]
                    np.minimum(dst, Sg[:, :n], out=dst)
                if gain0 > 0:
                    tlo = max(lo, W - gain0)
                    if tlo < hi:
                        frac = (o + W - pw[tlo:hi]) / Q
                        term = Sg[:, None, tlo - lo :] + C[:, tgt, None] * frac[None, None, :]
                        np.minimum(best, term.min(axis=(1, 2)), out=best)
            for a in tgt:
                dst = Vn[:, a, :, lo:hi2]
                np.minimum(dst, Th + C[:, a, None, None], out=dst)
        spare, V = V, Vn
    return best


def od_work_cost(sc: Scenario, job: Job) -> float:
    return job.work_q * sc.quantum_s / 3600.0 * job.nodes * float(sc.od_price.min())
