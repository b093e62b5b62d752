"""Commands the decision core emits; the shell executes them and feeds results back as events.

Every command carries an id that is deterministic in the state that produced it (so a daemon that
crashed after persisting the decision re-executes the same command, with the same idempotency token,
instead of a new one).
"""

from __future__ import annotations

from typing import Final, TypeAlias

import msgspec

from wire.messages import AgentCommand, InstanceId, JobId, NodeId, PoolKey


class _Cmd(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    pass


class Launch(_Cmd, frozen=True, kw_only=True, tag="launch"):
    """Create one instance per node id in ``pool``; token = the cloud idempotency token."""

    job_id: JobId
    pool: PoolKey
    node_ids: tuple[NodeId, ...]
    token: str


class Terminate(_Cmd, frozen=True, kw_only=True, tag="terminate"):
    node_id: NodeId
    instance_id: InstanceId | None
    pool: PoolKey | None = None
    reason: str = ""


UNKNOWN_NODE: Final = "unknown_node"
OTHER_LAUNCH_TOKEN: Final = "other_launch_token"
SECOND_INSTANCE: Final = "second_instance"
UNOWNED_REASONS: Final = frozenset({UNKNOWN_NODE, OTHER_LAUNCH_TOKEN, SECOND_INSTANCE})
"""``Terminate.reason`` of an instance the state does not own (decide.py ``_terminate_unowned``)."""


class SendToAgent(_Cmd, frozen=True, kw_only=True, tag="send_to_agent"):
    """Deliver ``command`` to ``orch.cmd.<node>`` and wait for its ack (retries keep cmd_id)."""

    command: AgentCommand


class CheckInstance(_Cmd, frozen=True, kw_only=True, tag="check_instance"):
    """Ask the provider whether a silent node's instance still exists (answer: NodeGone or nothing)."""

    node_id: NodeId
    instance_id: InstanceId
    pool: PoolKey


class CreateTrackingRun(_Cmd, frozen=True, kw_only=True, tag="create_tracking_run"):
    """Create the job's MLflow run (or find the one created before, by its job-id tag); the answer is
    ``TrackingRunCreated``. Retried by the shell until the tracking server answers."""

    job_id: JobId
    uri: str
    experiment: str
    run_name: str


Command: TypeAlias = Launch | Terminate | SendToAgent | CheckInstance | CreateTrackingRun
"""Everything ``decide`` can ask the shell to do (``Decision.commands``)."""
