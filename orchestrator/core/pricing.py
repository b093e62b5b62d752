"""Pricing arithmetic: preemption-rate estimates, expected cost of running on a pool, Young/Daly.

Role: pure functions of records and ``now``; no state changes here (``decide`` applies the results).

Model (documented in docs/core.md):
- A pool's preemption rate (per node-hour) is a decayed count of observed preemptions over decayed
  node-hours of exposure, with a prior (``spot_prior_rate_h`` worth ``prior_weight_h`` node-hours).
  Both decay with ``stats_half_life_s``, so a pool that calmed down regains trust.
- A preemption counts once per job and event: more nodes of the same job lost in the same pool within
  ``PREEMPTION_EVENT_S`` of the last counted one are the same (zone-wide) event. The rate is then per
  node-hour of exposure, and a job of n nodes is interrupted at n times that rate: n independent losses
  count n times, one zone-wide loss of all n nodes counts once (not n, and not n x n). Each
  interruption costs the restart overhead, the checkpoint save, and - when the emergency save cannot
  fit the cloud's notice window - half a checkpoint interval of lost work. Expected cost = price x
  nodes x remaining hours / efficiency, times a decaying penalty right after a preemption in that pool.
"""

from __future__ import annotations

import math
from typing import Final, NotRequired, TypedDict

from orchestrator.core.model import CoreConfig, Job, PoolStats
from wire.messages import Market


class ExposureChanges(TypedDict):
    """``PoolStats`` field changes from ``record_exposure`` (``**``-unpacked into a replace)."""

    preemptions: float
    exposure_h: float
    stats_ts: float
    live: int
    last_preempted_ts: NotRequired[float]
    last_preempted_job: NotRequired[str]


PREEMPTION_EVENT_S = 300.0  # losses of one job's nodes in one pool this close together are one event


def decay(value: float, since_ts: float, now: float, half_life_s: float) -> float:
    if now <= since_ts or half_life_s <= 0:
        return value
    factor: float = 0.5 ** ((now - since_ts) / half_life_s)  # float ** float is typed Any
    return value * factor


def preemption_rate_h(ps: PoolStats, cfg: CoreConfig, now: float) -> float:
    """Estimated preemptions per node-hour in this pool."""
    if ps.pool.market == Market.ON_DEMAND:
        return cfg.on_demand_rate_h
    hl = cfg.stats_half_life_s
    events = decay(ps.preemptions, ps.stats_ts, now, hl)
    exposure = decay(ps.exposure_h, ps.stats_ts, now, hl) + ps.live * max(0.0, now - ps.stats_ts) / 3600.0
    return (cfg.spot_prior_rate_h * cfg.prior_weight_h + events) / (cfg.prior_weight_h + exposure)


def same_event(ps: PoolStats, job_id: str | None, now: float) -> bool:
    """A preemption of ``job_id``'s node now belongs to the last one counted in this pool."""
    last = ps.last_preempted_ts
    return (
        job_id is not None and ps.last_preempted_job == job_id and last is not None
        and 0.0 <= now - last <= PREEMPTION_EVENT_S
    )


def record_exposure(
    ps: PoolStats, cfg: CoreConfig, now: float, live_delta: int, preempted: bool, job_id: str | None = None
) -> ExposureChanges:
    """Field changes for ``ps``: integrate the live nodes' exposure up to now, then add ``live_delta``
    billed nodes (+1 billing starts, -1 node gone) and one preemption when ``preempted`` - unless it is
    another node of ``job_id`` lost in the same event (``same_event``)."""
    hl = cfg.stats_half_life_s
    dt_h = max(0.0, now - ps.stats_ts) / 3600.0
    counted = preempted and not same_event(ps, job_id, now)
    changes = ExposureChanges(
        preemptions=decay(ps.preemptions, ps.stats_ts, now, hl) + (1.0 if counted else 0.0),
        exposure_h=decay(ps.exposure_h, ps.stats_ts, now, hl) + ps.live * dt_h,
        stats_ts=max(now, ps.stats_ts),
        live=max(0, ps.live + live_delta),
    )
    if counted:
        changes["last_preempted_ts"] = now
        if job_id is not None:
            changes["last_preempted_job"] = job_id
    return changes


def pool_cum_usd(ps: PoolStats, now: float) -> float:
    """$ one node of this pool has cost from the epoch of the integral up to ``now``."""
    return ps.cum_usd + (ps.price_usd_h or 0.0) * max(0.0, now - ps.cum_ts) / 3600.0


def recent_penalty(ps: PoolStats, cfg: CoreConfig, now: float) -> float:
    if ps.last_preempted_ts is None:
        return 1.0
    return 1.0 + cfg.preempted_penalty * decay(1.0, ps.last_preempted_ts, now, cfg.preempted_penalty_half_life_s)


# Durations measured by agents (save time, step time) are read capped at a week: the shell's screen
# refuses larger ones, and the cap keeps every product with a price or a step count finite for any caller
# (the budget check multiplies the burn by the save time). Honest values are never changed.
MAX_DURATION_S = 7 * 86400.0


def save_seconds(job: Job) -> float:
    return min(job.save_s if job.save_s is not None else job.spec.checkpoint.save_s_estimate, MAX_DURATION_S)


def step_seconds(job: Job) -> float:
    return min(job.step_time_s if job.step_time_s is not None else job.spec.step_time_s_estimate, MAX_DURATION_S)


def remaining_work_s(job: Job, step: int, step_time_s: float | None = None) -> float:
    per_step = min(step_time_s, MAX_DURATION_S) if step_time_s else step_seconds(job)
    return max(0, job.spec.total_steps - step) * per_step


def restart_loss_s(job: Job, cfg: CoreConfig) -> float:
    """Time one interruption costs before training again: boot, restart, a checkpoint save."""
    return cfg.restart_overhead_s + cfg.boot_s_estimate + save_seconds(job)


def deadline_margin_s(job: Job, cfg: CoreConfig) -> float:
    """The deadline margin, in time: ``CoreConfig.margin_restarts()`` restarts (not a share of the work)."""
    return cfg.margin_restarts() * restart_loss_s(job, cfg)


def spare_slack_s(job: Job, step: int, cfg: CoreConfig, now: float, step_time_s: float | None = None) -> float | None:
    """Slack left beyond finishing on on-demand from now: deadline - now - remaining work - one restart.
    None without a deadline."""
    deadline = job.spec.deadline_ts
    if deadline is None:
        return None
    return deadline - now - remaining_work_s(job, step, step_time_s) - restart_loss_s(job, cfg)


def wait_reserve_s(job: Job, step: int, cfg: CoreConfig, now: float) -> float:
    """The spare slack a job keeps before it launches on-demand instead of waiting for spot: the deadline
    margin, the expected restarts of the rest of the work on spot (a job of n nodes is interrupted n
    times as often per node-hour, at the prior rate) and ``progress_line_margin_s`` - and at least
    ``projected_wait_s`` (the waiting the rest of the work is expected to cost at the job's own pace so far;
    with ``progress_prior_h`` set) and ``slack_share()`` of what the uniform-progress line keeps at ``now``
    (the initial slack x the share of the time to the deadline still left)."""
    rate_job_h = cfg.spot_prior_rate_h * max(job.target_nodes, 1)
    expected = remaining_work_s(job, step) / 3600.0 * rate_job_h * restart_loss_s(job, cfg)
    base = deadline_margin_s(job, cfg) + expected + max(cfg.progress_line_margin_s, 0.0)
    deadline = job.spec.deadline_ts
    span = (deadline - job.submitted_ts) if deadline is not None else 0.0
    if deadline is None or span <= 0:
        return base
    initial = span - remaining_work_s(job, 0)
    left = min(1.0, max(0.0, (deadline - now) / span))
    return max(base, projected_wait_s(job, step, cfg, now)[0], cfg.slack_share() * max(initial, 0.0) * left)


def projected_wait_s(job: Job, step: int, cfg: CoreConfig, now: float) -> tuple[float, float]:
    """The time the rest of the work is expected to spend not training (waiting for spot, restarting) at the
    job's pace so far, and how fast that grows per second the job waits without progress.

    The pace is work done per second since submit, with ``progress_prior_h`` hours of uninterrupted work
    assumed before any observation: ``pace = (done + prior) / (elapsed + prior)``, and the rest of the work
    W takes ``W / pace`` - so ``W x (1 / pace - 1)`` of it is waiting. A new job expects spot to hold (it
    waits for spot, as a greedy policy would); a job that has waited much of its life so far expects to
    wait as much again, and takes on-demand while it is behind that pace (as the uniform-progress line
    would: with no prior the rule is that line). On-demand work counts as progress, so a job that caught
    up waits for spot again."""
    prior_h = cfg.pace_prior_h()
    if prior_h is None:  # the rule is off
        return 0.0, 0.0
    prior = max(prior_h, 0.0) * 3600.0
    rest = remaining_work_s(job, step)
    done = remaining_work_s(job, 0) - rest
    elapsed = max(now - job.submitted_ts, 0.0)
    base = max(done, 0.0) + prior
    if base <= 0.0:
        return (math.inf, 0.0) if rest > 0 else (0.0, 0.0)
    return rest * max((elapsed + prior) / base - 1.0, 0.0), rest / base


def emergency_fits(job: Job, cfg: CoreConfig, cloud: str) -> bool:
    return save_seconds(job) <= cfg.notice_window_s(cloud) - cfg.notice_save_margin_s


def young_daly_s(save_s: float, mtbf_s: float) -> float:
    """Young/Daly optimal periodic checkpoint interval sqrt(2 C M)."""
    return math.sqrt(2.0 * max(save_s, 0.0) * max(mtbf_s, 0.0))


def checkpoint_interval_s(job: Job, ps: PoolStats | None, nnodes: int, cfg: CoreConfig, now: float) -> float:
    """Interval sent with StartGenerationCmd: the spec's when fixed, else Young/Daly from the pool's rate
    (a job of n nodes fails n times as often), halved-ish when an emergency save cannot fit the notice."""
    if job.spec.checkpoint.interval_s is not None:
        return job.spec.checkpoint.interval_s
    rate = preemption_rate_h(ps, cfg, now) if ps is not None else cfg.spot_prior_rate_h
    return _interval_at(job, rate, nnodes, cfg, ps is not None and not emergency_fits(job, cfg, ps.pool.cloud))


def _interval_at(job: Job, rate_h: float, nnodes: int, cfg: CoreConfig, unfit: bool) -> float:
    """``checkpoint_interval_s`` for a pool of preemption rate ``rate_h`` (no fixed interval in the spec);
    ``unfit``: the emergency save cannot fit the pool's notice window."""
    rate_job_s = max(rate_h * max(nnodes, 1), 1e-9) / 3600.0
    interval = young_daly_s(save_seconds(job), 1.0 / rate_job_s)
    if unfit:
        interval *= cfg.unfit_interval_factor
    return min(max(interval, cfg.ckpt_interval_min_s), cfg.ckpt_interval_max_s)


def efficiency(job: Job, ps: PoolStats, nnodes: int, cfg: CoreConfig, now: float) -> float:
    """Useful fraction of paid time on this pool, given its interruption rate (read once: ``ranked``
    calls this for every pool on every evaluation)."""
    rate = preemption_rate_h(ps, cfg, now)
    rate_job_h = rate * max(nnodes, 1)
    loss_s = cfg.restart_overhead_s + cfg.boot_s_estimate + save_seconds(job)
    if not emergency_fits(job, cfg, ps.pool.cloud):
        fixed = job.spec.checkpoint.interval_s
        loss_s += (fixed if fixed is not None else _interval_at(job, rate, nnodes, cfg, True)) / 2.0
    return max(0.05, 1.0 - rate_job_h * loss_s / 3600.0)


def expected_cost_usd(
    job: Job, ps: PoolStats, nnodes: int, step: int, cfg: CoreConfig, now: float, penalty: bool = True
) -> float:
    """Expected $ to finish the job's remaining work on ``nnodes`` nodes of this pool. ``penalty``: apply
    the recent-preemption penalty (for new placements; not for the pool a job already runs in)."""
    price = ps.price_usd_h if ps.price_usd_h is not None else math.inf
    hours = remaining_work_s(job, step) / 3600.0
    eff = efficiency(job, ps, nnodes, cfg, now)
    return price * nnodes * hours / eff * (recent_penalty(ps, cfg, now) if penalty else 1.0)


STORE_CLOUDS: Final = {"s3": "aws", "gs": "gcp", "gcs": "gcp", "az": "azure", "abfs": "azure", "abfss": "azure"}
"""The cloud whose object store a checkpoint URL's scheme names (a file:// or other root: none known)."""


def store_cloud(url: str) -> str | None:
    scheme, sep, _ = url.partition("://")
    return STORE_CLOUDS.get(scheme) if sep else None


def transfer_cost_usd(src_zone: str, dst: PoolStats, cfg: CoreConfig, store_url: str = "") -> float:
    """$ to read the checkpoint in the pool's region, from ``src_zone`` ("cloud/region/zone", where the job
    wrote it; none: nothing to read yet). When the store's own cloud (the scheme of ``store_url``) is the
    one the job leaves or the one it goes to, that cloud's egress decides: a gs:// root read by an Azure
    node pays the cross-cloud rate, read back in GCP it pays none."""
    if not src_zone:
        return 0.0
    store, src_cloud = store_cloud(store_url), src_zone.split("/")[0]
    if store is not None and store in (src_cloud, dst.pool.cloud) and src_cloud != dst.pool.cloud:
        return cfg.checkpoint_gb_estimate * cfg.cross_cloud_usd_per_gb if store != dst.pool.cloud else 0.0
    cloud, region, _ = (src_zone.split("/") + ["", "", ""])[:3]
    if cloud != dst.pool.cloud:
        return cfg.checkpoint_gb_estimate * cfg.cross_cloud_usd_per_gb
    if region != dst.pool.region:
        return cfg.checkpoint_gb_estimate * cfg.cross_region_usd_per_gb
    return 0.0


def migration_cost_usd(job: Job, burn_usd_h: float, src_zone: str, dst: PoolStats, cfg: CoreConfig) -> float:
    """One-off cost of moving: paid time for save + restart (+ transfer time) and the transfer itself."""
    transfer = transfer_cost_usd(src_zone, dst, cfg, job.spec.checkpoint.url)
    transfer_s = 0.0
    if transfer > 0:
        transfer_s = cfg.checkpoint_gb_estimate * 8.0 / max(cfg.transfer_gbps, 1e-6)
    pause_s = save_seconds(job) + cfg.restart_overhead_s + transfer_s
    return burn_usd_h * pause_s / 3600.0 + transfer
