"""Leave-one-family-out tuning of orchd's CoreConfig overrides.

Role: for each trace family F, pick from a small grid the overrides that do best on the OTHER
families (the tuning settings: 1-node jobs, 120 s and 30 s notice, 12/24, 24/36, 48/72 and 48/60 h,
spot at 0.33), so the numbers reported on F are out-of-sample. Objective: mean cost_ratio over the
other families and the tuning settings, any missed deadline ruling a configuration out; ties go to the
earlier grid entry (the core's defaults first).
``python -m simulations tune`` prints every configuration's score on every family.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from simulations.replay import make_jobs, replay
from simulations.worldparams import WorldParams

GRID: tuple[dict[str, Any], ...] = (
    {},
    {"progress_line_margin_s": 3600.0},
    {"preempted_penalty": 0.0},
    {"migrate_horizon_h": 24.0},
)
TUNING: tuple[dict[str, float], ...] = tuple(  # 1-node jobs
    {"notice_s": n, "job_h": j, "deadline_h": d, "ratio": 0.33}
    for n in (120.0, 30.0) for j, d in ((12.0, 24.0), (24.0, 36.0), (48.0, 72.0), (48.0, 60.0))
)


_CTX: dict[str, Any] = {}


def _score(task: tuple[int, int, int]) -> float:
    from simulations.families import family_scenario

    i, j, k = task
    fam, jobs, st = _CTX["families"][i], _CTX["jobs"], TUNING[k]
    sc = family_scenario(_CTX["loaded"][fam.key][0], st["ratio"])
    js = make_jobs(sc, job_hours=st["job_h"], deadline_hours=st["deadline_h"], nodes=1, count=jobs)
    r = replay(sc, js, ["orchd"], WorldParams(notice_override_s=st["notice_s"]), orchd_kw=GRID[j])["orchd"]
    return r.cost_ratio if r.deadline_met >= 1.0 else float("inf")


def scores(root: Path, families: list, loaded: dict, *, jobs: int = 4, workers: int = 1) -> np.ndarray:
    """(families, grid) mean cost_ratio over the tuning settings; inf where a deadline was missed."""
    import multiprocessing as mp

    tasks = [(i, j, k) for i in range(len(families)) for j in range(len(GRID)) for k in range(len(TUNING))]
    _CTX.update(families=families, loaded=loaded, jobs=jobs)
    try:
        if workers <= 1:
            vals = [_score(t) for t in tasks]
        else:
            with mp.get_context("fork").Pool(workers) as pool:
                vals = pool.map(_score, tasks)
    finally:
        _CTX.clear()
    return np.asarray(vals, dtype=float).reshape(len(families), len(GRID), len(TUNING)).mean(axis=2)


def choose(root: Path, families: list, loaded: dict, *, jobs: int = 4, workers: int = 1) -> dict[str, dict[str, Any]]:
    """family key -> the overrides chosen on the other families."""
    s = scores(root, families, loaded, jobs=jobs, workers=workers)
    out = {}
    for i, fam in enumerate(families):
        others = np.delete(s, i, axis=0)
        mean = others.mean(axis=0) if len(others) else np.zeros(len(GRID))
        out[fam.key] = dict(GRID[int(np.argmin(mean))])
    return out


def tune(root: Path, *, jobs: int = 4, workers: int = 1) -> str:
    from simulations.families import FAMILIES, load_family

    loaded = {f.key: load_family(root, f) for f in FAMILIES}
    s = scores(root, list(FAMILIES), loaded, jobs=jobs, workers=workers)
    lines = [f"mean orchd cost_ratio over {len(TUNING)} 1-node settings (notice 120/30 s x 12/24, 24/36, 48/72, "
             f"48/60 h, spot 0.33; {jobs} jobs each; inf = a deadline missed)"]
    for j, kw in enumerate(GRID):
        lines.append(f"{kw or 'core defaults'}: " + ", ".join(f"{f.key} {s[i, j]:.4f}" for i, f in enumerate(FAMILIES)))
    ch = choose(root, list(FAMILIES), loaded, jobs=jobs, workers=workers)
    lines += [f"chosen for {k} (on the others): {v or 'core defaults'}" for k, v in ch.items()]
    return "\n".join(lines)
