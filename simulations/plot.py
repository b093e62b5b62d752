"""Plots: cost vs deadline slack per policy, and the timeline of one job under each policy.

Role: presentation only (matplotlib, Agg backend, writes a PNG). Reuses ``replay`` for the numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

from simulations.engine import Modes, run_job
from simulations.overheads import Overheads
from simulations.policies import ONLINE
from simulations.replay import make_jobs, replay
from simulations.scenario import Scenario

SLACKS = (1.1, 1.25, 1.5, 2.0, 3.0)  # deadline / job length


def _job_timelines(sc: Scenario, ov: Overheads, job, policies: Sequence[str]):
    """policy -> list of (hours, progress_hours, kind) with kind in idle/spot/od."""
    md = Modes(sc)
    q_h = sc.quantum_s / 3600.0
    out = {}
    for name in policies:
        if name in ONLINE:
            r = run_job(ONLINE[name](), sc, job, ov, record=True)
            pts = []
            for k, m, p in r.timeline or []:
                kind = "spot" if m < md.Z else ("od" if m < md.Z + md.R else "idle")
                pts.append((k * sc.tick_s / 3600.0, p * q_h, kind))
            pts.append((r.done_ticks * sc.tick_s / 3600.0, job.work_q * q_h, pts[-1][2] if pts else "idle"))
            out[name] = pts
        elif name == "orchd":
            from simulations.orchd_policy import core_config
            from simulations.world import World

            w = World(sc, job, ov, config=core_config(ov), record=True)
            res = w.run()
            pts = [(t / 3600.0, p / 3600.0, kind) for t, p, kind in res.progress_log]
            if res.done_ts is not None:
                pts.append((res.done_ts / 3600.0, job.work_q * q_h, pts[-1][2] if pts else "idle"))
            out[name] = pts
    return out


def plot_replay(
    sc: Scenario,
    ov: Overheads,
    out: str,
    *,
    job_hours: float,
    deadline_hours: float,
    nodes: int,
    jobs: int,
    policies: Sequence[str],
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 5))
    curves: dict[str, list[float]] = {p: [] for p in policies}
    for s in SLACKS:
        js = make_jobs(sc, job_hours=job_hours, deadline_hours=job_hours * s, nodes=nodes, count=jobs)
        res = replay(sc, js, policies, ov)
        for p in policies:
            curves[p].append(res[p].cost_ratio)
    for p in policies:
        a1.plot(SLACKS, curves[p], marker="o", label=p)
    a1.set_xlabel("deadline / job length")
    a1.set_ylabel("cost / on-demand cost of the work")
    a1.set_title(f"cost vs deadline slack ({jobs} jobs of {job_hours:g} h)")
    a1.grid(alpha=0.3)
    a1.legend()

    # the job that sees the most preemptions under greedy_spot: the interesting one
    cands = make_jobs(sc, job_hours=job_hours, deadline_hours=deadline_hours, nodes=nodes, count=jobs)
    job = max(cands, key=lambda j: run_job(ONLINE["greedy_spot"](), sc, j, ov).preemptions)
    for name, pts in _job_timelines(sc, ov, job, [p for p in policies if p != "optimal"]).items():
        if not pts:
            continue
        xs = [x for x, _, _ in pts]
        ys = [y for _, y, _ in pts]
        (line,) = a2.plot(xs, ys, label=name, lw=1.5)
        od = [(x, y) for x, y, k in pts if k == "od"]
        if od:
            a2.scatter([x for x, _ in od], [y for _, y in od], s=8, color=line.get_color(), marker="s")
    a2.axvline(deadline_hours, color="k", ls="--", lw=1)
    a2.text(deadline_hours, 0, " deadline", va="bottom")
    a2.set_xlabel("hours since submission")
    a2.set_ylabel("work done (h)")
    a2.set_title(f"one job, start tick {job.start_tick} (squares: on-demand)")
    a2.grid(alpha=0.3)
    a2.legend()
    zones = ", ".join(z.name for z in sc.zones)
    fig.suptitle(f"{zones}  (tick {sc.tick_s:.0f} s)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
