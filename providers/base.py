"""The `CloudProvider` protocol and its typed errors.

Role: the boundary between orchd and a cloud. Implementations convert SDK objects and SDK errors into
the records and errors here at the edge; nothing SDK-shaped crosses into the daemon.

Concurrency contract: every method is synchronous and may block (SDK calls). The executor calls them
from worker threads with a per-cloud concurrency limit; implementations must be thread-safe.

Idempotency contract: ``launch`` with an ``idempotency_token`` already used returns the instances of
the first call instead of creating new ones (EC2 ClientToken, GCP requestId, Azure deterministic names,
or a describe-by-token-tag before launching where the cloud does not enforce it).

Ownership contract: ``terminate(ids, cluster_id)`` describes the ids first and terminates only the
instances carrying ``TAG_CLUSTER == cluster_id`` (exact value). Any other existing, not yet terminated
instance (no cluster tag, another cluster's tag) is refused: left alone, logged (``terminate_refused``),
and reported by raising ``ForeignInstanceError`` after the cluster's own instances were terminated. A
confused or hostile state can then never hit another workload in the same account. Ids the cloud does
not know (or knows only as terminated) stay a no-op, so a retried terminate is idempotent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from typing import Protocol, runtime_checkable

import msgspec

from wire import FailureReason, InstanceId, NodeId, PoolKey

# Tag keys every provider puts on the instances it creates (labels on GCP: lowercase, no dots).
TAG_CLUSTER = "orch-cluster"  # the deployment's cluster id: the reaper only ever touches these
TAG_JOB = "orch-job"
TAG_NODE = "orch-node"
TAG_TOKEN = "orch-token"  # the idempotency token of the launch that created it


class InstanceState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    STOPPING = "stopping"
    TERMINATED = "terminated"


class Instance(msgspec.Struct, frozen=True, kw_only=True):
    instance_id: InstanceId
    node_id: NodeId | None
    pool: PoolKey
    state: InstanceState
    tags: dict[str, str] = {}
    launched_ts: float | None = None
    private_ip: str | None = None

    @property
    def alive(self) -> bool:
        return self.state in (InstanceState.PENDING, InstanceState.RUNNING)


class NodeBootstrap(msgspec.Struct, frozen=True, kw_only=True):
    """What a new node needs to start its agent. The credential is per node and scoped to its subjects."""

    nats_urls: tuple[str, ...]
    credential: str = ""  # creds file content / token; never logged
    # Per-node short-lived enrolment tokens (providers/bootstrap.py), keyed by node id; preferred over
    # ``credential`` when present. Never logged.
    node_credentials: dict[str, str] = {}
    agent_args: tuple[str, ...] = ()
    agent_package: str = "spot-orchestrator[trainer]"


class LaunchRequest(msgspec.Struct, frozen=True, kw_only=True):
    pool: PoolKey
    node_ids: tuple[NodeId, ...]  # one instance per node id; len() is the count
    idempotency_token: str
    cluster_id: str
    job_id: str
    tags: dict[str, str] = {}
    bootstrap: NodeBootstrap | None = None

    @property
    def count(self) -> int:
        return len(self.node_ids)

    def instance_tags(self, node_id: str) -> dict[str, str]:
        return {
            **self.tags,
            TAG_CLUSTER: self.cluster_id,
            TAG_JOB: self.job_id,
            TAG_NODE: node_id,
            TAG_TOKEN: self.idempotency_token,
        }


class LaunchResult(msgspec.Struct, frozen=True, kw_only=True):
    """Partial fulfilment is normal: some instances, and a typed reason for the rest."""

    instances: tuple[Instance, ...]
    missing: int = 0
    failure: FailureReason | None = None
    message: str = ""


class PriceQuote(msgspec.Struct, frozen=True, kw_only=True):
    pool: PoolKey
    gpu_type: str
    gpus_per_node: int
    price_usd_h: float
    on_demand_usd_h: float | None = None
    capacity_hint: float | None = None
    ts: float


def launch_each(
    request: LaunchRequest,
    launch_one: Callable[[NodeId], Instance],
    already: Mapping[NodeId, Instance] | None = None,
) -> LaunchResult:
    """Launch one instance per node id in order, stopping at the first error: capacity, quota and auth
    will not change for the next node of the same pool now. Nodes in ``already`` (found by the
    idempotency token) are returned without a call. No instance at all -> the error is raised;
    some -> a partial LaunchResult carrying the error's typed reason."""
    already = already or {}
    got = [already[n] for n in request.node_ids if n in already]
    failure: ProviderError | None = None
    for node_id in request.node_ids:
        if node_id in already:
            continue
        try:
            got.append(launch_one(node_id))
        except ProviderError as e:
            failure = e
            break
    missing = request.count - len(got)
    if failure is not None and not got:
        raise failure
    short = failure if missing > 0 else None  # the error that left nodes without an instance
    return LaunchResult(
        instances=tuple(got),
        missing=missing,
        failure=short.reason if short is not None else None,
        message=str(short) if short is not None else "",
    )


class ProviderError(Exception):
    """Base of the typed provider errors. ``retryable``: retrying the same call later may succeed."""

    reason: FailureReason = FailureReason.UNKNOWN
    retryable: bool = False

    def __init__(self, message: str, *, pool: PoolKey | None = None) -> None:
        super().__init__(message)
        self.pool = pool


class CapacityError(ProviderError):
    """No capacity in this pool now: try another pool; retry this one later."""

    reason = FailureReason.CAPACITY
    retryable = True


class QuotaError(ProviderError):
    """Account/region quota exhausted: do not retry in this region until quota changes."""

    reason = FailureReason.QUOTA
    retryable = False


class AuthError(ProviderError):
    """Credentials missing or refused: an operator must act."""

    reason = FailureReason.AUTH
    retryable = False


class TransientError(ProviderError):
    """Throttling, 5xx, timeouts: retry the same call with backoff (same idempotency token)."""

    reason = FailureReason.TRANSIENT
    retryable = True


class NotFound(ProviderError):
    reason = FailureReason.NOT_FOUND
    retryable = False


class ForeignInstanceError(ProviderError):
    """``terminate`` was asked for instances that do not carry this cluster's tag: they were left alone.

    Raised after the cluster's own instances in the same call were terminated. Not retryable: the
    state that asked for them is wrong, and an operator must look (``instance_ids`` are the refused)."""

    reason = FailureReason.NOT_FOUND  # no instance of this cluster has these ids
    retryable = False

    def __init__(self, instance_ids: Sequence[InstanceId], cluster_id: str, *, cloud: str = "") -> None:
        self.instance_ids = tuple(instance_ids)
        self.cluster_id = cluster_id
        super().__init__(f"refused to terminate {list(self.instance_ids)} on {cloud or 'the cloud'}: "
                         f"not tagged {TAG_CLUSTER}={cluster_id!r}")


def check_owned(cloud: str, cluster_id: str, described: Sequence[Instance],
                log: Callable[..., object]) -> tuple[list[InstanceId], list[InstanceId]]:
    """Split described instances into (ours to terminate, refused). Terminated ones are in neither.

    ``log`` is the provider's structlog ``warning``: each refusal is logged as ``terminate_refused``."""
    ours: list[InstanceId] = []
    refused: list[InstanceId] = []
    for inst in described:
        if inst.state is InstanceState.TERMINATED:
            continue
        if cluster_id and inst.tags.get(TAG_CLUSTER) == cluster_id:
            ours.append(inst.instance_id)
        else:
            refused.append(inst.instance_id)
            log("terminate_refused", cloud=cloud, instance=inst.instance_id, cluster=cluster_id,
                instance_cluster=inst.tags.get(TAG_CLUSTER))
    return ours, refused


def raise_refused(cloud: str, cluster_id: str, refused: Sequence[InstanceId]) -> None:
    """Report refusals (after the rest were terminated): ``ForeignInstanceError`` when there are any."""
    if refused:
        raise ForeignInstanceError(refused, cluster_id, cloud=cloud)


@runtime_checkable
class CloudProvider(Protocol):
    """One cloud (or the local machine). See the module docstring for the contracts."""

    cloud: str

    def launch(self, request: LaunchRequest) -> LaunchResult: ...

    def terminate(self, instance_ids: Sequence[InstanceId], cluster_id: str) -> None:
        """Terminate those of these instances that carry ``TAG_CLUSTER == cluster_id``; unknown or already
        terminated ids are not an error. Existing instances without that tag are not touched: logged
        (``terminate_refused``) and raised as ``ForeignInstanceError`` after the others were terminated."""
        ...

    def list_instances(self, cluster_id: str) -> list[Instance]:
        """Every non-terminated instance carrying this deployment's cluster id tag."""
        ...

    def describe(self, instance_ids: Sequence[InstanceId]) -> list[Instance]:
        """Current state of these instances; ids the cloud no longer knows are absent."""
        ...

    def prices(self, pools: Sequence[PoolKey] | None = None) -> list[PriceQuote]:
        """Current spot/on-demand prices for the provider's configured pools (or these pools)."""
        ...
