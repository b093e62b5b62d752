"""Handlers for what happens to nodes: preemption notices, losses, disconnects, drains, failed commands.

Role: the node-side half of ``decide`` (decide.py dispatches here). A terminate notice triggers a
checkpoint of every member AND a replacement launch in the same decision (the further notices of one
reclaim of a pool are replaced together, with the last of them); a loss is acted on only when
confirmed (NodeGone, AgentDisconnected after a heartbeat timeout, the agent leaving unexpectedly).
"""

from __future__ import annotations

import msgspec

from orchestrator.core import lifecycle as lc
from orchestrator.core import policy
from orchestrator.core.inputs import AgentDisconnected, CommandFailed, NodeDrainRequested, NodeGone
from orchestrator.core.model import GEN_PHASES, TERMINAL_JOB_PHASES, Intent, Job, JobPhase, Node, NodePhase, fin
from orchestrator.core.pricing import record_exposure
from orchestrator.core.tx import Tx
from wire.messages import Market, NodeLeaving, NoticeKind, PreemptionNotice

J = JobPhase
N = NodePhase
_replace = msgspec.structs.replace


def notice(tx: Tx, ev: PreemptionNotice) -> None:
    node = tx.nodes.get(ev.node_id)
    if node is None:
        tx.record(None, "ignore", "unknown_node", node_id=ev.node_id)
        return
    if ev.kind == NoticeKind.REBALANCE:
        ps = tx.pools.get(node.pool_name)
        if ps is not None and node.pool.market == Market.SPOT:
            tx.put_pool(node.pool_name, _replace(ps, last_preempted_ts=tx.now))
        tx.record(node.job_id, "note", "rebalance_recommendation", node_id=node.node_id, pool=node.pool_name)
        return
    if node.phase not in (N.REQUESTED, N.BOOTING, N.REGISTERED, N.RUNNING, N.DRAINING):
        return  # already noticed (redelivered), or gone
    # The deadline is clamped into [now, now + the notice window of the node's cloud as the state records
    # it (never the cloud the event names)]: a host with a wrong clock still gets its checkpoint, and a
    # far-future deadline cannot close the pool for good (noticed_until) or keep a dead node alive.
    # A terminate notice without a usable deadline: assume that window.
    latest = tx.now + tx.cfg.notice_window_s(node.pool.cloud)
    deadline = fin(ev.deadline_ts)
    deadline = latest if deadline is None else min(max(deadline, tx.now), latest)
    ps = tx.pools.get(node.pool_name)
    if ps is not None:
        # the pool's capacity is going away: no new launches there until the deadline + grace
        skip = ps.noticed_until
        if node.pool.market == Market.SPOT:
            skip = max(skip, deadline + tx.cfg.notice_skip_grace_s)
        exposure = record_exposure(ps, tx.cfg, tx.now, 0, True, node.job_id)
        tx.put_pool(node.pool_name, _replace(ps, noticed_until=skip, **exposure))
    # A notice may overtake the launch's confirmation (NodeLaunched): a REQUESTED node is noticed too -
    # dropped at once below (never a member), so no generation starts on an instance about to die.
    if node.phase != N.REQUESTED:
        node = tx.node_phase(node, N.NOTICED, notice_deadline=deadline)
    job = tx.jobs.get(node.job_id)
    tx.record(node.job_id, "preemption_notice", ev.source, node_id=node.node_id, pool=node.pool_name,
              deadline_ts=deadline)
    if job is None or job.phase in TERMINAL_JOB_PHASES:
        lc.remove_node(tx, job, node, reason="preemption_notice", lost=False, terminate=True)
        return
    member = node.node_id in job.gen_nodes and node.node_id not in job.gen_exited and job.phase in GEN_PHASES
    if member:
        if job.phase in (J.STARTING, J.RUNNING):
            job = lc.checkpoint_job(tx, job, Intent.PREEMPTION, "preemption_notice", deadline)
        if _reclaim_goes_on(tx, job, node):
            tx.record(job.job_id, "wait", "reclaim_notices_pending", node_id=node.node_id, pool=node.pool_name)
            return
    else:
        job = lc.remove_node(tx, job, node, reason="preemption_notice", lost=False, terminate=True)
    lc.replenish(tx, job, exclude=frozenset({node.pool_name}), fleeing=True)


def _reclaim_goes_on(tx: Tx, job: Job, node: Node) -> bool:
    """``node``'s notice is a further one of a reclaim of its pool that is still coming in: another member
    of the generation in that pool was noticed already, and some are still running without a notice.
    The first notice of a pool is replaced at once (make before break); the further ones of the same
    reclaim - normally the same second - are replaced together with the last of them, as one request,
    instead of one request per notice (the next generation needs every node: it would wait for the
    slowest of n separate launches). If the reclaim stops short, the next Tick or the end of the save
    launches what is missing."""
    mates = [m for m in lc.members_alive(tx, job) if m.pool_name == node.pool_name and m.node_id != node.node_id]
    return any(m.phase == N.NOTICED for m in mates) and any(m.phase == N.RUNNING for m in mates)


def node_gone(tx: Tx, ev: NodeGone) -> None:
    node = tx.nodes.get(ev.node_id)
    if node is None:
        return
    if ev.instance_id is not None and node.instance_id is not None and ev.instance_id != node.instance_id:
        return  # another instance than the node's (an unowned second instance terminated): the node lives
    preempted = ev.reason != "terminated_by_us" and node.pool.market == Market.SPOT and node.phase != N.NOTICED
    lc.lose_node(tx, node, f"node_gone_{ev.reason}", preempted=preempted, terminate=False)


def agent_disconnected(tx: Tx, ev: AgentDisconnected) -> None:
    node = tx.nodes.get(ev.node_id)
    if node is None or node.disconnected:
        return
    if node.suspect_since is not None:
        lc.lose_node(tx, node, "agent_disconnected_after_timeout", preempted=False)
    else:
        tx.update_node(node, disconnected=True)
        tx.record(node.job_id, "note", "agent_disconnected", node_id=node.node_id)


def node_leaving(tx: Tx, ev: NodeLeaving) -> None:
    node = tx.nodes.get(ev.node_id)
    if node is None or node.phase in (N.NOTICED, N.DRAINING):
        return  # expected: it leaves after its checkpoint / at its deadline
    lc.lose_node(tx, node, f"node_leaving_{ev.reason}", preempted=False)


def drain(tx: Tx, ev: NodeDrainRequested) -> None:
    node = tx.nodes.get(ev.node_id)
    if node is None or node.phase in (N.NOTICED, N.DRAINING):
        return
    job = tx.jobs.get(node.job_id)
    tx.record(node.job_id, "drain", ev.reason, node_id=node.node_id)
    if job is not None and node.node_id in job.gen_nodes and job.phase in (J.STARTING, J.RUNNING):
        tx.node_phase(node, N.DRAINING)
        job = lc.checkpoint_job(tx, job, Intent.DRAIN, "drain")
    elif job is not None and node.node_id in job.gen_nodes and job.phase in GEN_PHASES:
        tx.node_phase(node, N.DRAINING)  # leaves at the end of the current checkpoint/recovery
    else:
        job = lc.remove_node(tx, job, node, reason="drain", lost=False, terminate=True)
    if job is not None:
        lc.replenish(tx, tx.job(job.job_id))


def command_failed(tx: Tx, ev: CommandFailed) -> None:
    node = tx.nodes.get(ev.node_id)
    if node is None or node.suspect_since is not None or node.phase in (N.REQUESTED, N.BOOTING):
        return
    policy.suspect(tx, node, f"command_failed_{ev.kind}")
