"""Plots: cost vs deadline slack per policy, and the timeline of one job under each policy.

Role: presentation only (matplotlib, Agg backend, writes a PNG). Reuses ``replay`` for the numbers.
Each policy has one fixed style (colour, line style, marker, z-order) on every panel of every plot,
chosen by its name, never by plot order: ``POLICY_STYLES``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from simulations.policies import ONLINE
from simulations.replay import make_jobs, replay
from simulations.scenario import Scenario
from simulations.worldparams import WorldParams

SLACKS = (1.1, 1.25, 1.5, 2.0, 3.0)  # deadline / job length


@dataclass(frozen=True)
class PolicyStyle:
    colour: str
    linestyle: str
    marker: str  # the cost panel's points (the timeline panel's squares mean on-demand)
    linewidth: float
    zorder: float


# failover runs on demand whenever spot is short, so its line often coincides with on_demand's: failover
# is drawn wide and underneath, on_demand dashed and narrow on top, so both stay visible where they meet.
POLICY_STYLES: dict[str, PolicyStyle] = {
    "on_demand": PolicyStyle("#d62728", "--", "s", 1.5, 6.0),
    "greedy_spot": PolicyStyle("#ff7f0e", "-", "v", 1.5, 3.0),
    "failover": PolicyStyle("#1f77b4", "-", "o", 4.0, 2.0),
    "uniform_progress": PolicyStyle("#2ca02c", "-", "^", 1.5, 3.0),
    "optimal": PolicyStyle("#7f7f7f", ":", "D", 2.0, 4.0),
    "orchd": PolicyStyle("#9467bd", "-", "*", 2.0, 5.0),
}


def policy_style(name: str) -> PolicyStyle:
    try:
        return POLICY_STYLES[name]
    except KeyError:
        raise ValueError(f"no plot style for policy {name!r} (known: {', '.join(POLICY_STYLES)})") from None


def _job_timelines(sc: Scenario, wp: WorldParams, job, policies: Sequence[str]):
    """(hours since start, work done in hours, idle|spot|od) per trace tick, from each policy's world run."""
    from simulations.orchd_policy import core_config
    from simulations.world import World
    from simulations.world_policy import PolicyWorld

    q_h = sc.quantum_s / 3600.0
    out = {}
    for name in policies:
        if name in ONLINE:
            res = PolicyWorld(ONLINE[name](), sc, job, wp, record=True).run()
        elif name == "orchd":
            res = World(sc, job, wp, config=core_config(), record=True).run()
        else:
            continue
        pts = [(t / 3600.0, p / 3600.0, kind) for t, p, kind in res.progress_log]
        if res.done_ts is not None:
            pts.append((res.done_ts / 3600.0, job.work_q * q_h, pts[-1][2] if pts else "idle"))
        out[name] = pts
    return out


def _draw_cost(ax: Any, curves: dict[str, list[float]], *, jobs: int, job_hours: float) -> None:
    for p, ys in curves.items():
        st = policy_style(p)
        ax.plot(SLACKS, ys, label=p, color=st.colour, ls=st.linestyle, marker=st.marker, lw=st.linewidth,
                zorder=st.zorder, markersize=5)
    ax.set_xlabel("deadline / job length")
    ax.set_ylabel("cost / on-demand cost of the work")
    ax.set_title(f"cost vs deadline slack ({jobs} jobs of {job_hours:g} h)")
    ax.grid(alpha=0.3)
    ax.legend()


def _draw_timelines(ax: Any, timelines: dict[str, list[tuple[float, float, str]]], *, deadline_hours: float,
                    start_tick: int) -> None:
    for name, pts in timelines.items():
        if not pts:
            continue
        st = policy_style(name)
        ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], label=name, color=st.colour, ls=st.linestyle,
                lw=st.linewidth, zorder=st.zorder)
        od = [(x, y) for x, y, k in pts if k == "od"]
        if od:
            ax.scatter([x for x, _ in od], [y for _, y in od], s=8, color=st.colour, marker="s",
                       zorder=st.zorder, gid=f"{name} on-demand")
    ax.axvline(deadline_hours, color="k", ls="--", lw=1)
    ax.text(deadline_hours, 0, " deadline", va="bottom")
    ax.set_xlabel("hours since submission")
    ax.set_ylabel("work done (h)")
    ax.set_title(f"one job, start tick {start_tick} (squares: on-demand)")
    ax.grid(alpha=0.3)
    ax.legend()


def replay_figure(
    sc: Scenario,
    ov: WorldParams,
    *,
    job_hours: float,
    deadline_hours: float,
    nodes: int,
    jobs: int,
    policies: Sequence[str],
) -> Any:
    """The two-panel figure (a matplotlib Figure; the caller saves and closes it)."""
    for p in policies:
        policy_style(p)  # an unknown policy fails before any replay
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
    _draw_cost(a1, curves, jobs=jobs, job_hours=job_hours)

    # the job that sees the most preemptions under greedy_spot: the interesting one
    cands = make_jobs(sc, job_hours=job_hours, deadline_hours=deadline_hours, nodes=nodes, count=jobs)
    from simulations.world_policy import run_policy_job

    job = max(cands, key=lambda j: run_policy_job(ONLINE["greedy_spot"](), sc, j, ov).preemptions)
    timelines = _job_timelines(sc, ov, job, [p for p in policies if p != "optimal"])
    _draw_timelines(a2, timelines, deadline_hours=deadline_hours, start_tick=job.start_tick)
    zones = ", ".join(z.name for z in sc.zones)
    fig.suptitle(f"{zones}  (tick {sc.tick_s:.0f} s)")
    fig.tight_layout()
    return fig


def plot_replay(
    sc: Scenario,
    ov: WorldParams,
    out: str,
    *,
    job_hours: float,
    deadline_hours: float,
    nodes: int,
    jobs: int,
    policies: Sequence[str],
) -> None:
    import matplotlib.pyplot as plt

    fig = replay_figure(sc, ov, job_hours=job_hours, deadline_hours=deadline_hours, nodes=nodes, jobs=jobs,
                        policies=policies)
    fig.savefig(out, dpi=110)
    plt.close(fig)
