"""Timer- and market-driven policies: budget, deadline, price, and what a Tick does to one job.

Role: what a ``Tick`` does to each job it visits (``job_tick``: budget, deadline, price pause, stuck
checkpoints and missing nodes; migration and scale-up at most every ``price_eval_interval_s`` per job;
which jobs and nodes a Tick visits is tick.py's business) and on a ``PriceTick`` (O(1): observe the pool's price;
it acts only once confirmed - held for ``price_confirm_s``, confirm.py - and then closes the pool's price
integral at the old price, so every job's cost stays exact without touching the job; the price reaction
happens on the next Tick; budget margins assume spot may rise up to on-demand until then). Every price
read here is a confirmed one.

Failure detection is two-signal: a heartbeat timeout only makes a node *suspect* (CheckInstance);
NodeGone or AgentDisconnected confirms it. Detection is off while the daemon's bus is down and for one
heartbeat timeout after it reconnects (a NATS outage must never look like node failures).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from orchestrator.core import lifecycle as lc
from orchestrator.core.commands import CheckInstance
from orchestrator.core.confirm import held, observe
from orchestrator.core.costs import burn_usd_h, cost_now, live_step_time, progress_step, worst_burn_usd_h
from orchestrator.core.model import (
    TERMINAL_JOB_PHASES,
    Intent,
    Job,
    JobPhase,
    Node,
    NodePhase,
    PoolStats,
    fin,
)
from orchestrator.core.placement import Ranked, alternatives, ranked, zone_of
from orchestrator.core.pricing import (
    checkpoint_interval_s,
    expected_cost_usd,
    migration_cost_usd,
    remaining_work_s,
    restart_loss_s,
    save_seconds,
    spare_slack_s,
    wait_reserve_s,
)
from orchestrator.core.safety import at_risk_s, net_slack_s, return_slack_s, safety_net_s
from orchestrator.core.tx import Tx
from wire.messages import AbandonGenerationCmd, Market, MarketPolicy, PoolKey, PriceTick

J = JobPhase
N = NodePhase
_replace = msgspec.structs.replace
ACTIVE = frozenset({J.PENDING, J.PLACING, J.STARTING, J.RUNNING, J.CHECKPOINTING, J.RECOVERING, J.RESIZING})


def suspect(tx: Tx, node: Node, reason: str) -> None:
    node = tx.update_node(node, suspect_since=tx.now)
    if node.instance_id is not None:
        tx.emit(CheckInstance(node_id=node.node_id, instance_id=node.instance_id, pool=node.pool))
    tx.record(node.job_id, "suspect", reason, node_id=node.node_id, last_seen=node.last_seen)


# --- Tick ---------------------------------------------------------------------------------------


def steady(job: Job) -> bool:
    """RUNNING with exactly its target nodes, all members, nothing to move: nothing to replenish."""
    n = len(job.nodes)
    return (
        job.phase == J.RUNNING and n == len(job.gen_nodes) == job.target_nodes and not job.gen_exited
        and not job.avoid_pools and not job.force_on_demand
    )


def job_tick(tx: Tx, job: Job, evals: list[int]) -> None:
    cfg = tx.cfg
    if job.phase == J.PAUSED:
        _deadline(tx, job)
        _resume(tx, tx.job(job.job_id))
        return
    if check_budget(tx, job):
        return
    job = tx.job(job.job_id)
    _deadline(tx, job)
    job = tx.job(job.job_id)
    if job.phase == J.RUNNING:
        job = pause_check(tx, job)
        if job.phase == J.RUNNING and evals[0] > 0 and tx.now - job.price_eval_ts >= cfg.price_eval_interval_s:
            evals[0] -= 1
            prev = job.price_eval_ts
            job = _price(tx, tx.update_job(job, price_eval_ts=tx.now), prev)
    if job.phase in (J.CHECKPOINTING, J.RECOVERING):
        limit = 2 * save_seconds(job) + cfg.checkpoint_timeout_s
        if tx.now - job.phase_ts > limit:
            _force_end(tx, job)
            job = tx.job(job.job_id)
    elif job.phase == J.STARTING and tx.now - job.phase_ts > (cfg.restart_overhead_s + cfg.checkpoint_timeout_s
                                                              + cfg.decision_s()):  # a report lags up to Δ
        job = lc.abandon_generation(tx, job, "start_timeout")
        job = lc.maybe_end_generation(tx, job)
    if steady(job):
        return
    if job.phase in (J.PLACING, J.RESIZING):
        job = lc.try_start(tx, job)
    elif job.phase == J.RUNNING:
        job = lc.regroup(tx, job)
    if job.phase not in TERMINAL_JOB_PHASES:
        lc.replenish(tx, job)


def _force_end(tx: Tx, job: Job) -> None:
    """A checkpoint/recovery that never finished: abandon the members still silent, end the generation."""
    exited = job.gen_exited
    for node in lc.members_alive(tx, job):
        tx.send(node, AbandonGenerationCmd(**tx.header(node), generation=job.generation,
                                           reason="generation_end_timeout"))
        exited += (node.node_id,)
    tx.record(job.job_id, "force_end_generation", "timeout", generation=job.generation)
    job = tx.update_job(job, gen_exited=exited)
    lc.maybe_end_generation(tx, job)


# --- budget -------------------------------------------------------------------------------------


def check_budget(tx: Tx, job: Job) -> bool:
    """Stop early enough that the final checkpoint and the termination fit under the cap.

    Hard stop (terminate now) when even one more tick plus termination would cross it. True when the
    job was stopped or asked to stop."""
    budget = job.spec.budget_usd
    if budget is None or job.phase in TERMINAL_JOB_PHASES or job.phase == J.PAUSED:
        return False
    cfg = tx.cfg
    burn = burn_usd_h(tx, job)
    # The termination tail is reserved at the worst price (spot never above on-demand): a price rise
    # right before the stop cannot push the tail over the cap. Price rises re-check at once (on_price).
    tail = worst_burn_usd_h(tx, job) * cfg.terminate_s / 3600.0
    cost = cost_now(tx, job)
    if cost + tail + burn * cfg.tick_s / 3600.0 >= budget:
        tx.record(job.job_id, "stop", "budget_hard_stop", cost_usd=round(cost, 6), budget_usd=budget)
        job = lc.terminate_all(tx, job, "budget")
        tx.job_phase(job, J.STOPPED, reason="budget", intent=Intent.NONE)
        return True
    if job.intent == Intent.BUDGET:
        return True
    if cost + tail + burn * (save_seconds(job) + 2 * cfg.tick_s) / 3600.0 >= budget:
        tx.record(job.job_id, "stop", "budget", cost_usd=round(cost, 6), budget_usd=budget, burn_usd_h=burn)
        if job.phase in (J.STARTING, J.RUNNING):
            lc.checkpoint_job(tx, job, Intent.BUDGET, "budget")
        elif job.phase in (J.CHECKPOINTING, J.RECOVERING):
            tx.update_job(job, intent=Intent.BUDGET)
        else:
            job = lc.terminate_all(tx, job, "budget")
            tx.job_phase(job, J.STOPPED, reason="budget")
        return True
    return False


# --- deadline -----------------------------------------------------------------------------------


def _deadline(tx: Tx, job: Job) -> None:
    """The safety net (core/safety.py): on-demand as soon as losing spot at the worst moment - just before
    the next decision, the work since the last durable checkpoint lost - would leave the job unable to
    finish on on-demand by its deadline. Back to spot only once the slack covers the move's restart and
    the net with a whole spot checkpoint interval at risk, within the bound on moves back per hour."""
    spec, cfg = job.spec, tx.cfg
    if spec.deadline_ts is None or spec.market != MarketPolicy.SPOT_WITH_FALLBACK:
        return
    step = progress_step(tx, job)
    per_step = live_step_time(tx, job)
    if job.force_on_demand:
        left = _return_slack(tx, job, step)
        if left is not None and left >= 0 and returns_left(tx, job) > 0:
            tx.record(job.job_id, "spot_again", "deadline_slack_regained", slack_after_move_s=round(left, 3),
                      step=step)
            tx.update_job(job, force_on_demand=False)
        return
    # Work on on-demand nodes is not at risk (they are not preempted); a job waiting for nodes counts
    # what it would redo from its last checkpoint.
    members = [tx.nodes[n].pool for n in job.gen_nodes if n in tx.nodes]
    at_risk = at_risk_s(job, step, job.committed_step, per_step, members=members) if _on_spot(members) else 0.0
    left = net_slack_s(job, step, cfg, tx.now, per_step, at_risk)
    if left is None or left >= 0:
        return
    tx.record(job.job_id, "on_demand_fallback", "deadline", slack_s=round(spec.deadline_ts - tx.now, 3),
              net_s=round(safety_net_s(job, cfg, at_risk), 3), at_risk_s=round(at_risk, 3),
              decision_s=round(cfg.decision_s(), 3), left_s=round(left, 3), step=step)
    tx.update_job(job, force_on_demand=True)


def _recent_returns(tx: Tx, job: Job) -> tuple[int, ...]:
    done = () if isinstance(job.spot_returns, msgspec.UnsetType) else job.spot_returns
    return tuple(t for t in done if tx.now - t < 3600.0)


def returns_left(tx: Tx, job: Job) -> float:
    """Moves from on-demand back to spot the job may still make in the hour up to now."""
    return tx.cfg.returns_per_h() - len(_recent_returns(tx, job))


def _return_slack(tx: Tx, job: Job, step: int) -> float | None:
    """``safety.return_slack_s`` with a spot checkpoint interval (at the prior rate: not the long
    on-demand interval the job may run with) and the job's live step time."""
    spot_interval = checkpoint_interval_s(job, None, job.target_nodes, tx.cfg, tx.now)
    return return_slack_s(job, step, tx.cfg, tx.now, live_step_time(tx, job), spot_interval)


def _may_return(tx: Tx, job: Job, step: int) -> bool:
    """A move from on-demand to spot is within the bound per hour and, with a deadline under fallback,
    leaves the slack to cover its restart and the net - and, with the wait by the job's pace
    (``progress_prior_h``), the reserve a job keeps before it takes on-demand (``wait_reserve_s``): else the
    next loss of spot would send it straight back."""
    if returns_left(tx, job) <= 0:
        return False
    if job.spec.deadline_ts is None or job.spec.market != MarketPolicy.SPOT_WITH_FALLBACK:
        return True
    left = _return_slack(tx, job, step)
    if left is None or left < 0:
        return False
    if not tx.cfg.progress_line or tx.cfg.pace_prior_h() is None:
        return True
    spare = spare_slack_s(job, step, tx.cfg, tx.now, live_step_time(tx, job))
    return spare is not None and spare - restart_loss_s(job, tx.cfg) >= wait_reserve_s(job, step, tx.cfg, tx.now)


def _on_spot(members: list[PoolKey]) -> bool:
    """Some member of the current generation (``members``: their pools) runs on spot, or it has none yet."""
    return not members or any(p.market == Market.SPOT for p in members)


# --- price --------------------------------------------------------------------------------------


def _current_pool(tx: Tx, job: Job) -> PoolStats | None:
    for nid in job.gen_nodes:
        n = tx.nodes.get(nid)
        if n is not None:
            return tx.pools.get(n.pool_name)
    return None


def _ratio(ps: PoolStats) -> float | None:
    if ps.pool.market != Market.SPOT or ps.price_usd_h is None or not ps.on_demand_usd_h:
        return None
    return ps.price_usd_h / ps.on_demand_usd_h


def _ratio_or_one(ps: PoolStats) -> float:
    """``_ratio`` with 1.0 (as expensive as on-demand) where the pool has no spot ratio."""
    ratio = _ratio(ps)
    return ratio if ratio is not None else 1.0


def pause_check(tx: Tx, job: Job) -> Job:
    """RUNNING on spot and the pool's price went above pause_above_ratio x on-demand: pause (or move
    to a spot pool that is below resume_below_ratio)."""
    if job.phase != J.RUNNING or job.force_on_demand:
        return job
    ps = _current_pool(tx, job)
    ratio = _ratio(ps) if ps is not None else None
    pp = job.spec.price
    if ratio is None or ratio <= pp.pause_above_ratio:
        return job
    step = progress_step(tx, job)
    rank = [r for r in _moves(tx, job, step, markets=frozenset({Market.SPOT}))
            if (_ratio(r[2]) or 1.0) < pp.resume_below_ratio]
    if rank:
        return _migrate(tx, job, rank, "price_above_pause_ratio", ps)
    tx.record(job.job_id, "pause", "price_above_pause_ratio", pool=ps.pool.name if ps else None, ratio=round(ratio, 4))
    return lc.checkpoint_job(tx, job, Intent.PAUSE, "price_pause")


def _moves(tx: Tx, job: Job, step: int, *, exclude: Iterable[str] = (),
           markets: frozenset[Market] | None = None) -> list[Ranked]:
    """Pools a running job may move to: ``ranked``, less pools whose confirmed price is younger than
    ``confirm_s`` (the first price of a new pool places new launches only)."""
    confirm_s, now = tx.cfg.confirm_s(), tx.now
    rank = ranked(tx.pools, job, job.target_nodes, step, tx.cfg, now, exclude=exclude, markets=markets)
    return [r for r in rank if held(r[2], confirm_s, now)]


def _migrate(tx: Tx, job: Job, rank: list[Ranked], reason: str, cur: PoolStats | None) -> Job:
    best = rank[0][2]
    # the pools being left: the members' pools, never the destination (a generation may span two pools
    # of one zone; leaving the destination too would make the new nodes unusable at once)
    avoid = tuple(sorted({tx.nodes[n].pool_name for n in job.gen_nodes if n in tx.nodes} - {best.pool.name}))
    tx.record(job.job_id, "migrate", reason, alternatives(rank, tx.cfg), src=cur.pool.name if cur else None,
              dst=best.pool.name)
    job = tx.update_job(job, zone=zone_of(best.pool), avoid_pools=avoid, migrate_ts=tx.now)
    have = sum(1 for n in lc.job_nodes(tx, job) if lc.acceptable(job, n, suspect_ok=True))
    return lc.launch(tx, job, best, job.target_nodes - have, "migrate", alternatives(rank, tx.cfg))


def _market_moved(tx: Tx, job: Job, prev: float) -> bool:
    """Whether the migration ranking can differ from the one at the job's last evaluation (``prev``):
    see ``CoreConfig.price_rerank_max_s``. Conservative (``>=``): a change in the same second counts."""
    now, cfg = tx.now, tx.cfg
    if prev <= 0.0 or (job.gen_ts is not None and job.gen_ts >= prev):
        return True
    window = cfg.price_rerank_max_s
    if window <= 0 or now // window != prev // window:
        return True
    if job.migrate_ts is not None and prev < job.migrate_ts + cfg.migrate_cooldown_s <= now:
        return True
    confirm_s = cfg.confirm_s()  # a new pool's price that came to have held (``_moves``) is a change
    for ps in tx.pools.values():
        if (
            ps.changed_ts >= prev or prev < ps.backoff_until <= now or prev < ps.noticed_until <= now
            or prev < ps.price_ts + confirm_s <= now
        ):
            return True
    return False


def _price(tx: Tx, job: Job, prev_eval_ts: float = 0.0) -> Job:
    """Migration to a cheaper pool, scale-up while spot is cheap (every price_eval_interval_s).
    ``prev_eval_ts``: the job's previous evaluation; the pools are re-ranked only if they may rank
    differently since (``_market_moved``)."""
    if job.phase != J.RUNNING or job.avoid_pools:
        return job
    cfg, spec = tx.cfg, job.spec
    cur = _current_pool(tx, job)
    if cur is None or cur.price_usd_h is None:
        return job
    step = progress_step(tx, job)
    nn = job.target_nodes
    # Migration: a cheaper pool saves more than moving costs (over the next horizon).
    if (job.migrate_ts is None or tx.now - job.migrate_ts >= cfg.migrate_cooldown_s) and _market_moved(
        tx, job, prev_eval_ts
    ):
        rank = _moves(tx, job, step, exclude={cur.pool.name})
        if rank and zone_of(rank[0][2].pool) != "":
            cur_cost = expected_cost_usd(job, cur, nn, step, cfg, tx.now, penalty=False)
            alt_cost, _, alt = rank[0]
            remaining_h = max(remaining_work_s(job, step) / 3600.0, 1e-9)
            frac = min(1.0, cfg.migrate_horizon_h / remaining_h)
            saving = (cur_cost - alt_cost) * frac
            move = migration_cost_usd(job, burn_usd_h(tx, job), job.zone, alt, cfg)
            if saving - move > spec.price.migrate_min_saving * cur_cost * frac:
                if cur.pool.market != Market.ON_DEMAND or alt.pool.market != Market.SPOT:
                    return _migrate(tx, job, rank, "cheaper_pool", cur)
                if _may_return(tx, job, step):
                    tx.record(job.job_id, "spot_return", "saving_over_move", saving_usd=round(saving, 6),
                              move_usd=round(move, 6), returns_left=returns_left(tx, job))
                    job = tx.update_job(job, spot_returns=(*_recent_returns(tx, job), int(tx.now)))
                    return _migrate(tx, job, rank, "cheaper_pool", cur)
    # Scale up toward nodes_max while spot is cheap.
    ratio = _ratio(cur)
    if (
        ratio is not None
        and ratio < cfg.scale_up_below_ratio
        and job.target_nodes < spec.nodes_max
        and not any(n.phase in (N.REQUESTED, N.BOOTING) for n in lc.job_nodes(tx, job))
        and not job.force_on_demand
    ):
        # The whole way at once: every resize costs a checkpoint and a restart.
        tx.record(job.job_id, "scale_up", "price_low", ratio=round(ratio, 4), target=spec.nodes_max)
        job = tx.update_job(job, target_nodes=spec.nodes_max)
        job = lc.replenish(tx, job)
    return job


def _resume(tx: Tx, job: Job) -> None:
    """PAUSED: resume when some feasible spot pool is below resume_below_ratio (or on-demand is forced)."""
    step = job.step
    rank = ranked(tx.pools, job, job.target_nodes, step, tx.cfg, tx.now)
    if not job.force_on_demand:
        resume_below = job.spec.price.resume_below_ratio
        rank = [r for r in rank if _ratio_or_one(r[2]) < resume_below]
    if not rank:
        return
    tx.record(job.job_id, "resume", "on_demand_deadline" if job.force_on_demand else "price_below_resume_ratio",
              alternatives(rank, tx.cfg))
    job = tx.job_phase(job, J.PENDING, reason="resume", zone="", avoid_pools=())
    lc.replenish(tx, job)


# --- PriceTick ----------------------------------------------------------------------------------


def _price_in_bounds(tx: Tx, pt: PriceTick, usd: float, od_usd: float | None, od_name: str | None) -> bool:
    """``usd`` (and the tick's on-demand price) at most the config's price ceiling; a spot price at most
    its spot band x the on-demand price of the tick, else of the pool, else of the
    on-demand pool of the same key (no band while none is known)."""
    cfg = tx.cfg
    ceiling = cfg.price_ceiling_usd_h()
    if usd > ceiling or (od_usd is not None and od_usd > ceiling):
        return False
    if od_name is None:
        return True
    od = od_usd
    if od is None:
        ps, od_ps = tx.pools.get(pt.pool.name), tx.pools.get(od_name)
        od = ps.on_demand_usd_h if ps is not None else None
        od = od if od is not None or od_ps is None else od_ps.price_usd_h
    return od is None or od <= 0 or usd <= cfg.spot_band() * od


def on_price(tx: Tx, pt: PriceTick) -> None:
    usd = fin(pt.price_usd_h)
    od_usd = fin(pt.on_demand_usd_h)
    if od_usd is not None and od_usd < 0:
        od_usd = None
    od_name = _replace(pt.pool, market=Market.ON_DEMAND).name if pt.pool.market == Market.SPOT else None
    if usd is None or usd < 0 or not _price_in_bounds(tx, pt, usd, od_usd, od_name):
        tx.record(None, "ignore", "bad_price", pool=pt.pool.name)
        return
    od = od_usd if pt.pool.market == Market.SPOT else usd
    # Prices act only once confirmed (confirm.py): a glitch shorter than confirm_s leaves an audit record.
    rise = observe(tx, pt.pool.name, pt, pt.pool.market, usd, od)
    if od_name is not None and od_usd is not None:
        rise = observe(tx, od_name, pt, Market.ON_DEMAND, od_usd, od_usd) or rise
    if rise:  # budgets use the current (confirmed) burn between checks: a confirmed rise is a check
        names = {pt.pool.name, od_name}
        for jid in tx.meta.budget_jobs:
            job = tx.jobs.get(jid)
            if job is not None and any(n in tx.nodes and tx.nodes[n].pool_name in names for n in job.nodes):
                check_budget(tx, job)

