"""Events the decision core consumes: the wire events plus the shell's own (executor results, timers,
admin intents). Frozen, typed; time is always a parameter of ``decide``, never read here.
"""

from __future__ import annotations

from typing import TypeAlias

import msgspec

from wire.messages import (
    FailureReason,
    InstanceId,
    JobId,
    JobSpec,
    NodeId,
    PoolKey,
    ToOrchd,
)


class _Internal(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    v: int = 1


class Tick(_Internal, frozen=True, kw_only=True, tag="tick"):
    """Timer: lets the core notice heartbeat timeouts, deadlines, budget, checkpoint intervals."""


class JobSubmitted(_Internal, frozen=True, kw_only=True, tag="job_submitted"):
    job_id: JobId
    spec: JobSpec
    # A random secret for the job's shard replicas (spec.checkpoint.replica_every), drawn by the shell.
    replica_secret: str | msgspec.UnsetType = msgspec.UNSET


class JobCancelled(_Internal, frozen=True, kw_only=True, tag="job_cancelled"):
    job_id: JobId
    reason: str = "admin"


class NodeDrainRequested(_Internal, frozen=True, kw_only=True, tag="node_drain_requested"):
    node_id: NodeId
    reason: str = "admin"


class NodeLaunched(_Internal, frozen=True, kw_only=True, tag="node_launched"):
    """Executor result: the cloud accepted the launch of this node (it has an instance id)."""

    node_id: NodeId
    job_id: JobId
    instance_id: InstanceId
    pool: PoolKey
    token: str


class LaunchFailed(_Internal, frozen=True, kw_only=True, tag="launch_failed"):
    """Executor result: these nodes of a launch got no instance (partial fulfilment reports the rest)."""

    node_ids: tuple[NodeId, ...]
    job_id: JobId
    pool: PoolKey
    token: str
    reason: FailureReason
    message: str = ""


class NodeGone(_Internal, frozen=True, kw_only=True, tag="node_gone"):
    """Second signal for a failure: the provider says the instance is gone, or it was terminated."""

    node_id: NodeId
    instance_id: InstanceId | None = None
    reason: str  # provider_terminated | provider_missing | terminated_by_us | agent_disconnected


class AgentDisconnected(_Internal, frozen=True, kw_only=True, tag="agent_disconnected"):
    """The agent's NATS connection closed (server advisory) - a second signal, like NodeGone."""

    node_id: NodeId


class CommandFailed(_Internal, frozen=True, kw_only=True, tag="command_failed"):
    """A command to an agent got no ack after all retries."""

    node_id: NodeId
    cmd_id: str
    kind: str


class BusState(_Internal, frozen=True, kw_only=True, tag="bus_state"):
    """The daemon's own NATS connection went down/up: failure detection pauses while down and for one
    heartbeat timeout after reconnecting, so an outage never looks like node failures."""

    connected: bool


class LeaseChanged(_Internal, frozen=True, kw_only=True, tag="lease_changed"):
    """This daemon holds the leader lease at ``revision`` (the fencing token every command carries);
    ``cluster_id``: the deployment's identity as the shell resolved it (recorded in the meta record when it
    holds none; one already recorded is kept)."""

    revision: int
    cluster_id: str = ""


class TrackingRunCreated(_Internal, frozen=True, kw_only=True, tag="tracking_run_created"):
    """Executor result: the MLflow run of a tracked job exists (``CreateTrackingRun``)."""

    job_id: JobId
    run_id: str


CoreEvent: TypeAlias = (
    LeaseChanged
    | Tick
    | JobSubmitted
    | JobCancelled
    | NodeDrainRequested
    | NodeLaunched
    | LaunchFailed
    | NodeGone
    | AgentDisconnected
    | CommandFailed
    | BusState
    | TrackingRunCreated
    | ToOrchd
)
"""Every event ``decide`` accepts: the wire events plus the shell's own (above)."""
