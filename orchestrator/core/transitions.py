"""Allowed lifecycle transitions, as data.

Role: the single definition of which phase may follow which, for jobs and for nodes. ``decide`` checks
every phase change against these maps; an illegal one raises ``IllegalTransition`` - that is a bug in
the core (the property tests drive random event sequences through ``decide`` to catch it), never an
input problem: bad or unexpected inputs are ignored, not raised.
"""

from __future__ import annotations

from typing import Final

from orchestrator.core.model import JobPhase, NodePhase

J = JobPhase
N = NodePhase

_ENDS: Final = frozenset({J.FAILED, J.CANCELLED, J.STOPPED})

JOB_TRANSITIONS: Final[dict[JobPhase, frozenset[JobPhase]]] = {
    J.PENDING: frozenset({J.PLACING}) | _ENDS,
    J.PLACING: frozenset({J.STARTING, J.PENDING}) | _ENDS,
    J.STARTING: frozenset({J.RUNNING, J.CHECKPOINTING, J.RECOVERING, J.SUCCEEDED}) | _ENDS,
    J.RUNNING: frozenset({J.CHECKPOINTING, J.RECOVERING, J.SUCCEEDED}) | _ENDS,
    J.CHECKPOINTING: frozenset({J.RESIZING, J.RECOVERING, J.PAUSED, J.SUCCEEDED}) | _ENDS,
    J.RECOVERING: frozenset({J.RESIZING, J.PAUSED, J.SUCCEEDED}) | _ENDS,
    J.RESIZING: frozenset({J.STARTING, J.PENDING}) | _ENDS,
    J.PAUSED: frozenset({J.PLACING, J.PENDING}) | _ENDS,
    J.SUCCEEDED: frozenset(),
    J.FAILED: frozenset(),
    J.CANCELLED: frozenset(),
    J.STOPPED: frozenset(),
}

_DEAD: Final = frozenset({N.GONE, N.TERMINATED})

NODE_TRANSITIONS: Final[dict[NodePhase, frozenset[NodePhase]]] = {
    N.REQUESTED: frozenset({N.BOOTING, N.REGISTERED, N.DRAINING}) | _DEAD,
    N.BOOTING: frozenset({N.REGISTERED, N.NOTICED, N.DRAINING}) | _DEAD,
    N.REGISTERED: frozenset({N.RUNNING, N.NOTICED, N.DRAINING}) | _DEAD,
    N.RUNNING: frozenset({N.REGISTERED, N.NOTICED, N.DRAINING}) | _DEAD,
    N.NOTICED: _DEAD,
    N.DRAINING: frozenset({N.NOTICED}) | _DEAD,
    N.GONE: frozenset(),
    N.TERMINATED: frozenset(),
}


class IllegalTransition(AssertionError):
    """A phase change the maps above do not allow: a bug in the decision core."""


def check_job(old: JobPhase, new: JobPhase) -> None:
    if new != old and new not in JOB_TRANSITIONS[old]:
        raise IllegalTransition(f"job {old} -> {new}")


def check_node(old: NodePhase, new: NodePhase) -> None:
    if new != old and new not in NODE_TRANSITIONS[old]:
        raise IllegalTransition(f"node {old} -> {new}")
