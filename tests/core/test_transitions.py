"""Lifecycle transition maps as data: the tables, the checks, and that decide only ever moves along them."""

from __future__ import annotations

import pytest

from orchestrator.core import JOB_TRANSITIONS, NODE_TRANSITIONS, IllegalTransition, JobPhase, NodePhase, State
from orchestrator.core.model import TERMINAL_JOB_PHASES, Job
from orchestrator.core.transitions import check_job, check_node
from orchestrator.core.tx import Tx
from tests.core.harness import spec

J, N = JobPhase, NodePhase

JOB_ALLOWED = [
    (J.PENDING, J.PLACING),
    (J.PLACING, J.STARTING),
    (J.STARTING, J.RUNNING),
    (J.RUNNING, J.CHECKPOINTING),
    (J.CHECKPOINTING, J.RESIZING),
    (J.RESIZING, J.STARTING),
    (J.RUNNING, J.RECOVERING),
    (J.RECOVERING, J.RESIZING),
    (J.CHECKPOINTING, J.PAUSED),
    (J.PAUSED, J.PENDING),
    (J.RUNNING, J.SUCCEEDED),
    (J.CHECKPOINTING, J.STOPPED),
    (J.PENDING, J.CANCELLED),
    (J.RUNNING, J.FAILED),
]
JOB_ILLEGAL = [
    (J.PENDING, J.RUNNING),
    (J.PLACING, J.RUNNING),
    (J.RUNNING, J.STARTING),
    (J.RUNNING, J.PAUSED),  # a pause always goes through a checkpoint
    (J.SUCCEEDED, J.RUNNING),
    (J.CANCELLED, J.PENDING),
    (J.STOPPED, J.PLACING),
    (J.PAUSED, J.RUNNING),
    (J.RESIZING, J.RUNNING),
]
NODE_ALLOWED = [
    (N.REQUESTED, N.BOOTING),
    (N.BOOTING, N.REGISTERED),
    (N.REQUESTED, N.REGISTERED),  # the agent may register before NodeLaunched arrives
    (N.REGISTERED, N.RUNNING),
    (N.RUNNING, N.NOTICED),
    (N.RUNNING, N.REGISTERED),
    (N.RUNNING, N.DRAINING),
    (N.NOTICED, N.TERMINATED),
    (N.NOTICED, N.GONE),
    (N.DRAINING, N.NOTICED),
]
NODE_ILLEGAL = [
    (N.REQUESTED, N.RUNNING),
    (N.BOOTING, N.RUNNING),
    (N.NOTICED, N.RUNNING),
    (N.NOTICED, N.REGISTERED),
    (N.GONE, N.REGISTERED),
    (N.TERMINATED, N.BOOTING),
    (N.DRAINING, N.RUNNING),
]


@pytest.mark.parametrize("old,new", JOB_ALLOWED)
def test_job_allowed(old: JobPhase, new: JobPhase) -> None:
    check_job(old, new)


@pytest.mark.parametrize("old,new", JOB_ILLEGAL)
def test_job_illegal(old: JobPhase, new: JobPhase) -> None:
    with pytest.raises(IllegalTransition):
        check_job(old, new)


@pytest.mark.parametrize("old,new", NODE_ALLOWED)
def test_node_allowed(old: NodePhase, new: NodePhase) -> None:
    check_node(old, new)


@pytest.mark.parametrize("old,new", NODE_ILLEGAL)
def test_node_illegal(old: NodePhase, new: NodePhase) -> None:
    with pytest.raises(IllegalTransition):
        check_node(old, new)


def test_maps_are_complete_and_terminal_phases_are_final() -> None:
    assert set(JOB_TRANSITIONS) == set(JobPhase)
    assert set(NODE_TRANSITIONS) == set(NodePhase)
    for p in TERMINAL_JOB_PHASES:
        assert JOB_TRANSITIONS[p] == frozenset()
    for p in (N.GONE, N.TERMINATED):
        assert NODE_TRANSITIONS[p] == frozenset()
    # every phase is reachable from PENDING / REQUESTED
    for table, start in ((JOB_TRANSITIONS, J.PENDING), (NODE_TRANSITIONS, N.REQUESTED)):
        seen, todo = {start}, [start]
        while todo:
            for nxt in table[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        assert seen == set(table)


def test_tx_refuses_illegal_job_transition() -> None:
    tx = Tx(State.empty(), "test", 0.0)
    job = tx.put_job(Job(job_id="j", spec=spec(), phase=J.PENDING, phase_ts=0.0, submitted_ts=0.0, target_nodes=1))
    with pytest.raises(IllegalTransition):
        tx.job_phase(job, J.RUNNING)
    new = tx.job_phase(job, J.PLACING)
    with pytest.raises(IllegalTransition):  # a stale record may never overwrite a newer one
        tx.update_job(job, reason="stale")
    assert tx.job("j") is new
