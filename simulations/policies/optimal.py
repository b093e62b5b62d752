"""``optimal``: the offline lower bound, by dynamic programming over the engine's transition system.

The schedule knows the whole trace. State per job and tick: (mode, remaining overhead r, progress p)
with the same modes, overhead table, quanta and billing as ``simulations.engine``; the value is the
least cost to reach that state. Every online policy's run is one path through this system, so
``optimal`` is never above a policy that met the deadline on the same inputs (tested by property
and by brute force on tiny traces).

Vectorised with numpy over jobs and progress: per tick O((Z + R) * |r| + R^2) array operations on
arrays of shape (jobs, ..., W). Memory: jobs x modes x |r| x W float64.
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
    best = np.full(J, inf)
    pw = np.arange(W)
    for k in range(D):
        t = (starts + k) % T
        U = usable[:, t].T  # (J, Z)
        C = np.empty((J, RUN))
        C[:, :Z] = np.where(U, sc.spot_price[:, t].T * node_tick_h, inf)
        C[:, Z:] = c_od[None, :]
        Vn = np.full_like(V, inf)
        # 1) keep running the same mode
        for ri, rv in enumerate(rvals):
            src = V[:, :RUN, ri, :] + C[:, :, None]  # (J, RUN, W)
            if rv >= Q:
                dst = Vn[:, :RUN, ridx[rv - Q], :]
                np.minimum(dst, src, out=dst)
            else:
                g = Q - rv
                if g < W:
                    dst = Vn[:, :RUN, 0, g:]
                    np.minimum(dst, src[:, :, : W - g], out=dst)
                lo = max(0, W - g)
                frac = (rv + W - pw[lo:]) / Q  # quanta used in the finishing tick / Q
                term = V[:, :RUN, ri, lo:] + C[:, :, None] * frac[None, None, :]
                np.minimum(best, term.min(axis=(1, 2)), out=best)
        # 2) where the checkpoint is: min over modes located in g and over r
        Vr = V.min(axis=2)  # (J, M, W)
        S = np.stack([Vr[:, by_loc[g]].min(axis=1) for g in range(R)] + [Vr[:, FRESH]], axis=1)  # (J, R+1, W)
        # 3) idle
        for g in range(R):
            Vn[:, Z + R + g, 0, :] = S[:, g]
        Vn[:, FRESH, 0, :] = V[:, FRESH, 0, :]
        # 4) start a mode in region h from a checkpoint in g (or fresh)
        for h in range(R):
            Th = np.full((J, NR, W), inf)
            tgt = targets[h]
            for g in range(R + 1):
                o = O[g][h]
                gain0, r0 = max(0, Q - o), max(0, o - Q)
                Sg = S[:, g]
                if gain0 < W:
                    dst = Th[:, ridx[r0], gain0:]
                    np.minimum(dst, Sg[:, : W - gain0], out=dst)
                if gain0 > 0:
                    lo = max(0, W - gain0)
                    frac = (o + W - pw[lo:]) / Q
                    term = Sg[:, None, lo:] + C[:, tgt, None] * frac[None, None, :]
                    np.minimum(best, term.min(axis=(1, 2)), out=best)
            for a in tgt:
                dst = Vn[:, a]
                np.minimum(dst, Th + C[:, a, None, None], out=dst)
        V = Vn
    return best


def od_work_cost(sc: Scenario, job: Job) -> float:
    return job.work_q * sc.quantum_s / 3600.0 * job.nodes * float(sc.od_price.min())
