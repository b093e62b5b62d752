"""The Tick: what comes due, and only that.

Role: ``on_tick`` - confirm pending prices that held (confirm.py), act on nodes whose launch timed
out, whose notice deadline passed or that fell silent, then visit each job whose Tick may do something
(``policy.job_tick``), in job id order. Which prices, nodes and jobs may be due comes from the index
(``State.timers``, timers.py): a superset of the due ones, each checked here with the full scan's own
conditions, so the decision is the one a scan of every node and job would make (tests/core/test_timers.py
compares the two), at a cost that follows what is due, not how many nodes and jobs exist. A job whose
visit did nothing may fall asleep (``_maybe_sleep``); a write that concerns it wakes it - also within
this Tick, for jobs after it in id order.

Failure detection is two-signal (policy.suspect): a heartbeat timeout only makes a node *suspect*;
NodeGone or AgentDisconnected confirms it. Detection is off while the daemon's bus is down and for one
heartbeat timeout after it reconnects.
"""

from __future__ import annotations

import heapq
import math

import msgspec

from orchestrator.core import lifecycle as lc
from orchestrator.core import sweeps
from orchestrator.core.model import Job, JobPhase, Node, NodePhase
from orchestrator.core.placement import launch_failed, reopens
from orchestrator.core.policy import ACTIVE, job_tick, steady, suspect
from orchestrator.core.timers import NOTICE_GRACE_S, POOLS, PRICE, SLOT_S, WATCHED, deadline_driven
from orchestrator.core.tx import Tx

J = JobPhase
N = NodePhase
_replace = msgspec.structs.replace


def on_tick(tx: Tx) -> None:
    """Act on what is due: node timeouts, then every job whose Tick may do something, in
    job id order. What may be due comes from the index (timers.py): a quiet job (a running one between
    price evaluations, a waiting one no pool can place) is not visited at all."""
    cfg, now = tx.cfg, tx.now
    detect = tx.meta.bus_connected and now >= tx.meta.detect_paused_until
    touched: set[str] = set()
    due, other = _due_nodes(tx, detect)
    for nid in due:
        cur = tx.nodes.get(nid)
        if cur is not None and _node_timeout(tx, cur, detect):
            touched.add(cur.job_id)
    # the other popped nodes, and the due ones still there, go back in (at their current times)
    other += [n for nid in due if (n := tx.nodes.get(nid)) is not None]
    tx.timers = tx.timers.arm_nodes(other, spread=False)
    for jid in sorted(touched):
        job = tx.jobs.get(jid)
        if job is not None:
            lc.reconcile_job(tx, job)
    tx.sync_timers()  # what the passes above wrote wakes the jobs it concerns, before they are visited
    evals = [cfg.max_price_evals_per_tick]
    tx.timers, order = tx.timers.pop_jobs(now)
    extra: list[str] = []  # jobs after the current one woken by what an earlier job's Tick wrote
    sweeps.on_tick(tx)  # a sweep's total budget and deadline, over all its jobs (sweeps.py)
    extra.extend(sorted(tx.sync_timers()))
    i, last = 0, ""
    expiry: list[float | None] = []
    done: list[str] = []  # finished jobs: they leave the index
    while True:
        if extra and (i >= len(order) or extra[0] < order[i]):
            jid = heapq.heappop(extra)
        elif i < len(order):
            jid = order[i]
            i += 1
        else:
            break
        if jid <= last and last:
            continue  # woken twice
        last = jid
        job = tx.jobs.get(jid)
        if job is None or (job.phase not in ACTIVE and job.phase != J.PAUSED):
            done.append(jid)
            continue
        jobs0, nodes0, pools0, meta0, nc, na = tx.jobs, tx.nodes, tx.pools, tx.meta, len(tx.cmds), len(tx.audit)
        job_tick(tx, job, evals)
        if (tx.jobs is jobs0 and tx.nodes is nodes0 and tx.pools is pools0 and tx.meta is meta0
                and len(tx.cmds) == nc and len(tx.audit) == na):
            _maybe_sleep(tx, job, expiry)
        else:
            expiry.clear()  # pools may have changed
            for w in tx.sync_timers():
                if w > jid:
                    heapq.heappush(extra, w)
    tx.timers = tx.timers.retire(done)


def _maybe_sleep(tx: Tx, job: Job, expiry: list[float | None]) -> None:
    """A job whose Tick just did nothing sleeps where its next Ticks provably do nothing either until a
    known time or a change the index sees (timers.py, PRICE / POOLS)."""
    if deadline_driven(job):
        return
    if job.phase == J.RUNNING:
        if steady(job) and job.spec.budget_usd is None:
            tx.timers = tx.timers.sleep(job.job_id, PRICE, job.price_eval_ts + tx.cfg.price_eval_interval_s)
    elif job.phase in (J.PENDING, J.PAUSED) and not job.nodes:
        if not expiry:  # the next launch backoff (or waiting job's retry) or notice skip to expire (once per Tick)
            now, cfg = tx.now, tx.cfg
            times = [t for ps in tx.pools.values() for t in reopens(ps, cfg) if t > now]
            expiry.append(min(times) if times else None)
        tx.timers = tx.timers.sleep(job.job_id, POOLS, expiry[0])


def _noticed_gone(node: Node, now: float) -> bool:
    """A noticed node whose deadline passed NOTICE_GRACE_S ago: its instance is surely gone."""
    return node.phase == N.NOTICED and node.notice_deadline is not None and now > node.notice_deadline + NOTICE_GRACE_S


def _silent(tx: Tx, node: Node, detect: bool) -> bool:
    """A watched node, not yet suspect, silent for longer than the heartbeat timeout."""
    return (
        node.phase in WATCHED
        and detect
        and node.suspect_since is None
        and tx.now - node.last_seen > tx.cfg.heartbeat_timeout_s
    )


def _due_nodes(tx: Tx, detect: bool) -> tuple[list[str], list[Node]]:
    """(the nodes a Tick must act on, sorted - the decision must not depend on hash order
    (PYTHONHASHSEED) -; the other popped nodes that need more than a heartbeat re-check). The index
    gives a superset of the due nodes (timers.py); each is checked here with the conditions of
    ``_noticed_gone`` and ``_silent``, inlined (no call per node). A popped node that is not due and
    only waits for its heartbeat timeout goes back in at once, at its real ``last_seen``."""
    now, cfg = tx.now, tx.cfg
    launch_timeout, timeout = cfg.launch_timeout_s, cfg.heartbeat_timeout_s
    tx.timers, seen = tx.timers.pop_nodes(now, launch_timeout, timeout, detect)
    if not seen:
        return [], []
    due: list[str] = []
    other: list[Node] = []
    hb: dict[int, dict[str, None]] = {}
    nodes = tx.nodes
    for nid in seen:
        node = nodes.get(nid)
        if node is None:
            continue
        phase = node.phase
        if phase in (N.REQUESTED, N.BOOTING):
            if now - node.requested_ts > launch_timeout:
                due.append(nid)
            else:
                other.append(node)
        elif phase in WATCHED:
            deadline = node.notice_deadline
            if (
                (phase == N.NOTICED and deadline is not None and now > deadline + NOTICE_GRACE_S)
                or (detect and node.suspect_since is None and now - node.last_seen > timeout)
                or (detect and node.suspect_since is not None and now - node.suspect_since > timeout)
            ):
                due.append(nid)
            elif phase != N.NOTICED and node.suspect_since is None:
                hb.setdefault(math.floor(node.last_seen / SLOT_S), {})[nid] = None
            else:
                other.append(node)
    tx.timers = tx.timers.rearm_hb(hb)
    return sorted(due), other


def _node_timeout(tx: Tx, node: Node, detect: bool) -> bool:
    """Act on one due node (a fresh record): launch timeout, notice deadline passed, heartbeat timeout.
    True when the node was removed (its job needs reconciling); a new suspect is not."""
    if node.phase in (N.REQUESTED, N.BOOTING):
        _launch_timed_out(tx, node)
    elif _noticed_gone(node, tx.now):
        lc.lose_node(tx, node, "notice_deadline_passed", preempted=False, reconcile=False)
    elif _silent(tx, node, detect):
        if not node.disconnected:
            suspect(tx, node, "heartbeat_timeout")
            return False
        lc.lose_node(tx, node, "heartbeat_timeout_after_disconnect", preempted=False, reconcile=False)
    elif _still_silent(tx, node, detect):
        suspect(tx, node, "still_silent")  # ask the provider again: its instance may have died since
        return False
    else:
        return False
    return True


def _still_silent(tx: Tx, node: Node, detect: bool) -> bool:
    """A suspect node not heard for another heartbeat timeout since it became (or was last checked as)
    suspect. The provider said its instance was running then; it may have died since, and without a
    new check nothing would ever give the node up."""
    return (
        node.phase in WATCHED
        and detect
        and node.suspect_since is not None
        and tx.now - node.suspect_since > tx.cfg.heartbeat_timeout_s
    )


def _launch_timed_out(tx: Tx, node: Node) -> None:
    ps = tx.pools.get(node.pool_name)
    if ps is not None:
        tx.put_pool(node.pool_name, launch_failed(ps, tx.cfg, tx.now))
    job = tx.jobs.get(node.job_id)
    lc.remove_node(tx, job, node, reason="launch_timeout", lost=True, terminate=True)
