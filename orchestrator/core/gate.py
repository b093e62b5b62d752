"""``authorize(state, event, now) -> reason | None``: the trust gate in front of ``decide``.

Role: every event an agent publishes is checked against its sender's identity and the state before the
core sees it. The sender is the node the event names: the shell's screen (``admit.screen``) already
requires the subject to name that node, and per-node NATS permissions restrict what a node may publish
on, so ``event.node_id`` *is* the publisher. What a node may say:

- it exists in the state: orchd launched it (its record exists)                   -> ``unknown_node``
  (a registration from an unknown node passes when its instance is nobody's: the core terminates
  that orphan; naming another node's instance is ``wrong_instance``)
- the job it names is its own job (``event.job_id == node.job_id``)               -> ``wrong_job``
- the generation it names is its current one (``node.generation``): an older one   -> ``stale_generation``
  (the core ignores a RanksExited / GenerationStarted of an old generation anyway; a commit of an old
  generation only arrives after that generation was abandoned, and resuming from the last commit of
  the current generation is the safe choice), a newer one                          -> ``bad_generation``
- the instance id it names is not another node's instance (NodeLaunched sets a node's instance id;
  the core never adopts an agent's)                                                -> ``wrong_instance``
- a committed checkpoint lies strictly under its job's own root
  (``job.spec.checkpoint.url``): same scheme, the root's path as a prefix, then only plain path
  segments (no ``..``/``.``, no query, escapes or backslashes)                     -> ``foreign_checkpoint``
- steps are possible: a commit in 1..total_steps, a heartbeat's / an exit's step <= total_steps
                                                                                   -> ``bad_step``

Heartbeats are legitimate in any generation (between generations an agent reports its last one): only
node, job and step are checked (two map lookups: the hot path). Heartbeats of a job the node does not
belong to, or of an unknown node, are refused like any other event.

Trusted senders (no check, ``None``): everything orchd produces itself - executor results
(NodeLaunched, LaunchFailed, NodeGone, CommandFailed), admin intents (JobSubmitted, JobCancelled,
NodeDrainRequested), timers and connection state (Tick, BusState, LeaseChanged, AgentDisconnected) -
and price ticks, which come from orchd's own feeds (``screen`` ties their subject to the pool).

Pure: no I/O, no clock (``now`` is unused today; it is part of the signature so that time-based rules,
e.g. a rate per sender, stay pure), no logging.
"""

from __future__ import annotations

from typing import Final

from orchestrator.core.inputs import CoreEvent
from orchestrator.core.model import Job, Node
from orchestrator.core.roots import under_root
from orchestrator.core.state import State
from wire.messages import (
    CheckpointCommitted,
    CommandAck,
    GenerationStarted,
    Heartbeat,
    NodeLeaving,
    NodeRegistered,
    PreemptionNotice,
    RanksExited,
)

UNKNOWN_NODE: Final = "unknown_node"
WRONG_JOB: Final = "wrong_job"
STALE_GENERATION: Final = "stale_generation"
BAD_GENERATION: Final = "bad_generation"
WRONG_INSTANCE: Final = "wrong_instance"
FOREIGN_CHECKPOINT: Final = "foreign_checkpoint"
BAD_STEP: Final = "bad_step"

REASONS: Final = (UNKNOWN_NODE, WRONG_JOB, STALE_GENERATION, BAD_GENERATION, WRONG_INSTANCE,
                  FOREIGN_CHECKPOINT, BAD_STEP)

# Characters of a path segment an agent may add below its job's checkpoint root.


def authorize(state: State, event: CoreEvent, now: float) -> str | None:
    """Why ``event`` must not reach the core (a short label, see the module docstring), or None."""
    if type(event) is Heartbeat:  # the hot path: two map lookups
        node = state.nodes.get(event.node_id)
        return heartbeat_refusal(event, node, None if node is None else state.jobs.get(node.job_id))
    if isinstance(event, CheckpointCommitted | RanksExited | GenerationStarted):
        return _generation_event(state, event)
    if isinstance(event, NodeRegistered):
        return _registered(state, event)
    if isinstance(event, PreemptionNotice | NodeLeaving | CommandAck):
        return None if event.node_id in state.nodes else UNKNOWN_NODE
    return None  # orchd's own events and price ticks: trusted senders


def heartbeat_refusal(hb: Heartbeat, node: Node | None, job: Job | None) -> str | None:
    """The rule for a heartbeat, given its node's record and that node's job (looked up by the caller:
    ``authorize``, and ``decide.fold_heartbeats`` which needs them too)."""
    if node is None:
        return UNKNOWN_NODE
    if hb.job_id is not None and hb.job_id != node.job_id:
        return WRONG_JOB
    if hb.step > node.step and job is not None and hb.step > job.spec.total_steps:
        return BAD_STEP  # progress: bounded by the job's total
    return None


def _registered(state: State, ev: NodeRegistered) -> str | None:
    """A registration may name an instance orchd knows for no other node. An unknown node, or a known
    node with a second instance, passes when its instance is nobody's: the core then terminates that
    unowned instance (a launch that left an orphan; the provider terminates only this cluster's
    instances). Naming another node's instance is refused, whoever sends it."""
    node = state.nodes.get(ev.node_id)
    if not ev.instance_id:
        return None if node is not None else UNKNOWN_NODE
    if node is not None and node.instance_id == ev.instance_id:
        return None
    if any(n.instance_id == ev.instance_id for n in state.nodes.values()):
        return WRONG_INSTANCE  # another node's instance: never terminate it on a node's word
    return None


def _generation_event(state: State, ev: CheckpointCommitted | RanksExited | GenerationStarted) -> str | None:
    node = state.nodes.get(ev.node_id)
    if node is None:
        return UNKNOWN_NODE
    if ev.job_id != node.job_id:
        return WRONG_JOB
    if ev.generation != node.generation:
        return STALE_GENERATION if ev.generation < node.generation else BAD_GENERATION
    job = state.jobs.get(node.job_id)
    if job is None:
        return None  # the job is gone: the core ignores the event
    if isinstance(ev, CheckpointCommitted):
        return _commit(job, ev)
    if isinstance(ev, RanksExited) and ev.last_step > job.spec.total_steps:
        return BAD_STEP
    return None


def _commit(job: Job, ev: CheckpointCommitted) -> str | None:
    if not 0 < ev.step <= job.spec.total_steps:
        return BAD_STEP
    if not under_root(ev.url, job.spec.checkpoint.url):
        return FOREIGN_CHECKPOINT
    return None
