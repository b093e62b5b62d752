"""Tuning of orchd's CoreConfig overrides on the TUNING trace family only (results.FAMILIES).

Role: a small grid search, so that the numbers reported on the other families are out-of-sample.
Objective: mean cost_ratio over the tuning family's settings, with any missed deadline ruling a
configuration out. Prints every configuration and the best; the chosen overrides are copied by hand
into ``orchd_policy.TUNED`` (and the date/commit into docs/simulations.md).
"""

from __future__ import annotations

import itertools
from pathlib import Path

from simulations import scenario as scen
from simulations import traces
from simulations.overheads import Overheads
from simulations.replay import make_jobs, replay
from simulations.results import DEADLINE_HOURS, FAMILIES, JOB_HOURS, settings_of

GRID = {
    "deadline_margin": (0.05, 0.1, 0.2),
    "preempted_penalty": (0.0, 1.0, 4.0),
    "migrate_horizon_h": (2.0, 6.0, 24.0),
}


def tune(root: Path, *, jobs: int = 10, workers: int = 1) -> str:
    fam = next(f for f in FAMILIES if f.role == "tuning")
    book = traces.load_prices(root / fam.prices) if fam.prices else None
    sc = scen.build([traces.load_trace(f) for f in sorted(root.glob(fam.glob))], prices=book,
                    spot_price_ratio=fam.ratio)
    subs = [sc.subset(idx) for _, idx in settings_of(sc)]
    ov = Overheads()
    lines, best = [], None
    keys = list(GRID)
    for values in itertools.product(*(GRID[k] for k in keys)):
        kw = dict(zip(keys, values, strict=True))
        ratios, met = [], []
        for s in subs:
            js = make_jobs(s, job_hours=JOB_HOURS, deadline_hours=DEADLINE_HOURS, nodes=fam.nodes, count=jobs)
            r = replay(s, js, ["orchd"], ov, orchd_kw=kw, workers=workers)["orchd"]
            ratios.append(r.cost_ratio)
            met.append(r.deadline_met)
        score = sum(ratios) / len(ratios)
        ok = min(met) >= 1.0
        lines.append(f"{kw}  cost_ratio {score:.4f}  deadlines {'all met' if ok else f'min {min(met):.0%}'}")
        key = (not ok, score)
        if best is None or key < best[0]:
            best = (key, kw)
    assert best is not None
    lines.append(f"best on {fam.key}: {best[1]} (all deadlines met: {not best[0][0]}, cost_ratio {best[0][1]:.4f})")
    return "\n".join(lines)
