"""Run several policies over the same jobs on the same scenario and summarise.

Role: the library behind ``python -m simulations replay``. Jobs start at K evenly spaced ticks of
the (cyclic) trace. Every online policy (the baselines and orchd) runs every job in the faithful
world (``world`` / ``world_policy``) with the same random draws (``worldparams.Draws``, one table per
scenario) and one cost accounting (``orchd_policy.world_job_result``). ``optimal`` is solved for all
jobs at once by dynamic programming over the trace with the least overheads the world can charge
(``WorldParams.bound_overheads``), so it is a lower bound, not a run in the world.

Fields per policy (means over jobs):
  cost_ratio    cost / on-demand cost of the same work (no overheads) - lower is better
  deadline_met  fraction of jobs finished by their deadline
  preemptions   spot preemptions per job
  lost_hours    hours per job without progress while billed (launch, restart, saves, migration)
  goodput       useful hours / billed hours
``optimal`` reports only cost_ratio and deadline_met (its schedule is not reconstructed).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from simulations.engine import Job, JobResult, Policy
from simulations.policies import ONLINE
from simulations.policies.optimal import od_work_cost, optimal_costs
from simulations.scenario import Scenario, job_quanta
from simulations.worldparams import Draws, WorldParams, capacity_scores


@dataclass(frozen=True, slots=True)
class Summary:
    cost_ratio: float
    deadline_met: float
    preemptions: float | None
    lost_hours: float | None
    goodput: float | None
    jobs: int
    per_job_cost_ratio: tuple[float, ...] = field(default=(), repr=False)
    per_job_met: tuple[bool, ...] = field(default=(), repr=False)
    od_share: float | None = None  # mean share of billed node-hours on on-demand (None: the offline bound)
    # median over the jobs of the moves from on-demand back to spot (None: the offline bound)
    spot_returns: float | None = None

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "cost_ratio": _r(self.cost_ratio),
            "deadline_met": _r(self.deadline_met),
            "preemptions": _r(self.preemptions),
            "lost_hours": _r(self.lost_hours),
            "goodput": _r(self.goodput),
            "od_share": _r(self.od_share),
            "spot_returns_median": _r(self.spot_returns),
            "jobs": self.jobs,
        }


def _r(x: float | None) -> float | None:
    return None if x is None else round(float(x), 4)


def make_jobs(sc: Scenario, *, job_hours: float, deadline_hours: float, nodes: int, count: int) -> list[Job]:
    if job_hours <= 0 or deadline_hours < job_hours:
        raise ValueError("need 0 < job hours <= deadline hours")
    W = job_quanta(sc, job_hours * 3600.0)
    D = int(math.floor(deadline_hours * 3600.0 / sc.tick_s + 1e-9))
    T = sc.n_ticks
    return [Job(start_tick=int(i * T // count), work_q=W, deadline_ticks=D, nodes=nodes) for i in range(count)]


def summarize(results: list[JobResult], sc: Scenario) -> Summary:
    ratios = [r.cost_usd / r.od_work_cost_usd for r in results]
    q_h = sc.quantum_s / 3600.0
    return Summary(
        cost_ratio=float(np.mean(ratios)),
        deadline_met=float(np.mean([r.deadline_met for r in results])),
        preemptions=float(np.mean([r.preemptions for r in results])),
        lost_hours=float(np.mean([r.overhead_q * q_h for r in results])),
        goodput=float(np.mean([(r.billed_q - r.overhead_q) / r.billed_q if r.billed_q else 0.0 for r in results])),
        jobs=len(results),
        per_job_cost_ratio=tuple(ratios),
        per_job_met=tuple(bool(r.deadline_met) for r in results),
        od_share=None if any(r.od_share is None for r in results) else float(np.mean([r.od_share for r in results])),
        spot_returns=float(np.median([r.spot_returns for r in results])) if results else None,
    )


def policy_factory(name: str) -> Callable[[], Policy]:
    if name in ONLINE:
        return ONLINE[name]
    raise ValueError(f"unknown policy {name!r}")


_CTX: dict = {}


def _world_chunk(idx: list[int]) -> list[JobResult]:
    from simulations.orchd_policy import OrchdRunner, world_job_result
    from simulations.world_policy import run_policy_job

    sc, jobs, wp, kw, name = _CTX["sc"], _CTX["jobs"], _CTX["wp"], _CTX["kw"], _CTX["name"]
    draws, scores = _CTX["draws"], _CTX["scores"]
    if name == "orchd":
        runner = OrchdRunner(**kw)
        return [runner.run(sc, jobs[i], wp, draws=draws, scores=scores) for i in idx]
    make = policy_factory(name)
    return [world_job_result(sc, jobs[i], run_policy_job(make(), sc, jobs[i], wp, draws=draws, scores=scores))
            for i in idx]


def _optimal_chunk(idx: list[int]) -> np.ndarray:
    sc, jobs, wp = _CTX["sc"], _CTX["jobs"], _CTX["wp"]
    return optimal_costs(sc, [jobs[i] for i in idx], wp.bound_overheads())


def _run_chunks(fn, n: int, workers: int, ctx: dict) -> list:
    """fn over index chunks, in forked worker processes when workers > 1 (inputs inherited, not pickled)."""
    import multiprocessing as mp

    _CTX.update(ctx)
    try:
        if workers <= 1:
            return list(fn(list(range(n))))
        chunks = [list(range(i, n, workers)) for i in range(workers)]
        with mp.get_context("fork").Pool(workers) as pool:
            parts = pool.map(fn, chunks)
    finally:
        _CTX.clear()
    out: list = [None] * n
    for idx, part in zip(chunks, parts, strict=True):
        for i, r in zip(idx, part, strict=True):
            out[i] = r
    return out


def replay(
    sc: Scenario,
    jobs: list[Job],
    policies: Iterable[str],
    wp: WorldParams | None = None,
    *,
    progress: Callable[[int], None] | None = None,
    orchd_kw: dict | None = None,
    workers: int = 1,
) -> dict[str, Summary]:
    """Every policy on every job, in one world. ``workers`` > 1 forks processes."""
    wp = wp or WorldParams()
    out: dict[str, Summary] = {}
    usable = sc.usable(jobs[0].nodes) if jobs else None
    par = workers if workers > 1 and len(jobs) >= 2 * workers else 1
    ctx = {"sc": sc, "jobs": jobs, "wp": wp, "kw": orchd_kw or {}}
    if usable is not None:
        ctx["draws"] = Draws.make(len(sc.zones), sc.n_ticks, wp)
        ctx["scores"] = capacity_scores(usable, wp)
    for name in policies:
        if name == "optimal":
            if par > 1:
                costs = np.asarray(_run_chunks(_optimal_chunk, len(jobs), par, ctx), dtype=float)
            else:
                costs = optimal_costs(sc, jobs, wp.bound_overheads(), usable=usable)
            base = np.asarray([od_work_cost(sc, j) for j in jobs])
            ok = np.isfinite(costs)
            ratios = np.where(ok, costs / base, np.nan)
            out[name] = Summary(
                cost_ratio=float(np.nanmean(ratios)) if ok.any() else float("nan"),
                deadline_met=float(ok.mean()),
                preemptions=None,
                lost_hours=None,
                goodput=None,
                jobs=len(jobs),
                per_job_cost_ratio=tuple(float(x) for x in ratios),
                per_job_met=tuple(bool(x) for x in ok),
            )
            if progress:
                progress(len(jobs))
            continue
        if name != "orchd":
            policy_factory(name)  # unknown names fail before any work
        results = _run_chunks(_world_chunk, len(jobs), par, {**ctx, "name": name})
        if progress:
            progress(len(jobs))
        out[name] = summarize(results, sc)
    return out
