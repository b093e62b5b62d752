"""Submit-time feasibility and the wake-up time of a waiting job.

Role: pure functions over a job spec (or job), the core's configuration, its known pools and ``now``.

- ``submit_problems``: why a job can never run as submitted - no enabled cloud among the ones it
  allows, none of its instance types in the catalog of those clouds, or a deadline that even on-demand
  from now cannot meet (the work at the estimated step time plus one boot and restart; waived for a
  spec with ``best_effort``, see ``deadline_problem``). The admin submit path refuses such a job with
  these reasons (400, ``infeasible``); an empty list = feasible.
- ``wake_up``: for an active job that is not training, why (its ``reason``) and the earliest time the
  core's view of it changes without any new event (a restart hold ends, a launch backoff or a notice
  skip of a pool it may use expires, on-demand becomes allowed by the slack), or None when only an
  event (a price, a node) can change it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from orchestrator.core.model import CoreConfig, Job, JobPhase, PoolStats
from orchestrator.core.placement import matches, reopens
from orchestrator.core.pricing import projected_wait_s, spare_slack_s, wait_reserve_s
from orchestrator.core.safety import at_risk_s, net_slack_s
from wire.messages import JobSpec, MarketPolicy

_TRAINING = frozenset({JobPhase.STARTING, JobPhase.RUNNING, JobPhase.CHECKPOINTING, JobPhase.RECOVERING})


def _hours(seconds: float) -> str:
    return f"{seconds / 3600.0:.2f} h"


def submit_problems(spec: JobSpec, cfg: CoreConfig, now: float, clouds: Iterable[str] | None = None) -> list[str]:
    """Why ``spec`` cannot run (empty: it can). ``clouds``: the enabled clouds (None: not checked)."""
    problems: list[str] = []
    usable: list[str] | None = None
    if clouds is not None:
        enabled = sorted(set(clouds))
        usable = [c for c in enabled if not spec.clouds or c in spec.clouds]
        if not usable:
            allowed = ", ".join(spec.clouds) if spec.clouds else "any"
            problems.append(f"no enabled cloud can run this job: it allows clouds [{allowed}], orchd has "
                            f"[{', '.join(enabled) or 'none'}] enabled")
    known = cfg.known_instance_types
    if spec.instance_types and not isinstance(known, msgspec.UnsetType) and usable:
        wanted = [f"{c}/{t}" for c in usable for t in spec.instance_types]
        if not any(w in known for w in wanted):
            problems.append(f"none of the instance types [{', '.join(spec.instance_types)}] is in the catalog of "
                            f"the enabled clouds [{', '.join(usable)}]")
    late = deadline_problem(spec, cfg, now)
    if late is not None and spec.best_effort is not True:
        problems.append(late + " (best_effort = true accepts it anyway)")
    return problems


def deadline_problem(spec: JobSpec, cfg: CoreConfig, now: float) -> str | None:
    """Why even on-demand from ``now`` cannot meet the spec's deadline, or None (also without one)."""
    if spec.deadline_ts is None:
        return None
    left = spec.deadline_ts - now
    work = spec.total_steps * spec.step_time_s_estimate
    start = cfg.boot_s_estimate + cfg.restart_overhead_s
    if left >= work + start:
        return None
    return (f"the deadline cannot be met even on on-demand: {_hours(work)} of work "
            f"({spec.total_steps} steps x {spec.step_time_s_estimate:g} s) + {start:g} s to start, "
            f"{_hours(max(left, 0.0))} left until the deadline")


def wake_up(job: Job, pools: Mapping[str, PoolStats], cfg: CoreConfig, now: float) -> tuple[str, float | None]:
    """(why the job is not training, the earliest time that can change without an event). Jobs that
    train (or are terminal or paused) give (their reason, None)."""
    if job.phase in _TRAINING or job.phase not in (JobPhase.PENDING, JobPhase.PLACING, JobPhase.RESIZING):
        return job.reason, None
    times: list[float] = []
    if not isinstance(job.hold_until, msgspec.UnsetType) and job.hold_until > now:
        times.append(job.hold_until)
    for ps in pools.values():
        if not matches(job, ps):
            continue
        times.extend(t for t in reopens(ps, cfg) if t > now)
    if (
        job.spec.market == MarketPolicy.SPOT_WITH_FALLBACK and cfg.progress_line and not job.force_on_demand
        and job.spec.deadline_ts is not None
    ):
        spare = spare_slack_s(job, job.step, cfg, now)
        reserve = wait_reserve_s(job, job.step, cfg, now)
        if spare is not None and spare >= reserve:
            # waiting for spot ends here at the latest: the spare slack shrinks by a second per second, and
            # the reserve grows as the job's pace falls (projected_wait_s)
            times.append(now + (spare - reserve) / (1.0 + projected_wait_s(job, job.step, cfg, now)[1]))
        left = net_slack_s(job, job.step, cfg, now, None, at_risk_s(job, job.step, job.committed_step, None))
        if left is not None and left >= 0:
            times.append(now + left)  # or here, where the safety net takes on-demand
    return job.reason or str(job.phase), (min(times) if times else None)

