"""The ``orchd`` policy: every decision comes from ``orchestrator.core.decide`` (the daemon's code).

Role: run one faithful ``World`` per job with the core's own default configuration (its estimates
of boot time, save time, step time and preemption rates are learned from what the world shows it;
the notice lengths are the product's per-cloud defaults) and convert the world's outcome into the
replay's ``JobResult`` (``world_job_result``, shared with the baselines). There is deliberately no
policy logic here: if orchd loses, the core's decisions are the reason.

Tuning: ``TUNED`` is the CoreConfig override chosen by ``python -m simulations tune`` (empty: the
core's defaults).
"""

from __future__ import annotations

from typing import Any

import msgspec

from orchestrator.core import CoreConfig
from simulations.engine import Job, JobResult
from simulations.scenario import Scenario
from simulations.world import World, WorldResult
from simulations.worldparams import Draws, WorldParams

TUNED: dict[str, Any] = {}


def core_config(**overrides: Any) -> CoreConfig:
    """The core's own defaults (nothing copied from the world's physics), plus policy overrides."""
    return msgspec.structs.replace(CoreConfig(), **{**TUNED, **overrides})


def world_job_result(sc: Scenario, job: Job, r: WorldResult) -> JobResult:
    """The replay's per-job record of a world run (orchd or a baseline): one accounting for all."""
    od_price = float(sc.od_price.min())
    work_h = job.work_q * sc.quantum_s / 3600.0
    billed_h = r.billed_node_s / 3600.0 / job.nodes
    done_ticks = (r.done_ts / sc.tick_s) if r.done_ts is not None else float("inf")
    q = sc.quantum_s / 3600.0
    # a job not finished in the world is finished on on-demand afterwards (and misses its deadline)
    unfinished_h = max(0.0, work_h - r.useful_s / 3600.0) if r.done_ts is None else 0.0
    return JobResult(
        cost_usd=r.cost_usd + unfinished_h * job.nodes * od_price,
        od_work_cost_usd=work_h * job.nodes * od_price,
        done_ticks=done_ticks,
        deadline_met=r.deadline_met,
        preemptions=r.preemptions,
        overhead_q=int(round(max(0.0, billed_h - (r.useful_s / 3600.0)) / q)),
        billed_q=int(round(billed_h / q)),
        starts=0,
        od_share=r.od_node_s / r.billed_node_s if r.billed_node_s > 0 else 0.0,
        spot_returns=r.spot_returns,
    )


def run_orchd_job(
    sc: Scenario,
    job: Job,
    wp: WorldParams | None = None,
    *,
    config: CoreConfig | None = None,
    record: bool = False,
    capacity_hints: bool = True,
    draws: Draws | None = None,
    scores: Any = None,
) -> tuple[JobResult, WorldResult]:
    w = World(sc, job, wp, config=config or core_config(), record=record, capacity_hints=capacity_hints,
              draws=draws, scores=scores)
    r = w.run()
    return world_job_result(sc, job, r), r


class OrchdRunner:
    """What ``replay`` calls for the ``orchd`` policy (one World per job)."""

    name = "orchd"

    def __init__(self, capacity_hints: bool = True, **overrides: Any) -> None:
        self.capacity_hints = capacity_hints
        self.overrides = overrides

    def run(self, sc: Scenario, job: Job, wp: WorldParams, *, draws: Draws | None = None,
            scores: Any = None) -> JobResult:
        cfg = core_config(**self.overrides)
        return run_orchd_job(sc, job, wp, config=cfg, capacity_hints=self.capacity_hints, draws=draws,
                             scores=scores)[0]
