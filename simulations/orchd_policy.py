"""The ``orchd`` policy: every decision comes from ``orchestrator.core.decide`` (the daemon's code).

Role: build the core's configuration for a scenario (its cost/time estimates set to the same overhead
constants the world uses - nothing else), run one ``World`` per job and convert the world's outcome
into the replay's ``JobResult``. There is deliberately no policy logic here: if orchd loses, the
core's decisions are the reason (see docs/simulations.md for what was found).

Tuning: ``TUNED`` is the CoreConfig override chosen on the tuning trace family (see
docs/simulations.md); reports use other families.
"""

from __future__ import annotations

from typing import Any

import msgspec

from orchestrator.core import CoreConfig
from simulations.engine import Job, JobResult
from simulations.overheads import Overheads
from simulations.scenario import Scenario
from simulations.world import World, WorldResult

TUNED: dict[str, Any] = {}


def core_config(ov: Overheads, **overrides: Any) -> CoreConfig:
    """The core's estimates aligned with the world's physics, plus policy overrides."""
    base = CoreConfig(
        boot_s_estimate=ov.launch_delay_s,
        restart_overhead_s=ov.restart_s,
        notice_window_aws_s=ov.notice_s,
        notice_window_gcp_s=ov.notice_s,
        notice_window_azure_s=ov.notice_s,
        notice_window_default_s=ov.notice_s,
    )
    return msgspec.structs.replace(base, **{**TUNED, **overrides})


def run_orchd_job(
    sc: Scenario,
    job: Job,
    ov: Overheads,
    *,
    config: CoreConfig | None = None,
    record: bool = False,
    capacity_hints: bool = True,
) -> tuple[JobResult, WorldResult]:
    w = World(sc, job, ov, config=config or core_config(ov), record=record, capacity_hints=capacity_hints)
    r = w.run()
    od_price = float(sc.od_price.min())
    work_h = job.work_q * sc.quantum_s / 3600.0
    billed_h = r.billed_node_s / 3600.0 / job.nodes
    done_ticks = (r.done_ts / sc.tick_s) if r.done_ts is not None else float("inf")
    q = sc.quantum_s / 3600.0
    # a job the core did not finish is finished on on-demand afterwards, as the engine does for baselines
    unfinished_h = max(0.0, work_h - r.useful_s / 3600.0) if r.done_ts is None else 0.0
    jr = JobResult(
        cost_usd=r.cost_usd + unfinished_h * job.nodes * od_price,
        od_work_cost_usd=work_h * job.nodes * od_price,
        done_ticks=done_ticks,
        deadline_met=r.deadline_met,
        preemptions=r.preemptions,
        overhead_q=int(round(max(0.0, billed_h - (r.useful_s / 3600.0)) / q)),
        billed_q=int(round(billed_h / q)),
        starts=0,
    )
    return jr, r


class OrchdRunner:
    """What ``replay`` calls for the ``orchd`` policy (one World per job)."""

    name = "orchd"

    def __init__(self, capacity_hints: bool = True, **overrides: Any) -> None:
        self.capacity_hints = capacity_hints
        self.overrides = overrides

    def run(self, sc: Scenario, job: Job, ov: Overheads) -> JobResult:
        cfg = core_config(ov, **self.overrides)
        return run_orchd_job(sc, job, ov, config=cfg, capacity_hints=self.capacity_hints)[0]
