"""The documented results table: every policy on every trace family in ../shared/traces.

Role: ``python -m simulations table``. Every policy runs in the faithful world (``replay``); the
table is a grid of settings per trace family (a family = one collection: cloud, date, instance
type): job size 1/4/16 nodes x notice 120/30 s x job/deadline 12/24, 24/36, 48/72, 48/60 h x spot
at 0.25/0.33/0.5 of on-demand, every zone of the family. Traces are read from ../shared at run time
(the SkyPilot traces have no licence: never copied into this repository).

Leave-one-family-out: orchd's CoreConfig overrides for family F are chosen by ``tune.choose`` on
the other families only (a small grid, one tuning setting per family), then F is reported with them.

k-node jobs on traces probed with fewer nodes (1-node files; 16 nodes on a 4-node trace): a zone
whose probe got every node it asked for is read as "room for the job" (``scenario.probe_capacity``),
which is optimistic for large jobs, so those rows are marked ``probe<k`` and summarised apart.

Per setting: cost / on-demand cost of the same work and deadlines met per policy, the gap of orchd
to optimal and to each baseline, and the goals (100% deadlines; <= every baseline that met 100%;
<= 1.10 x optimal; the mean gap over all settings <= 5%).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from simulations.cli import progress_bar
from simulations.families import FAMILIES, NOT_FAMILIES, Family, family_scenario, load_family
from simulations.policies import ALL_POLICIES
from simulations.replay import Summary, make_jobs, replay
from simulations.worldparams import WorldParams

BASELINES = ("on_demand", "greedy_spot", "failover", "uniform_progress")

NODES = (1, 4, 16)
NOTICES = (120.0, 30.0)
SHAPES = ((12.0, 24.0), (24.0, 36.0), (48.0, 72.0), (48.0, 60.0))
RATIOS = (0.25, 0.33, 0.5)


RESTARTS = (0.05 * 3600.0, 0.2 * 3600.0)  # the decision-step world's restart overheads r


@dataclass(frozen=True)
class Setting:
    nodes: int
    notice_s: float  # the faithful world's notice length; the decision-step world's restart overhead r
    job_h: float
    deadline_h: float
    ratio: float
    world: str = "faithful"  # or "step": WorldParams.step_world, whose steps are the trace's ticks

    @property
    def label(self) -> str:
        kind = f"r={self.notice_s / 3600:g}h" if self.world == "step" else f"{self.notice_s:.0f}s"
        return f"{self.nodes}n {kind} {self.job_h:g}/{self.deadline_h:g}h spot {self.ratio:g}"

    def world_params(self) -> WorldParams:
        if self.world == "step":
            return WorldParams.step_world(restart_s=self.notice_s)
        return WorldParams(notice_override_s=self.notice_s)


def settings(nodes=NODES, notices=NOTICES, shapes=SHAPES, ratios=RATIOS, world: str = "faithful") -> list[Setting]:
    """The grid; in the decision-step world ``notices`` are restart overheads (default ``RESTARTS``)."""
    return [Setting(n, nt, j, d, r, world)
            for n, nt, (j, d), r in itertools.product(nodes, notices, shapes, ratios)]


@dataclass(frozen=True)
class Row:
    family: str
    setting: Setting
    zones: tuple[str, ...]
    probe: int  # the family's probe size (smallest over its files)
    results: dict[str, Summary]
    tuned: dict[str, Any] = field(default_factory=dict)
    truncated: tuple[tuple[str, int], ...] = ()
    # per job: its start time is not one of the tuning's (``tune_jobs`` start times per setting, the ones
    # the leave-one-family-out tuning scores): the part of the row nothing was tuned on
    fresh: tuple[bool, ...] = ()

    @property
    def extrapolated(self) -> bool:
        return self.setting.nodes > self.probe

    def fresh_only(self) -> Row | None:
        """The row over its fresh jobs only (None without any): every policy's summary of those jobs."""
        idx = [i for i, f in enumerate(self.fresh) if f]
        if not idx:
            return None
        res = {p: _subset(s, idx) for p, s in self.results.items()}
        return Row(self.family, self.setting, self.zones, self.probe, res, self.tuned, self.truncated,
                   tuple(True for _ in idx))


def _subset(s: Summary, idx: list[int]) -> Summary:
    """``s`` over the jobs ``idx`` (cost and deadlines; the other means are not kept per job)."""
    costs = tuple(s.per_job_cost_ratio[i] for i in idx)
    met = tuple(s.per_job_met[i] for i in idx)
    finite = [c for c in costs if np.isfinite(c)]
    return Summary(cost_ratio=float(np.mean(finite)) if finite else float("nan"),
                   deadline_met=float(np.mean(met)), preemptions=None, lost_hours=None, goodput=None,
                   jobs=len(idx), per_job_cost_ratio=costs, per_job_met=met)


_LOADED: dict[str, Any] = {}


def _row(task: tuple[Family, Setting, int, tuple[str, ...], dict[str, Any], int]) -> Row:
    fam, st, jobs, policies, tuned, tune_jobs = task
    trs, probe = _LOADED[fam.key]
    sc = family_scenario(trs, st.ratio)
    js = make_jobs(sc, job_hours=st.job_h, deadline_hours=st.deadline_h, nodes=st.nodes, count=jobs)
    seen = {j.start_tick for j in make_jobs(sc, job_hours=st.job_h, deadline_hours=st.deadline_h, nodes=st.nodes,
                                            count=tune_jobs)}
    res = replay(sc, js, policies, st.world_params(), orchd_kw=tuned)
    return Row(fam.key, st, tuple(z.name for z in sc.zones), probe, res, tuned, sc.truncated,
               tuple(j.start_tick not in seen for j in js))


def run_table(root: Path, *, jobs: int = 8, progress: bool | None = None, families=FAMILIES,
              grid: list[Setting] | None = None, policies=ALL_POLICIES, workers: int = 1,
              tune_jobs: int = 4, loo: bool = True) -> list[Row]:
    """Every (family, setting) of ``grid``; settings run in ``workers`` forked processes."""
    import multiprocessing as mp

    from simulations.tune import choose

    grid = grid if grid is not None else settings()
    loaded = {f.key: load_family(root, f) for f in families}
    tuned: dict[str, dict[str, Any]] = {f.key: {} for f in families}
    if loo and "orchd" in policies and len(families) > 1:
        tuned = choose(root, list(families), loaded, jobs=tune_jobs, workers=workers)
    tasks = [(fam, st, jobs, tuple(policies), tuned[fam.key], tune_jobs) for fam in families for st in grid]
    rows: list[Row] = []
    _LOADED.update(loaded)
    try:
        with progress_bar(len(tasks), "table", progress) as adv:
            if workers <= 1:
                for t in tasks:
                    rows.append(_row(t))
                    adv(1)
            else:
                with mp.get_context("fork").Pool(workers) as pool:
                    for r in pool.imap(_row, tasks):
                        rows.append(r)
                        adv(1)
    finally:
        _LOADED.clear()
    return rows


def core_version() -> str:
    """The orchestrator/core the orchd numbers came from: last commit touching it, and whether the
    working tree differs from it (results from a dirty core are not reproducible from git)."""
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    try:
        rev = subprocess.run(["git", "log", "-1", "--format=%h %cs", "--", "orchestrator/core"], cwd=repo,
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "orchestrator/core"], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{rev}{' + uncommitted changes' if dirty else ''}"


def orchd_goal(r: Row) -> dict[str, Any]:
    res = r.results
    if "orchd" not in res or "optimal" not in res:
        return {}
    o, opt = res["orchd"], res["optimal"]
    beats = {}
    for b in BASELINES:
        if b in res and res[b].deadline_met >= 1.0:
            beats[b] = o.cost_ratio <= res[b].cost_ratio + 1e-12
    bound = opt.cost_ratio if opt.cost_ratio and np.isfinite(opt.cost_ratio) else None
    gap = o.cost_ratio / bound - 1.0 if bound else None
    met_all = [b for b in BASELINES if b in res and res[b].deadline_met >= 1.0]
    best = min(met_all, key=lambda b: res[b].cost_ratio, default=None)
    return {
        "deadlines_100pct": o.deadline_met >= 1.0,
        "gap_to_optimal": None if gap is None else round(gap, 4),
        "within_10pct_of_optimal": gap is not None and gap <= 0.10 + 1e-12,
        "not_above_baselines_that_met_all": beats,
        "gap_to_baselines": {b: round(o.cost_ratio / res[b].cost_ratio - 1.0, 4) for b in BASELINES
                             if b in res and res[b].cost_ratio},
        # why a goal is missed, from the same runs: the cheapest baseline that met every deadline and its
        # gap to the bound (an online policy's reach), and per baseline the jobs orchd was not above it in
        "jobs": o.jobs,
        "best_baseline": best,
        "best_baseline_gap_to_optimal": (round(res[best].cost_ratio / bound - 1.0, 4)
                                         if best is not None and bound else None),
        "jobs_not_above": {b: sum(oc <= bc + 1e-12 for oc, bc in
                                  zip(o.per_job_cost_ratio, res[b].per_job_cost_ratio, strict=True))
                           for b in met_all},
        "od_share": {p: _r3(res[p].od_share) for p in ("orchd", *met_all)},
        "spot_returns_median": {p: res[p].spot_returns for p in ("orchd", *BASELINES) if p in res},
        "preemptions": {p: _r3(res[p].preemptions) for p in ("orchd", *BASELINES) if p in res},
    }


def _r3(x: float | None) -> float | None:
    return None if x is None else round(float(x), 3)


def goal_met(g: dict[str, Any]) -> bool:
    return bool(g) and g["deadlines_100pct"] and g["within_10pct_of_optimal"] and all(
        g["not_above_baselines_that_met_all"].values())


def format_results(rows: list[Row]) -> str:
    if not rows:
        return "no rows"
    pols = list(dict.fromkeys(p for r in rows for p in r.results))
    jobs = next(iter(rows[0].results.values())).jobs
    lines = [
        f"cost_ratio (deadline_met) per policy, {jobs} jobs per setting; every policy in the "
        f"{'decision-step' if rows[0].setting.world == 'step' else 'faithful'} world, "
        f"optimal = offline bound; orchestrator/core {core_version()}",
        "not families: " + "; ".join(NOT_FAMILIES),
    ]
    for fam in dict.fromkeys(r.family for r in rows):
        fr = [r for r in rows if r.family == fam]
        lines.append(f"- {fam}: zones {', '.join(fr[0].zones)}; probe {fr[0].probe} node(s)"
                     + (f"; cut to the shortest: {', '.join(f'{z} ({n} ticks)' for z, n in fr[0].truncated)}"
                        if fr[0].truncated else "")
                     + f"; orchd overrides (tuned on the other families): {fr[0].tuned or 'none'}")
    for part, sel in (("jobs within the traces' probe size", False), ("k-node jobs on smaller probes (probe<k)", True)):
        sub = [r for r in rows if r.extrapolated == sel]
        if not sub:
            continue
        lines += ["", f"### {part}", "",
                  "| family | setting | " + " | ".join(pols) + " | orchd vs optimal | orchd vs baselines | goal |",
                  "|" + "---|" * (len(pols) + 5)]
        for r in sub:
            g = orchd_goal(r)
            cells = [f"{r.results[p].cost_ratio:.3f} ({r.results[p].deadline_met:.0%})" if p in r.results else "-"
                     for p in pols]
            vs_opt = "-" if not g or g["gap_to_optimal"] is None else f"{g['gap_to_optimal']:+.1%}"
            vs_b = ", ".join(f"{b[:4]} {v:+.1%}" for b, v in g.get("gap_to_baselines", {}).items()) or "-"
            lines.append(f"| {r.family} | {r.setting.label} | " + " | ".join(cells)
                         + f" | {vs_opt} | {vs_b} | {_goal_cell(g)} |")
    lines += ["", summary_lines(rows)]
    fresh = [f for f in (r.fresh_only() for r in rows) if f is not None]
    if fresh:
        lines += ["", f"the same over the start times the tuning does not use ({len(fresh[0].fresh)} of {jobs} jobs "
                  "per setting):", summary_lines(fresh)]
    return "\n".join(lines)


def _goal_cell(g: dict[str, Any]) -> str:
    """MET, or each missed goal with what the same runs say about it: over the bound, how far the best
    baseline is from it too; above a baseline, in how many jobs orchd was not above it, and each one's
    share of node-hours on on-demand."""
    if not g:
        return "-"
    if goal_met(g):
        return "MET"
    why = []
    if not g["deadlines_100pct"]:
        why.append("deadlines")
    if not g["within_10pct_of_optimal"]:
        best, bgap = g["best_baseline"], g["best_baseline_gap_to_optimal"]
        why.append(">10% over optimal" + (f" (best baseline {best} {bgap:+.1%})" if best and bgap is not None else ""))
    jobs = g["jobs_not_above"]
    od = g["od_share"]
    for b, ok in g["not_above_baselines_that_met_all"].items():
        if not ok:
            share = (f"; on-demand {od['orchd']:.0%} vs {od[b]:.0%}" if od.get("orchd") is not None
                     and od.get(b) is not None else "")
            why.append(f"above {b} (not above it in {jobs[b]} of {g['jobs']} jobs{share})")
    return "NOT MET: " + ", ".join(why)


def summary_lines(rows: list[Row]) -> str:
    out = []
    for part, sel in (("within probe size", False), ("probe<k", True)):
        sub = [(r, orchd_goal(r)) for r in rows if r.extrapolated == sel]
        sub = [(r, g) for r, g in sub if g]
        if not sub:
            continue
        gaps = [g["gap_to_optimal"] for _, g in sub if g["gap_to_optimal"] is not None]
        met = sum(goal_met(g) for _, g in sub)
        dl = sum(g["deadlines_100pct"] for _, g in sub)
        w10 = sum(g["within_10pct_of_optimal"] for _, g in sub)
        mean_gap = float(np.mean(gaps)) if gaps else float("nan")
        out.append(f"summary ({part}): {len(sub)} settings; all goals met in {met}; 100% deadlines in {dl}; "
                   f"<= 1.10 x optimal in {w10}; mean gap to optimal {mean_gap:+.1%} (goal <= +5%: "
                   f"{'MET' if mean_gap <= 0.05 else 'NOT MET'})")
        for b in BASELINES:
            pairs = [(g["not_above_baselines_that_met_all"][b]) for _, g in sub
                     if b in g["not_above_baselines_that_met_all"]]
            if pairs:
                out.append(f"  orchd <= {b} in {sum(pairs)} of the {len(pairs)} settings where {b} met 100%")
        out.append("  " + _churn_line([g for _, g in sub]))
        out.append("  " + _why_counts([g for _, g in sub]))
    return "\n".join(out)


def _churn_line(goals: list[dict[str, Any]]) -> str:
    """Moves from on-demand back to spot: the settings where orchd's median per job is at most greedy's
    plus one, and the medians over the settings."""
    pairs = [(g["spot_returns_median"].get("orchd"), g["spot_returns_median"].get("greedy_spot")) for g in goals]
    pairs = [(o, b) for o, b in pairs if o is not None and b is not None]
    if not pairs:
        return "churn: no figures"
    within = sum(1 for o, b in pairs if o <= b + 1)
    med_o = float(np.median([o for o, _ in pairs]))
    med_b = float(np.median([b for _, b in pairs]))
    return (f"churn: median moves back to spot per job <= greedy_spot's + 1 in {within} of {len(pairs)} settings "
            f"(median over the settings: orchd {med_o:g}, greedy_spot {med_b:g})")


def _why_counts(goals: list[dict[str, Any]]) -> str:
    """What the missed goals have in common: over the bound where the best baseline is too (no online
    policy here came near it), above a baseline in fewer than half the jobs (one job decides the row)."""
    over = [g for g in goals if not g["within_10pct_of_optimal"]]
    over_too = sum(1 for g in over if (g["best_baseline_gap_to_optimal"] or 0.0) > 0.10 + 1e-12)
    above = [(g, b) for g in goals for b, ok in g["not_above_baselines_that_met_all"].items() if not ok]
    minority = sum(1 for g, b in above if 2 * (g["jobs"] - g["jobs_not_above"][b]) < g["jobs"])
    half = sum(1 for g, b in above if 2 * (g["jobs"] - g["jobs_not_above"][b]) == g["jobs"])
    return (f"why: > 1.10 x optimal in {len(over)} settings, in {over_too} of them the best baseline that met "
            f"100% is too; above a baseline in {len(above)} (setting, baseline) pairs, in {minority} of them "
            f"above it in fewer than half the jobs and in {half} in exactly half")


def results_json(rows: list[Row]) -> str:
    return json.dumps(
        {
            "core": core_version(),
            "not_families": list(NOT_FAMILIES),
            "rows": [
                {
                    "family": r.family, "setting": r.setting.__dict__, "zones": list(r.zones), "probe_nodes": r.probe,
                    "extrapolated": r.extrapolated, "truncated": [list(x) for x in r.truncated], "tuned": r.tuned,
                    "policies": {k: v.as_dict() for k, v in r.results.items()},
                    "orchd_goal": orchd_goal(r), "goal_met": goal_met(orchd_goal(r)), "fresh_jobs": list(r.fresh),
                }
                for r in rows
            ],
        },
        indent=2, allow_nan=False, default=str,
    )
