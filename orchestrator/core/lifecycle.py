"""The generation protocol and node bookkeeping, as steps on a ``Tx``.

Role: everything that changes which nodes a job has and which generation runs on them: launching,
removing nodes (with cost accrual and pool statistics), starting a generation, asking for a checkpoint
or abandoning a generation, ending it, and the one rule for what the job should look like next
(``replenish`` + ``try_start`` + ``regroup``). Event handlers (decide.py) and timer policies
(policy.py) only call these.

Vocabulary: a node is *acceptable* for its job when it is alive, not suspect, in the job's zone, of a
market the job may use now, and not in a pool the job is leaving (price migration). Unacceptable
members keep training until the next checkpoint, then are terminated.
"""

from __future__ import annotations

from typing import Any, overload

import msgspec

from orchestrator.core import replicas, tracking
from orchestrator.core.commands import Launch, Terminate
from orchestrator.core.costs import affordable, cost_now, node_cost_usd, progress_step
from orchestrator.core.model import (
    GEN_PHASES,
    TERMINAL_JOB_PHASES,
    Intent,
    Job,
    JobPhase,
    Node,
    NodePhase,
    PoolStats,
)
from orchestrator.core.placement import Alternative, Ranked, alternatives, markets_for, probed, ranked, zone_of
from orchestrator.core.pricing import checkpoint_interval_s, record_exposure, transfer_cost_usd
from orchestrator.core.roots import start_from
from orchestrator.core.sweep_budget import SWEEP_BUDGET, others_hold_nodes, sweep_affordable, sweep_of
from orchestrator.core.tx import Tx
from wire.messages import AbandonGenerationCmd, CheckpointCmd, StartGenerationCmd

J = JobPhase
N = NodePhase
_COUNTING = frozenset({N.REQUESTED, N.BOOTING, N.REGISTERED, N.RUNNING})
_INFLIGHT = frozenset({N.REQUESTED, N.BOOTING})
_STOP_PHASE = {Intent.PAUSE: J.PAUSED, Intent.BUDGET: J.STOPPED, Intent.CANCEL: J.CANCELLED,
               Intent.SWEEP_BUDGET: J.STOPPED, Intent.SWEEP_DEADLINE: J.STOPPED}


# --- queries ------------------------------------------------------------------------------------


def job_nodes(tx: Tx, job: Job) -> list[Node]:
    nodes = tx.nodes
    return [nodes[n] for n in job.nodes if n in nodes]


def acceptable(job: Job, node: Node, suspect_ok: bool = False) -> bool:
    """Usable by the job now; ``suspect_ok``: a suspect node still counts (for launch decisions: we do
    not act on one signal)."""
    return (
        node.phase in _COUNTING
        and (suspect_ok or node.suspect_since is None)
        and zone_of(node.pool) == job.zone
        and node.pool.market in markets_for(job)
        and node.pool_name not in job.avoid_pools
    )


def members_alive(tx: Tx, job: Job) -> list[Node]:
    """Members of the current generation whose ranks have not exited."""
    nodes = tx.nodes
    return [nodes[n] for n in job.gen_nodes if n not in job.gen_exited and n in nodes]


# --- nodes --------------------------------------------------------------------------------------


def budget_blocked(tx: Tx, job: Job, ps: PoolStats, count: int, alts: tuple[Alternative, ...] = ()) -> Job:
    """A launch the budget cannot carry. A job that cannot run without it stops (stopped, budget)
    instead of waiting forever; a running job goes on with what it has."""
    if job.reason != "launch_refused_budget":
        tx.record(job.job_id, "launch_refused", "budget", alts, pool=ps.pool.name, count=count)
        job = tx.update_job(job, reason="launch_refused_budget")
    usable = sum(1 for n in job_nodes(tx, job) if acceptable(job, n, suspect_ok=True))
    if job.phase in (J.PENDING, J.PLACING, J.RESIZING) and usable < max(job.spec.nodes_min, 1):
        tx.record(job.job_id, "stop", "budget_cannot_restart", cost_usd=round(cost_now(tx, job), 6))
        job = terminate_all(tx, job, "budget")
        job = tx.job_phase(job, J.STOPPED, reason="budget", intent=Intent.NONE)
    return job


def sweep_blocked(tx: Tx, job: Job, ps: PoolStats, count: int, figures: dict[str, float],
                  alts: tuple[Alternative, ...] = ()) -> Job:
    """A launch the sweep's reserved budget cannot carry (sweep_budget.py): the job waits while another job
    of the sweep holds nodes (what they reserved may come free), else one that cannot run stops (sweep_budget)."""
    if job.reason != "launch_refused_sweep_budget":
        tx.record(job.job_id, "launch_refused", SWEEP_BUDGET, alts, pool=ps.pool.name, count=count, figures=figures)
        job = tx.update_job(job, reason="launch_refused_sweep_budget")
    usable = sum(1 for n in job_nodes(tx, job) if acceptable(job, n, suspect_ok=True))
    if job.phase not in (J.PENDING, J.PLACING, J.RESIZING) or usable >= max(job.spec.nodes_min, 1) or (
            others_hold_nodes(tx, job)):
        return job
    sid = sweep_of(job.spec)
    tx.record(job.job_id, "stop", SWEEP_BUDGET, sweep_id=sid, figures=figures)
    job = terminate_all(tx, job, SWEEP_BUDGET)
    return tx.job_phase(job, J.STOPPED, reason=SWEEP_BUDGET, intent=Intent.NONE)


def launch(tx: Tx, job: Job, ps: PoolStats, count: int, reason: str, alts: tuple[Alternative, ...] = ()) -> Job:
    if count <= 0:
        return job
    n = affordable(tx, job, ps, count)
    if n == 0:
        return budget_blocked(tx, job, ps, count, alts)
    n, figures = sweep_affordable(tx, job, ps, n)
    if n == 0 and figures is not None:
        return sweep_blocked(tx, job, ps, count, figures, alts)
    count = n
    token = tx.new_launch_token(job.job_id)
    ids, seq = tx.new_node_ids(job, count)
    for nid in ids:
        tx.put_node(
            Node(
                node_id=nid,
                job_id=job.job_id,
                pool=ps.pool,
                pool_name=ps.pool.name,
                token=token,
                phase=N.REQUESTED,
                phase_ts=tx.now,
                requested_ts=tx.now,
            )
        )
    tx.emit(Launch(job_id=job.job_id, pool=ps.pool, node_ids=tuple(ids), token=token))
    probe = probed(tx.pools.get(ps.pool.name, ps), tx.cfg, tx.now)
    if probe is not None:  # a waiting job's retry of a pool in backoff: the others wait for its outcome
        tx.put_pool(ps.pool.name, probe)
    tx.record(
        job.job_id, "launch", reason, alts, pool=ps.pool.name, price_usd_h=ps.price_usd_h, node_ids=ids, token=token
    )
    if seq is None:
        return tx.update_job(job, nodes=job.nodes + tuple(ids), reason=reason)
    return tx.update_job(job, nodes=job.nodes + tuple(ids), reason=reason, node_seq=seq)


@overload
def remove_node(
    tx: Tx, job: Job, node: Node, *, reason: str, lost: bool, terminate: bool, preempted: bool = False
) -> Job: ...
@overload
def remove_node(
    tx: Tx, job: Job | None, node: Node, *, reason: str, lost: bool, terminate: bool, preempted: bool = False
) -> Job | None: ...
def remove_node(
    tx: Tx, job: Job | None, node: Node, *, reason: str, lost: bool, terminate: bool, preempted: bool = False
) -> Job | None:
    """Terminal phase for ``node`` (GONE when lost, else TERMINATED); its record is deleted."""
    cfg = tx.cfg
    spent = node_cost_usd(tx, node)
    if terminate:
        tx.emit(Terminate(node_id=node.node_id, instance_id=node.instance_id, pool=node.pool, reason=reason))
    ps = tx.pools.get(node.pool_name)
    billed = node.phase != N.REQUESTED
    if ps is not None and (billed or preempted):
        ps = tx.put_pool(
            node.pool_name,
            msgspec.structs.replace(
                ps, **record_exposure(ps, cfg, tx.now, -1 if billed else 0, preempted, node.job_id)
            ),
        )
    tx.drop_node(node, N.GONE if lost else N.TERMINATED)
    if job is None:
        return None
    cost_usd = job.cost_usd + spent
    gen_exited = job.gen_exited
    if node.node_id in job.gen_nodes and node.node_id not in job.gen_exited:
        gen_exited += (node.node_id,)
    if terminate and node.phase != N.REQUESTED and ps is not None and ps.price_usd_h:
        # Billing continues until the cloud has really stopped the instance.
        cost_usd += ps.price_usd_h * cfg.terminate_s / 3600.0
    tx.record(job.job_id, "remove_node", reason, node_id=node.node_id, lost=lost, terminate=terminate)
    nodes = tuple(n for n in job.nodes if n != node.node_id)
    return tx.update_job(job, nodes=nodes, cost_usd=cost_usd, gen_exited=gen_exited)


def terminate_all(tx: Tx, job: Job, reason: str) -> Job:
    for node in job_nodes(tx, job):
        job = remove_node(tx, job, node, reason=reason, lost=False, terminate=True)
    return job


# --- generations --------------------------------------------------------------------------------


def _port_offset(job_id: str) -> int:
    """A fixed offset per job for its rendezvous port: two jobs whose rank 0 share a host (the local
    provider's nodes are processes of one machine) start their generations on different ports, where
    ``base + generation % span`` gave every job's first generation the same one (EADDRINUSE)."""
    h = 0
    for b in job_id.encode():
        h = (h * 131 + b) % 1_000_003
    return h


def start_generation(tx: Tx, job: Job, members: list[Node]) -> Job:
    cfg = tx.cfg
    gen = job.generation + 1
    nn = len(members)
    gpn = job.spec.gpus_per_node
    master = members[0].host or members[0].node_id
    port = cfg.master_port_base + (_port_offset(job.job_id) + gen) % cfg.master_port_span
    interval = checkpoint_interval_s(job, tx.pools.get(members[0].pool_name), nn, cfg, tx.now)
    # Before its own first commit a job resumes only from the checkpoint its spec names (start_from),
    # never from anything found under its root; it always writes under its own root.
    resume = job.committed_url if job.committed_url is not None else start_from(job.spec.checkpoint)
    trainer = tracking.trainer_spec(job)  # MLflow's variables for a tracked job
    choice = replicas.choose(job, [m.node_id for m in members], nn * gpn)  # a replica step or the durable one
    buddy = replicas.buddies([m.pool for m in members])  # another zone's node when the job spans zones
    ids = []
    for rank, node in enumerate(members):
        # the generation resumes after its source's step: a member's step starts there again
        node = tx.node_phase(node, N.RUNNING, generation=gen, rank=rank, step=max(job.committed_step, choice.step))
        tx.send(
            node,
            StartGenerationCmd(
                **tx.header(node),
                generation=gen,
                node_rank=rank,
                nnodes=nn,
                gpus_per_node=gpn,
                world_size=nn * gpn,
                master_addr=master,
                master_port=port,
                resume_from=resume,
                checkpoint_url=job.spec.checkpoint.url,
                total_steps=job.spec.total_steps,
                checkpoint_interval_s=interval,
                trainer=trainer,
                cluster_id=tx.meta.cluster_id if isinstance(tx.meta.cluster_id, str) else "",
                **replicas.command_fields(job, choice, buddy[rank]),
            ),
        )
        ids.append(node.node_id)
    tx.record(
        job.job_id, "start_generation", job.reason or "nodes_ready", generation=gen, nodes=ids,
        resume_from=resume, checkpoint_interval_s=interval, master_addr=master, master_port=port,
    )
    job = replicas.record_choice(tx, job, choice, gen, nn * gpn, replicas.egress_usd_h(job, members, cfg))
    return tx.job_phase(
        job, J.STARTING, reason="generation_started", generation=gen, gen_nodes=tuple(ids), gen_exited=(),
        gen_ts=tx.now, gen_confirmed=False, intent=Intent.NONE, ckpt_interval_s=interval, avoid_pools=(),
    )


def checkpoint_job(tx: Tx, job: Job, intent: Intent, reason: str, deadline: float | None = None) -> Job:
    """CheckpointCmd to every live member; the generation ends when all ranks exited."""
    for node in members_alive(tx, job):
        tx.send(node, CheckpointCmd(**tx.header(node), generation=job.generation, reason=reason, deadline_ts=deadline))
    tx.record(job.job_id, "checkpoint", reason, generation=job.generation, deadline_ts=deadline)
    return tx.job_phase(job, J.CHECKPOINTING, reason=reason, intent=intent)


def abandon_generation(tx: Tx, job: Job, reason: str) -> Job:
    """AbandonGenerationCmd to the live members; resume later from the last committed checkpoint."""
    for node in members_alive(tx, job):
        if node.phase in (N.RUNNING, N.DRAINING, N.NOTICED) and node.suspect_since is None:
            tx.send(node, AbandonGenerationCmd(**tx.header(node), generation=job.generation, reason=reason))
    tx.record(job.job_id, "abandon_generation", reason, generation=job.generation, resume_from=job.committed_url)
    intent = job.intent if job.intent in _STOP_PHASE else Intent.RECOVER
    return tx.job_phase(job, J.RECOVERING, reason=reason, intent=intent)


def maybe_end_generation(tx: Tx, job: Job) -> Job:
    """End the generation once every member exited, was lost, or is suspect."""
    if job.phase not in GEN_PHASES or not job.gen_nodes:
        return job
    nodes = tx.nodes
    for nid in job.gen_nodes:
        if nid in job.gen_exited:
            continue
        n = nodes.get(nid)
        if n is not None and n.suspect_since is None:
            return job
    if job.phase in (J.STARTING, J.RUNNING):
        job = tx.job_phase(job, J.RECOVERING, reason="generation_lost", intent=Intent.RECOVER)
    return end_generation(tx, job)


def end_generation(tx: Tx, job: Job) -> Job:
    step = progress_step(tx, job)
    times = []
    for nid in job.gen_nodes:
        n = tx.nodes.get(nid)
        if n is None:
            continue
        if n.step_time_s is not None and n.step_time_s > 0:
            times.append(n.step_time_s)
        if n.phase == N.RUNNING:
            tx.node_phase(n, N.REGISTERED)
    step_time = sum(times) / len(times) if times else job.step_time_s
    job = tx.update_job(job, step=step, step_time_s=step_time)
    intent = job.intent
    if intent in _STOP_PHASE:
        job = terminate_all(tx, job, reason=str(intent))
        zone = "" if intent == Intent.PAUSE else job.zone
        return tx.job_phase(job, _STOP_PHASE[intent], reason=str(intent), intent=Intent.NONE, zone=zone)
    for n in job_nodes(tx, job):
        if n.phase in (N.NOTICED, N.DRAINING):
            job = remove_node(tx, job, n, reason=f"leaving_after_{intent or 'generation'}", lost=False, terminate=True)
    job = tx.job_phase(job, J.RESIZING, reason=str(intent) or "generation_ended", intent=Intent.NONE)
    return try_start(tx, job)


def keep_or_leave(tx: Tx, job: Job) -> Job:
    """A job leaving pools (``avoid_pools``, a price migration) keeps them when the move failed: fewer
    usable nodes outside them than the job needs to start (the new nodes were preempted or never came).
    Without this the old nodes would be terminated as unusable and, where no other pool is open, the job
    would wait for capacity that is not coming (``no_feasible_pool`` for good). A move that never happened
    starts no migration cooldown: the next evaluation may try the next pool (the failed one is in launch
    backoff), instead of retrying the same full pool once per cooldown while others have room."""
    if not job.avoid_pools:
        return job
    usable = sum(1 for n in job_nodes(tx, job) if acceptable(job, n, suspect_ok=True))
    if usable >= max(job.spec.nodes_min, 1):
        return job
    # the move may have been to another zone: the job stays in the zone of the nodes it keeps (else they
    # would be unacceptable there, terminated, and replaced in the zone it never reached)
    kept = [n for n in job_nodes(tx, job) if n.pool_name in job.avoid_pools and n.phase in _COUNTING]
    zone = zone_of(kept[0].pool) if kept else job.zone
    tx.record(job.job_id, "migrate_abandoned", "destination_lost", pools=list(job.avoid_pools), usable=usable)
    return tx.update_job(job, avoid_pools=(), migrate_ts=None, zone=zone)


def hold(tx: Tx, job: Job, reason: str) -> Job:
    """Hold the job's next generation for the restart backoff (CoreConfig.restart_backoff_s): its nodes
    stay, lost ones are replaced, and a Tick starts the generation once the hold is over."""
    k = job.holds if isinstance(job.holds, int) else 0
    until = tx.now + tx.cfg.restart_backoff_s(k)
    tx.record(job.job_id, "hold", reason, until=until, holds=k + 1, failures=job.failures)
    return tx.update_job(job, hold_until=until, hold_reason=reason, holds=k + 1)


def try_start(tx: Tx, job: Job) -> Job:
    """PLACING/RESIZING: start the next generation when enough acceptable nodes are registered (and no
    restart hold is in force)."""
    if job.phase not in (J.PLACING, J.RESIZING):
        return job
    job = keep_or_leave(tx, job)
    if job.held(tx.now):
        return replenish(tx, drop_unusable(tx, job))
    spec = job.spec
    job = drop_unusable(tx, job)
    nodes = job_nodes(tx, job)
    ready = [n for n in nodes if n.phase == N.REGISTERED and acceptable(job, n)]
    inflight = [n for n in nodes if n.phase in _INFLIGHT and acceptable(job, n)]
    target = job.target_nodes
    enough = len(ready) >= target or (
        len(ready) >= max(spec.nodes_min, 1) and (job.phase == J.RESIZING or not inflight)
    )
    if not enough:
        return replenish(tx, job)
    big = 1 << 30
    ready.sort(
        key=lambda n: (n.rank if n.generation == job.generation and n.rank >= 0 else big, n.requested_ts, n.node_id)
    )
    members = ready[: min(target, spec.nodes_max)]
    for n in ready[len(members):]:
        job = remove_node(tx, job, n, reason="excess", lost=False, terminate=True)
    job = start_generation(tx, job, members)
    return replenish(tx, job)


def regroup(tx: Tx, job: Job) -> Job:
    """RUNNING: checkpoint to grow back (replacement registered) or to switch to acceptable nodes."""
    if job.phase != J.RUNNING:
        return job
    nodes = job_nodes(tx, job)
    idle = [n for n in nodes if n.phase == N.REGISTERED and acceptable(job, n)]
    if not idle:
        return job
    members = members_alive(tx, job)
    good = sum(1 for m in members if acceptable(job, m))
    inflight = any(n.phase in _INFLIGHT and acceptable(job, n) for n in nodes)
    enough = good + len(idle) >= job.target_nodes or (good + len(idle) >= job.spec.nodes_min and not inflight)
    if good < len(members):
        if enough:
            return checkpoint_job(tx, job, Intent.MIGRATE, "migrate")
    elif len(members) < job.target_nodes and enough:
        return checkpoint_job(tx, job, Intent.GROW, "resize")
    return job


def drop_unusable(tx: Tx, job: Job, reason: str = "not_usable") -> Job:
    """Terminate idle or in-flight nodes the job can no longer use (other zone, market or pool): they
    only cost money. Generation members stay until the generation ends; suspects until confirmed."""
    for n in job_nodes(tx, job):
        if n.phase in (N.REQUESTED, N.BOOTING, N.REGISTERED) and n.suspect_since is None and not acceptable(job, n):
            job = remove_node(tx, job, n, reason=reason, lost=False, terminate=True)
    return job


def replenish(tx: Tx, job: Job, exclude: frozenset[str] = frozenset(), *, fleeing: bool = False) -> Job:
    """Launch what the job lacks: in its zone when it already has nodes there, else move/place whole.
    ``fleeing`` (a notice or a loss just now): recently reclaimed spot pools only where nothing else is."""
    if job.phase in TERMINAL_JOB_PHASES or job.phase == J.PAUSED or job.intent in _STOP_PHASE:
        return job
    cfg, spec = tx.cfg, job.spec
    job = drop_unusable(tx, keep_or_leave(tx, job))
    nodes = job_nodes(tx, job)
    have = [n for n in nodes if acceptable(job, n, suspect_ok=True)]
    deficit = job.target_nodes - len(have)
    if deficit <= 0:
        return job
    step = progress_step(tx, job)
    given = exclude
    exclude = exclude | frozenset(job.avoid_pools)  # pools being left: never refill them
    waiting = len(have) < max(spec.nodes_min, 1)  # nothing to train on: probes pools in backoff sooner
    if job.zone and (have or job.generation):  # stay in the zone it runs/ran in (members, checkpoint locality)
        rank = _ranked(tx, job, step, fleeing, zone=job.zone, exclude=exclude, waiting=waiting)
        if rank:  # (a PENDING job that has a zone - it ran before, or a move failed - is placing now)
            return _placing(tx, launch(tx, job, rank[0][2], deficit, "replacement", alternatives(rank, cfg)))
        if len(have) >= max(spec.nodes_min, 1):
            if job.reason != "no_capacity_in_zone":
                tx.record(job.job_id, "wait", "no_capacity_in_zone", zone=job.zone, nodes=len(have))
                job = tx.update_job(job, reason="no_capacity_in_zone")
            return job
    rank = _ranked(tx, job, step, fleeing, exclude=exclude, waiting=waiting)
    if rank and job.committed_url and job.zone:  # moving the checkpoint elsewhere costs too
        url = job.spec.checkpoint.url
        moved = ((c + transfer_cost_usd(job.zone, ps, cfg, url), n, ps) for c, n, ps in rank)
        rank = sorted(moved, key=lambda t: (t[0], t[1]))
    if not rank and job.avoid_pools:  # the pools being left are the only ones open: stay after all
        tx.record(job.job_id, "migrate_abandoned", "no_other_pool", pools=list(job.avoid_pools))
        return replenish(tx, tx.update_job(job, avoid_pools=()), given)
    if not rank:
        if job.reason != "no_feasible_pool":
            tx.record(job.job_id, "wait", "no_feasible_pool")
            job = tx.update_job(job, reason="no_feasible_pool")
        return job
    best = rank[0][2]
    new_zone = zone_of(best.pool)
    probe = msgspec.structs.replace(job, zone=new_zone)  # the job as it would be there (not written)
    have_there = sum(1 for n in job_nodes(tx, job) if acceptable(probe, n, suspect_ok=True))
    count = affordable(tx, job, best, job.target_nodes - have_there)
    if have_there + count < max(spec.nodes_min, 1):  # the budget cannot carry the move: do not start it
        return budget_blocked(tx, job, best, job.target_nodes - have_there, alternatives(rank, cfg))
    if job.zone and new_zone != job.zone:
        tx.record(job.job_id, "move_zone", "no_capacity_in_zone", alternatives(rank, cfg), src=job.zone, dst=new_zone)
    job = drop_unusable(tx, tx.update_job(job, zone=new_zone), "zone_move")
    reason = "placement" if job.phase == J.PENDING else "move"
    return _placing(tx, launch(tx, job, best, count, reason, alternatives(rank, cfg)))


def _ranked(tx: Tx, job: Job, step: int, fleeing: bool, **kw: Any) -> list[Ranked]:
    rank = ranked(tx.pools, job, job.target_nodes, step, tx.cfg, tx.now, fleeing=fleeing, **kw) if fleeing else []
    return rank or ranked(tx.pools, job, job.target_nodes, step, tx.cfg, tx.now, **kw)


def _placing(tx: Tx, job: Job) -> Job:
    """A PENDING job with nodes on the way is PLACING (try_start starts it once they registered)."""
    if job.phase == J.PENDING and any(n.phase in _INFLIGHT for n in job_nodes(tx, job)):
        job = tx.job_phase(job, J.PLACING, reason="placement")
    return job


def lose_node(
    tx: Tx, node: Node, reason: str, *, preempted: bool, terminate: bool = True, reconcile: bool = True
) -> None:
    """A confirmed failure: abandon the generation it was in, resume from the last commit, replace it.
    ``reconcile=False`` (several losses in one Tick): only remove + abandon; the caller reconciles the
    job once afterwards, so no generation is started on a node that is lost a moment later."""
    job = tx.jobs.get(node.job_id)
    was_member = (
        job is not None
        and node.node_id in job.gen_nodes
        and node.node_id not in job.gen_exited
        and job.phase in (J.STARTING, J.RUNNING)
    )
    job = remove_node(tx, job, node, reason=reason, lost=True, terminate=terminate, preempted=preempted)
    if job is None or job.phase in TERMINAL_JOB_PHASES:
        return
    if was_member:
        job = abandon_generation(tx, job, reason)
    if reconcile:
        reconcile_job(tx, job, fleeing=preempted)


def reconcile_job(tx: Tx, job: Job, *, fleeing: bool = False) -> Job:
    """After nodes changed: end the generation if it is over, start the next one, launch what lacks."""
    if job.phase in TERMINAL_JOB_PHASES:
        return job
    job = maybe_end_generation(tx, job)
    if job.phase in (J.PLACING, J.RESIZING):
        job = try_start(tx, job)
    return replenish(tx, job, fleeing=fleeing)
