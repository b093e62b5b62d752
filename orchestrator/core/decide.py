"""``decide(state, event, now) -> Decision``: the one entry point of the pure decision core.

Role: dispatch each event to its handler; handlers change a ``Tx`` (lifecycle.py, policy.py) and the
``Tx`` becomes the Decision. Pure: no I/O, no clock (``now`` is a parameter), no logging, no randomness;
equal inputs give equal outputs, which is what lets a restarted daemon re-execute a persisted decision's
commands with the same ids and tokens.

Robustness contract: events about unknown jobs/nodes, stale generations, redelivered events are ignored
(same state, no commands, at most an audit entry). ``decide`` raises only ``IllegalTransition`` (a bug).

Heartbeats take a fast path (no Tx): they update one node record and, when nothing but liveness and
progress changed (last_seen, seq, step, loss, step time), leave ``dirty`` empty - see docs/core.md for
how the shell persists those at a lower rate. ``fold_heartbeats`` gives the daemon the trust gate's
heartbeat rule and that fast path for a run of heartbeats at once (one state rebuild per run).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, NamedTuple, assert_never

import msgspec

from orchestrator.core import gate, policy, replicas, roots, sweeps, tick, tracking
from orchestrator.core import lifecycle as lc
from orchestrator.core import node_events as ne
from orchestrator.core.commands import OTHER_LAUNCH_TOKEN, SECOND_INSTANCE, UNKNOWN_NODE, Terminate
from orchestrator.core.costs import billing_start
from orchestrator.core.inputs import (
    AgentDisconnected,
    BusState,
    CommandFailed,
    CoreEvent,
    JobCancelled,
    JobSubmitted,
    LaunchFailed,
    LeaseChanged,
    NodeDrainRequested,
    NodeGone,
    NodeLaunched,
    Tick,
    TrackingRunCreated,
)
from orchestrator.core.model import GEN_PHASES, TERMINAL_JOB_PHASES, Intent, Job, JobPhase, Node, NodePhase, fin
from orchestrator.core.placement import launch_failed
from orchestrator.core.state import Decision, State
from orchestrator.core.timers import build as build_timers
from orchestrator.core.tx import Tx
from wire.messages import (
    AgentState,
    CheckpointCommitted,
    CommandAck,
    GenerationStarted,
    Heartbeat,
    InstanceId,
    Market,
    NodeId,
    NodeLeaving,
    NodeRegistered,
    PoolKey,
    PreemptionNotice,
    PriceTick,
    RanksExited,
)

J = JobPhase
N = NodePhase
_replace = msgspec.structs.replace
_EMPTY: frozenset[str] = frozenset()


def decide(state: State, event: CoreEvent, now: float) -> Decision:
    if state.timers is None:  # a state built by hand: the index of what comes due, from its records
        state = State(state.jobs, state.nodes, state.pools, state.meta,
                      build_timers(state.jobs, state.nodes))
    if type(event) is Heartbeat:
        fast = _heartbeat_fast(state, event, now)
        if fast is not None:
            return fast
    tx = Tx(state, type(event).__name__, now)
    match event:
        case Heartbeat():
            _heartbeat_slow(tx, event)
        case Tick():
            tick.on_tick(tx)
        case PriceTick():
            policy.on_price(tx, event)
        case JobSubmitted():
            _job_submitted(tx, event)
        case JobCancelled():
            _job_cancelled(tx, event)
        case NodeLaunched():
            _node_launched(tx, event)
        case LaunchFailed():
            _launch_failed(tx, event)
        case NodeRegistered():
            _node_registered(tx, event)
        case GenerationStarted():
            _generation_started(tx, event)
        case CheckpointCommitted():
            _checkpoint_committed(tx, event)
        case RanksExited():
            _ranks_exited(tx, event)
        case PreemptionNotice():
            ne.notice(tx, event)
        case NodeGone():
            ne.node_gone(tx, event)
        case AgentDisconnected():
            ne.agent_disconnected(tx, event)
        case NodeLeaving():
            ne.node_leaving(tx, event)
        case NodeDrainRequested():
            ne.drain(tx, event)
        case CommandFailed():
            ne.command_failed(tx, event)
        case CommandAck():
            pass  # acks are the shell's business (retries); failures arrive as CommandFailed
        case BusState():
            if event.connected:
                tx.put_meta(bus_connected=True, detect_paused_until=now + tx.cfg.heartbeat_timeout_s)
            else:
                tx.put_meta(bus_connected=False)
            tx.record(None, "failure_detection", "bus_connected" if event.connected else "bus_disconnected")
        case TrackingRunCreated():
            tracking.run_created(tx, event)
        case LeaseChanged():
            if event.revision != tx.meta.fencing_token:
                tx.put_meta(fencing_token=event.revision)
            if event.cluster_id and isinstance(tx.meta.cluster_id, msgspec.UnsetType):
                tx.put_meta(cluster_id=event.cluster_id)
                tx.record(None, "cluster_id", "recorded", cluster_id=event.cluster_id)
        case _:
            assert_never(event)
    return tx.decision()


# --- heartbeats ---------------------------------------------------------------------------------


def _heartbeat_fast(state: State, hb: Heartbeat, now: float) -> Decision | None:
    """The common case: a known, healthy node reports liveness/progress. None -> take the slow path."""
    node = state.nodes.get(hb.node_id)
    if node is None:
        return Decision(state, (), (), _EMPTY)
    new = _fast_record(node, state.jobs.get(node.job_id), hb, now)
    if new is None:
        return None
    # last_seen only moves forward here: the node's entry in the index (timers.py) stays a lower bound
    return Decision(State(state.jobs, state.nodes.set(node.node_id, new), state.pools, state.meta, state.timers),
                    (), (), _EMPTY)


# the members the fast path compares with, read once (reading an enum member costs as much as a map lookup)
_LIVE_PHASES: Final = (N.RUNNING, N.REGISTERED)
_RUNNING: Final = N.RUNNING
_STARTING: Final = J.STARTING
_TRAINING: Final = AgentState.TRAINING


def _fast_record(node: Node, job: Job | None, hb: Heartbeat, now: float) -> Node | None:
    """The node's record after a heartbeat that changes only liveness and progress (``job``: the node's
    job), or None when the heartbeat needs the slow path: a suspect, disconnected or not yet running
    node, or a job's first sign of training (it becomes RUNNING)."""
    # No seq-based drop: an agent that restarted starts again at seq 1 (heartbeats are core NATS,
    # ordered per connection); progress never goes backwards because step only grows.
    if node.suspect_since is not None or node.disconnected or node.phase not in _LIVE_PHASES:
        return None
    step = node.step
    if hb.generation == node.generation:
        if (node.phase == _RUNNING and hb.state == _TRAINING and job is not None and job.phase == _STARTING
                and job.generation == node.generation):
            return None
        if hb.step > step:
            step = hb.step
    return _replace(node, last_seen=now, hb_seq=hb.seq, step=step,
                    loss=fin(hb.loss) if hb.loss is not None else node.loss,
                    step_time_s=fin(hb.step_time_s) or node.step_time_s)


class HeartbeatFold(NamedTuple):
    """What ``fold_heartbeats`` did with a run of heartbeats."""

    state: State  # after the heartbeats folded
    stop: int  # the index of the first one not folded (it takes the slow path), or the run's end
    refused: list[tuple[int, str]]  # (index, reason) of those the trust gate refused, in order
    live: list[str]  # the record keys of the nodes updated, one per heartbeat folded (liveness only)


def fold_heartbeats(state: State, hbs: Sequence[Heartbeat], start: int, end: int, now: float) -> HeartbeatFold:
    """``gate.authorize`` then ``decide`` for the heartbeats ``hbs[start:end]``, in order, with the same
    results as one by one, in one state rebuild (the daemon's hot path): each one is refused by the trust
    gate (``gate.heartbeat_refusal``) or takes the fast path (``_fast_record``) - a Decision with no
    command, no audit and an empty ``dirty``; its node's record key goes to ``live`` -, until the first
    one that needs the slow path (``stop``: not folded; the caller decides it with ``decide`` and folds
    on from the next one). One node and one job lookup per heartbeat, for both rules:
    tests/core/test_heartbeat_fold.py holds the fold equal to ``authorize`` + ``decide`` one by one."""
    if state.timers is None:
        state = State(state.jobs, state.nodes, state.pools, state.meta, build_timers(state.jobs, state.nodes))
    jobs = state.jobs
    nodes = state.nodes.mutate()
    get, put, job_of, refusal = nodes.get, nodes.set, jobs.get, gate.heartbeat_refusal
    refused: list[tuple[int, str]] = []
    live: list[str] = []
    i = start
    while i < end:
        hb = hbs[i]
        node = get(hb.node_id)
        job = None if node is None else job_of(node.job_id)
        why = refusal(hb, node, job)
        if why is not None:
            refused.append((i, why))
        else:
            assert node is not None  # refused otherwise
            new = _fast_record(node, job, hb, now)
            if new is None:
                break
            put(hb.node_id, new)
            live.append("node." + hb.node_id)
        i += 1
    after = State(jobs, nodes.finish(), state.pools, state.meta, state.timers) if live else state
    return HeartbeatFold(after, i, refused, live)


def _heartbeat_slow(tx: Tx, hb: Heartbeat) -> None:
    node = tx.nodes.get(hb.node_id)
    if node is None:
        return
    changes: dict[str, object] = {"last_seen": tx.now, "hb_seq": max(hb.seq, node.hb_seq)}
    if hb.generation == node.generation and hb.step > node.step:
        changes["step"] = hb.step
    if fin(hb.step_time_s):
        changes["step_time_s"] = hb.step_time_s
    if hb.loss is not None:
        changes["loss"] = fin(hb.loss)
    if node.suspect_since is not None or node.disconnected:
        changes["suspect_since"] = None
        changes["disconnected"] = False
        tx.record(node.job_id, "node_recovered", "heartbeat", node_id=node.node_id)
    node = tx.update_node(node, **changes)
    job = tx.jobs.get(node.job_id)
    if job is None:
        return
    if (
        job.phase == J.STARTING
        and node.phase == N.RUNNING
        and hb.generation == job.generation == node.generation
        and hb.state == AgentState.TRAINING
    ):
        job = tx.job_phase(job, J.RUNNING, reason="training", gen_confirmed=True)
    if node.phase == N.REGISTERED:
        job = lc.try_start(tx, job)
        lc.regroup(tx, job)


# --- jobs ---------------------------------------------------------------------------------------


def _job_submitted(tx: Tx, ev: JobSubmitted) -> None:
    if ev.job_id in tx.jobs:
        return  # redelivered
    spec = ev.spec
    # One job, one checkpoint root: never equal to, inside or containing another job's root, finished
    # jobs included (their checkpoints must not be resumed from by accident or rotated away).
    clash = roots.find_overlap(((j.job_id, j.spec.checkpoint.url) for j in tx.jobs.values()), spec.checkpoint.url)
    if clash is not None:
        tx.record(ev.job_id, "submit_refused", "checkpoint_root_overlap", name=spec.name, root=clash.root,
                  relation=clash.relation, other_job=clash.job_id, other_root=clash.other_root)
        return
    closed = sweeps.submit_refusal(tx, spec)  # a sweep past its deadline or at its total budget
    if closed is not None:
        tx.record(ev.job_id, "submit_refused", closed[0], name=spec.name, sweep_id=spec.sweep_id, message=closed[1])
        return
    target = min(max(spec.nodes, spec.nodes_min, 1), max(spec.nodes_max, spec.nodes_min, 1))
    job = Job(
        job_id=ev.job_id, spec=spec, phase=J.PENDING, phase_ts=tx.now, submitted_ts=tx.now,
        target_nodes=target, reason="submitted", node_seq=0, replica_secret=ev.replica_secret,
    )
    tx.put_job(job)
    tracking.on_submit(tx, job)
    if spec.budget_usd is not None:
        tx.put_meta(budget_jobs=tx.meta.budget_jobs + (ev.job_id,))
    start = roots.start_from(spec.checkpoint)  # named in the audit only when the spec gives one
    if start is None:
        tx.record(ev.job_id, "submit", "admin", name=spec.name, nodes=target, gpu_type=spec.gpu_type)
    else:
        tx.record(ev.job_id, "submit", "admin", name=spec.name, nodes=target, gpu_type=spec.gpu_type,
                  start_from=start)
    lc.replenish(tx, job)


def _job_cancelled(tx: Tx, ev: JobCancelled) -> None:
    job = tx.jobs.get(ev.job_id)
    if job is None or job.phase in TERMINAL_JOB_PHASES:
        return
    tx.record(job.job_id, "cancel", ev.reason)
    if job.phase in (J.STARTING, J.RUNNING):
        lc.checkpoint_job(tx, job, Intent.CANCEL, "cancel")
    elif job.phase in (J.CHECKPOINTING, J.RECOVERING):
        tx.update_job(job, intent=Intent.CANCEL)
    else:
        job = lc.terminate_all(tx, job, "cancel")
        tx.job_phase(job, J.CANCELLED, reason=ev.reason)


# --- nodes --------------------------------------------------------------------------------------


def _terminate_unowned(
    tx: Tx, node_id: NodeId, instance_id: InstanceId | None, pool: PoolKey | None, job_id: str | None, why: str
) -> None:
    """An instance the state does not own (unknown node, a node already terminated/gone - its record
    is deleted -, another launch's token, a second instance for one node): terminate it, never adopt
    it. No state change, so a redelivery decides the same Terminate again (idempotent at the cloud)."""
    tx.emit(Terminate(node_id=node_id, instance_id=instance_id, pool=pool, reason=why))
    tx.record(job_id, "terminate_unowned", why, node_id=node_id, instance_id=instance_id)


def _node_launched(tx: Tx, ev: NodeLaunched) -> None:
    node = tx.nodes.get(ev.node_id)
    if node is None or node.token != ev.token:
        _terminate_unowned(tx, ev.node_id, ev.instance_id, ev.pool, ev.job_id,
                           UNKNOWN_NODE if node is None else OTHER_LAUNCH_TOKEN)
        return
    if node.instance_id is not None:
        if ev.instance_id != node.instance_id:
            _terminate_unowned(tx, ev.node_id, ev.instance_id, ev.pool, node.job_id, SECOND_INSTANCE)
        return  # redelivered
    job = tx.jobs.get(node.job_id)
    phase = N.BOOTING if node.phase == N.REQUESTED else node.phase
    launched = node.launched_ts if node.launched_ts is not None else tx.now
    billing = billing_start(tx, node) if node.phase == N.REQUESTED else {}
    node = tx.node_phase(node, phase, instance_id=ev.instance_id, launched_ts=launched, **billing)
    ps = tx.pools.get(node.pool_name)
    if ps is not None and (ps.failures or ps.backoff_until > tx.now):  # the pool had room: its backoff ends
        tx.put_pool(node.pool_name, _replace(ps, failures=0, backoff_until=min(ps.backoff_until, tx.now),
                                             probe_until=msgspec.UNSET))
    if job is None or job.phase in TERMINAL_JOB_PHASES or job.phase == J.PAUSED:
        lc.remove_node(tx, job, node, reason="job_not_active", lost=False, terminate=True)
        return
    policy.check_budget(tx, tx.job(job.job_id))


def _launch_failed(tx: Tx, ev: LaunchFailed) -> None:
    failed = []
    for nid in dict.fromkeys(ev.node_ids):  # unique, in order
        n = tx.nodes.get(nid)
        if n is not None and n.token == ev.token and n.phase == N.REQUESTED:
            failed.append(n)
    if not failed:
        return  # redelivered, or stale
    name = failed[0].pool_name
    ps = tx.pools.get(name)
    if ps is not None:
        tx.put_pool(name, launch_failed(ps, tx.cfg, tx.now))
    tx.record(failed[0].job_id, "launch_failed", str(ev.reason), pool=name, nodes=[n.node_id for n in failed],
              message=ev.message[:200])
    owner = tx.jobs.get(failed[0].job_id)
    if owner is not None and owner.spec.deadline_ts is not None and failed[0].pool.market == Market.ON_DEMAND:
        # the safety net relies on on-demand: the job tries the other on-demand pools (this one is in backoff)
        tx.record(owner.job_id, "deadline_at_risk", "on_demand_launch_failed", pool=name,
                  deadline_ts=owner.spec.deadline_ts)
    for n in failed:
        lc.remove_node(tx, tx.jobs.get(n.job_id), n, reason=f"launch_failed_{ev.reason}", lost=True, terminate=False)
    job = tx.jobs.get(failed[0].job_id)
    if job is not None and job.phase not in TERMINAL_JOB_PHASES:
        _reconcile(tx, job)


def _reconcile(tx: Tx, job: Job) -> None:
    job = tx.job(job.job_id)
    if job.phase in (J.PLACING, J.RESIZING):
        job = lc.try_start(tx, job)
    elif job.phase == J.RUNNING:
        job = lc.regroup(tx, job)
    if job.phase == J.PLACING and not job.nodes:
        job = tx.job_phase(job, J.PENDING, reason="no_nodes")
    lc.replenish(tx, job)


def _node_registered(tx: Tx, ev: NodeRegistered) -> None:
    node = tx.nodes.get(ev.node_id)
    if node is None:
        _terminate_unowned(tx, ev.node_id, ev.instance_id, ev.pool, None, UNKNOWN_NODE)
        return
    if ev.instance_id and node.instance_id is not None and ev.instance_id != node.instance_id:
        _terminate_unowned(tx, ev.node_id, ev.instance_id, ev.pool or node.pool, node.job_id, SECOND_INSTANCE)
        return
    if node.phase not in (N.REQUESTED, N.BOOTING):
        if ev.host and not node.host:
            tx.update_node(node, host=ev.host)
        return  # redelivered (or re-registration of an agent that restarted)
    job = tx.jobs.get(node.job_id)
    billed_now = node.phase == N.REQUESTED  # registration before NodeLaunched: billing starts here
    # The agent's instance id is never adopted: only the executor's NodeLaunched (what the cloud
    # returned to orchd) sets it; an agent could name another job's instance (the trust gate can only
    # compare it once NodeLaunched has set it).
    changes: dict[str, object] = {"host": ev.host or node.host, "last_seen": tx.now}
    if billed_now:
        changes["launched_ts"] = tx.now
        changes.update(billing_start(tx, node))
    node = tx.node_phase(node, N.REGISTERED, **changes)
    if job is None or job.phase in TERMINAL_JOB_PHASES or job.phase == J.PAUSED:
        lc.remove_node(tx, job, node, reason="job_not_active", lost=False, terminate=True)
        return
    if billed_now and policy.check_budget(tx, tx.job(job.job_id)):
        return
    _reconcile(tx, job)


def _generation_started(tx: Tx, ev: GenerationStarted) -> None:
    job = tx.jobs.get(ev.job_id)
    if job is None or ev.generation != job.generation or ev.node_id not in job.gen_nodes:
        return
    if job.phase == J.STARTING:
        tx.job_phase(job, J.RUNNING, reason="training", gen_confirmed=True)
        tx.record(job.job_id, "running", "generation_started", generation=ev.generation, first_step=ev.first_step)


def _checkpoint_committed(tx: Tx, ev: CheckpointCommitted) -> None:
    job = tx.jobs.get(ev.job_id)
    if job is None or ev.step <= job.committed_step and job.committed_url is not None:
        return  # unknown job, or a commit we already know (redelivered, or one per node)
    save = job.save_s
    measured = fin(ev.save_s)
    if measured is not None and measured > 0:
        save = measured if save is None else 0.5 * save + 0.5 * measured
    tx.update_job(job, committed_step=ev.step, committed_url=ev.url, committed_ts=tx.now, save_s=save,
                  step=max(job.step, ev.step), holds=msgspec.UNSET)  # progress saved: the backoff starts over
    tx.record(job.job_id, "checkpoint_committed", "emergency" if ev.emergency else "periodic", step=ev.step,
              url=ev.url, save_s=measured, deadline_margin_s=fin(ev.deadline_margin_s))


# RanksExited reasons counted against max_restarts: a trainer error, "no usable checkpoint" (a restart would
# fail the same way) and an exit 0 before total_steps ("exited_early"). Each of them, and a storage error
# (not counted: the checkpoint store, not the trainer), holds the next generation with backoff.
_COUNTED_EXITS = ("failed", "no_usable_checkpoint", "exited_early")
_HELD_EXITS = (*_COUNTED_EXITS, "storage_error")


def _ranks_exited(tx: Tx, ev: RanksExited) -> None:
    job = tx.jobs.get(ev.job_id)
    node = tx.nodes.get(ev.node_id)
    if job is None or node is None or ev.generation != job.generation or job.phase not in GEN_PHASES:
        return
    if ev.node_id not in job.gen_nodes or ev.node_id in job.gen_exited:
        return  # redelivered
    if ev.last_step > node.step:
        node = tx.update_node(node, step=ev.last_step)
    job = replicas.note_exit(tx, tx.update_job(job, gen_exited=job.gen_exited + (ev.node_id,)), ev)
    tx.record(job.job_id, "ranks_exited", ev.reason, node_id=ev.node_id, exit_code=ev.exit_code, last_step=ev.last_step)
    # completed: every step ran - reported, or committed already (a generation that resumed from the final
    # checkpoint, whose commit report came with an earlier generation, runs no step and reports none)
    done = max(ev.last_step, job.committed_step)
    if ev.reason == "completed" and done >= job.spec.total_steps:
        loss = None if isinstance(ev.last_loss, msgspec.UnsetType) else fin(ev.last_loss)
        job = tx.update_job(job, step=done, **({"final_loss": loss} if loss is not None else {}))
        job = lc.terminate_all(tx, job, "completed")
        tx.job_phase(job, J.SUCCEEDED, reason="completed")
        return
    if job.phase in (J.STARTING, J.RUNNING):
        why = "exited_early" if ev.reason == "completed" else ev.reason
        if why == "spec_error":  # the spec names an unusable model or dataset: every restart would fail alike
            job = lc.terminate_all(tx, job, why)
            tx.job_phase(job, J.FAILED, reason=why)
            return
        if why in _COUNTED_EXITS:
            job = tx.update_job(job, failures=job.failures + 1)
            if job.failures > tx.cfg.max_restarts:
                why = "trainer_failed" if why == "failed" else why
                job = lc.terminate_all(tx, job, why)
                tx.job_phase(job, J.FAILED, reason=why)
                return
        if why in _HELD_EXITS:
            job = lc.hold(tx, job, why)
        job = lc.abandon_generation(tx, job, f"ranks_exited_{ev.reason}")
    job = lc.maybe_end_generation(tx, job)
    lc.replenish(tx, job)
