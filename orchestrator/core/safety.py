"""The deadline safety net, in time: what one more loss without notice would cost a job right now.

Role: the one rule behind every spot / on-demand choice of a job with a deadline under
``spot_with_fallback`` (policy._deadline, placement.launch_markets_for, policy's moves back to spot). At a
decision the core knows, or bounds:

  Δ (decision_s)   the longest time until it acts again: ``CoreConfig.decision_s()`` (the Tick period, a
                   price feed's period, a slow control host);
  detection        a node that vanishes is suspected after ``heartbeat_timeout_s`` and confirmed by the
                   provider within a Tick (``detect_s``);
  a restart        save + boot + trainer start and checkpoint load (``pricing.restart_loss_s``; the one
                   restart ``pricing.spare_slack_s`` already keeps for the move to on-demand);
  work at risk     the work since the last durable checkpoint, done again after the loss (with shard
                   replicas: at most k + 1 steps, core/replicas.py - only for a generation whose every
                   node has its buddy in another zone: a spot reclaim takes a whole zone at once, and
                   where the buddies share it the loss goes back to the durable checkpoint).

A job stays on (or moves to) spot only while losing it at the worst moment - just before the next
decision, with the step in progress lost - still leaves it able to finish on on-demand by its deadline:
``spare_slack_s - safety_net_s >= extra_s``. ``extra_s`` is what tuning adds (``deadline_margin_restarts``
restarts; older configs' margins load and only add): never less than 0, so tuning cannot remove the net.
Pure.
"""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.core.model import CoreConfig, Job
from orchestrator.core.pricing import deadline_margin_s, restart_loss_s, spare_slack_s, step_seconds
from orchestrator.core.replicas import max_lost_steps, zone_loss_covered
from wire.messages import PoolKey

__all__ = ["at_risk_s", "detect_s", "extra_s", "net_slack_s", "return_slack_s", "safety_net_s"]


def detect_s(cfg: CoreConfig) -> float:
    """Time from a node vanishing to the core knowing: the heartbeat timeout, then the provider's answer to
    CheckInstance (sent at once, answered by the next Tick at worst)."""
    return max(cfg.heartbeat_timeout_s, 0.0) + max(cfg.tick_s, 0.0)


def _replica_cap_s(job: Job, per_step_s: float) -> float | None:
    """The most work one loss costs a job of two or more nodes with replicas (k + 1 steps: its lost shards
    survive on a neighbour); None without that cover."""
    bound = max_lost_steps(job)
    return bound * per_step_s if bound is not None and job.target_nodes >= 2 else None


def at_risk_s(job: Job, step: int, committed_step: int, per_step_s: float | None, *,
              members: Sequence[PoolKey] = ()) -> float:
    """Work that a loss now would send back: the steps since the last durable checkpoint - at most
    ``_replica_cap_s`` when the replicas of the generation on ``members`` (their pools, rank order) survive
    the loss of a whole zone (``replicas.zone_loss_covered``; a new launch or a move lands in one zone: not
    covered)."""
    per = per_step_s if per_step_s else step_seconds(job)
    work = max(0, step - committed_step) * per
    cap = _replica_cap_s(job, per)
    return work if cap is None or not zone_loss_covered(members) else min(work, cap)


def safety_net_s(job: Job, cfg: CoreConfig, at_risk: float) -> float:
    """Beyond the one restart ``spare_slack_s`` keeps: Δ + detection + the work at risk."""
    return cfg.decision_s() + detect_s(cfg) + max(at_risk, 0.0)


def extra_s(job: Job, cfg: CoreConfig) -> float:
    """Slack tuning adds above the net (``deadline_margin_restarts`` restarts); never negative."""
    return max(deadline_margin_s(job, cfg), 0.0)


def net_slack_s(job: Job, step: int, cfg: CoreConfig, now: float, per_step_s: float | None,
                at_risk: float) -> float | None:
    """Slack left after the net and the tuning's extra (None without a deadline): below 0, spot would
    put the deadline at risk, so the job takes on-demand now."""
    spare = spare_slack_s(job, step, cfg, now, per_step_s)
    if spare is None:
        return None
    return spare - safety_net_s(job, cfg, at_risk) - extra_s(job, cfg)


def return_slack_s(job: Job, step: int, cfg: CoreConfig, now: float, per_step_s: float | None,
                   spot_interval_s: float) -> float | None:
    """``net_slack_s`` after a move from on-demand to spot: the move's own restart (checkpoint, boot,
    load), then the net with a whole spot checkpoint interval at risk (the most it holds before its next
    commit) - so a job that moved back is not forced off again while spot holds. The move lands in one
    zone, so replicas do not cap it (``at_risk_s``)."""
    at_risk = spot_interval_s
    left = net_slack_s(job, step, cfg, now, per_step_s, at_risk)
    return None if left is None else left - restart_loss_s(job, cfg)
