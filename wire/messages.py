"""Typed, frozen, versioned records for every message between agents, feeds and orchd.

Role: the one place where the shape of a message is defined. The daemon, the agent, the simulator and
the benchmarks all encode and decode them through ``wire.codec``; raw dicts never cross into the core.
Every wire record carries ``v`` (schema version) and most carry ``id`` (a message id used for
JetStream de-duplication and for idempotent replay). Subjects: ``wire.subjects``; admin requests and
replies: ``wire.admin``.

Pure data: no I/O, no clock. The decision core may import it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final, NewType, TypeAlias

import msgspec

SCHEMA_VERSION: Final = 1
SUPPORTED_VERSIONS: Final = frozenset({1})
MAX_MESSAGE_BYTES: Final = 256 * 1024

NodeId = NewType("NodeId", str)
JobId = NewType("JobId", str)
InstanceId = NewType("InstanceId", str)


class Cloud(StrEnum):
    AWS = "aws"
    GCP = "gcp"
    AZURE = "azure"
    LOCAL = "local"
    FAKE = "fake"


class Market(StrEnum):
    SPOT = "spot"
    ON_DEMAND = "on_demand"


class MarketPolicy(StrEnum):
    SPOT = "spot"  # spot only; wait when none is available
    ON_DEMAND = "on_demand"  # never spot
    SPOT_WITH_FALLBACK = "spot_with_fallback"  # spot, on-demand when the deadline needs it


class NoticeKind(StrEnum):
    TERMINATE = "terminate"  # the instance will be reclaimed at deadline_ts (AWS/GCP/Azure preempt)
    REBALANCE = "rebalance"  # AWS rebalance recommendation: elevated risk, no deadline


class AgentState(StrEnum):
    IDLE = "idle"
    STARTING = "starting"
    TRAINING = "training"
    CHECKPOINTING = "checkpointing"
    DRAINING = "draining"
    STOPPED = "stopped"


class FailureReason(StrEnum):
    CAPACITY = "capacity"
    QUOTA = "quota"
    AUTH = "auth"
    TRANSIENT = "transient"
    NOT_FOUND = "not_found"
    UNKNOWN = "unknown"


class _Wire(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", forbid_unknown_fields=False):
    """Base of every wire record: schema version first."""

    v: int = SCHEMA_VERSION


# ---------------------------------------------------------------------------------------------------
# Pools and prices


class PoolKey(msgspec.Struct, frozen=True, kw_only=True, order=True):
    """One capacity pool: the unit a price, a preemption rate and a launch refer to."""

    cloud: str
    region: str
    zone: str
    instance_type: str
    market: Market

    @property
    def name(self) -> str:
        return f"{self.cloud}/{self.region}/{self.zone}/{self.instance_type}/{self.market}"

    @property
    def zone_key(self) -> tuple[str, str, str]:
        return (self.cloud, self.region, self.zone)


class PriceTick(_Wire, frozen=True, kw_only=True, tag="price_tick"):
    """The price of one pool at one time (spot or on-demand), from a feed or an external publisher."""

    id: str
    pool: PoolKey
    gpu_type: str
    gpus_per_node: int
    price_usd_h: float
    on_demand_usd_h: float | None = None
    capacity_hint: float | None = None  # 0..1 where the cloud gives one (AWS placement score / 10)
    ts: float


# ---------------------------------------------------------------------------------------------------
# From agents


class PreemptionNotice(_Wire, frozen=True, kw_only=True, tag="preemption_notice"):
    id: str
    node_id: NodeId
    cloud: str
    kind: NoticeKind = NoticeKind.TERMINATE
    deadline_ts: float | None  # when the instance dies (None for a rebalance recommendation)
    observed_ts: float  # when the agent saw it (its clock)
    source: str = "metadata"  # metadata | cloud_event | injected


class GpuStats(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    util_pct: float
    mem_used_mib: float
    mem_total_mib: float
    temp_c: float | None = None
    power_w: float | None = None


class Heartbeat(_Wire, frozen=True, kw_only=True, tag="heartbeat"):
    node_id: NodeId
    seq: int
    ts: float
    state: AgentState
    job_id: JobId | None = None
    generation: int = 0
    step: int = 0
    loss: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    cpu_pct: float | None = None
    mem_pct: float | None = None
    gpus: tuple[GpuStats, ...] = ()
    fencing_token: int = 0  # highest fencing token the agent has seen


class NodeRegistered(_Wire, frozen=True, kw_only=True, tag="node_registered"):
    id: str
    node_id: NodeId
    instance_id: InstanceId | None = None
    pool: PoolKey | None = None
    agent_version: str = ""
    host: str = ""
    ts: float


class GenerationStarted(_Wire, frozen=True, kw_only=True, tag="generation_started"):
    id: str
    node_id: NodeId
    job_id: JobId
    generation: int
    first_step: int  # the step the ranks will execute first (resume step + 1, or 1)
    ts: float


class CheckpointCommitted(_Wire, frozen=True, kw_only=True, tag="checkpoint_committed"):
    id: str
    node_id: NodeId
    job_id: JobId
    generation: int
    step: int
    checkpoint_id: str
    url: str
    save_s: float
    deadline_margin_s: float | None = None  # deadline - commit time, for emergency checkpoints
    emergency: bool = False
    ts: float


class ReplicaHeld(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One complete shard replica a node's holder has in memory: rank ``rank``'s state after ``step``, made
    by a generation of ``world_size`` ranks (trainer.replicas)."""

    rank: int
    step: int
    world_size: int


MAX_REPLICAS_REPORTED: Final = 4096
"""At most this many ReplicaHeld in one RanksExited (the screen refuses more)."""
MAX_EXIT_DETAIL: Final = 300
"""At most this many characters in RanksExited.detail (the screen refuses more)."""


class RanksExited(_Wire, frozen=True, kw_only=True, tag="ranks_exited"):
    id: str
    node_id: NodeId
    job_id: JobId
    generation: int
    exit_code: int
    reason: str  # completed|emergency_checkpoint|failed|abandoned|stopped|storage_error|no_usable_checkpoint
    last_step: int = 0
    ts: float
    # The loss of last_step (the ranks' mean), when the trainer reported one. Unset is not encoded, so
    # agents and records from before this field keep their bytes.
    last_loss: float | None | msgspec.UnsetType = msgspec.UNSET
    # The complete replicas this node's holder keeps (a job with replicas): the facts of orchd's choice
    # between a replica step and the durable checkpoint (orchestrator/core/replicas.py). Unset is not encoded.
    replicas: tuple[ReplicaHeld, ...] | msgspec.UnsetType = msgspec.UNSET
    # Why, for a ``replica_unusable`` exit: a rank's reason (at most MAX_EXIT_DETAIL characters: which
    # replica, from which holder, what failed), for orchd's audit. Unset is not encoded.
    detail: str | msgspec.UnsetType = msgspec.UNSET
    # A job with replicas: the most steps a loss during this generation would have sent back on this node's
    # ranks (the largest StepReport.replica_lag: k + 1 when each copy kept up, more when copies were
    # skipped). orchd's bound on the work at risk (orchestrator/core/replicas.py). Unset is not encoded.
    replica_lag_max: int | msgspec.UnsetType = msgspec.UNSET


class NodeLeaving(_Wire, frozen=True, kw_only=True, tag="node_leaving"):
    """The agent is shutting down (SIGTERM, drain finished)."""

    id: str
    node_id: NodeId
    reason: str
    ts: float


NodeEvent: TypeAlias = NodeRegistered | GenerationStarted | CheckpointCommitted | RanksExited | NodeLeaving


class LogLine(_Wire, frozen=True, kw_only=True, tag="log_line"):
    """One line of a trainer rank's output (not a report line), shipped by the agent.

    Subject ``orch.logs.<job>.<node>`` (JetStream stream ORCH_LOGS, created by orchd at start-up)."""

    job_id: JobId
    node_id: NodeId
    generation: int
    rank: int
    stream: str = "stdout"  # stdout | stderr
    seq: int  # per agent process, increasing
    line: str
    ts: float


# ---------------------------------------------------------------------------------------------------
# Commands to agents (orch.cmd.<node>). Every command carries the leader's fencing token.


class TrainerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What to run on each node. Empty ``command`` means the built-in GPT trainer."""

    command: tuple[str, ...] = ()
    args: dict[str, str | int | float | bool] = {}
    env: dict[str, str] = {}


class _Command(_Wire, frozen=True, kw_only=True):
    cmd_id: str
    fencing_token: int
    node_id: NodeId
    job_id: JobId | None = None
    generation: int = 0
    issued_ts: float


class CheckpointCmd(_Command, frozen=True, kw_only=True, tag="checkpoint"):
    """Checkpoint at a step all ranks agree on, commit, and end this generation (exit the ranks).

    Periodic checkpoints are the trainer's own (every ``checkpoint_interval_s``); this command is the
    emergency / resize / pause path."""

    reason: str  # preemption_notice | periodic | price_pause | budget | migrate | drain
    deadline_ts: float | None = None


class StartGenerationCmd(_Command, frozen=True, kw_only=True, tag="start_generation"):
    node_rank: int  # index of this node in the generation
    nnodes: int
    gpus_per_node: int
    world_size: int
    master_addr: str
    master_port: int
    resume_from: str | None  # URL of the committed checkpoint, None for a fresh start
    checkpoint_url: str  # where to write checkpoints
    total_steps: int
    checkpoint_interval_s: float | None = None  # periodic checkpoint interval chosen by orchd (Young/Daly)
    trainer: TrainerSpec = TrainerSpec()
    cluster_id: str = ""  # orchd's cluster identity, named in the checkpoint root's owner marker; "": the agent's own
    # Shard replicas (a job with [checkpoint] replica_every; trainer.replicas): the job's secret (the agent's
    # holder keeps it, the ranks get a key of this generation only), every how many steps, and the replicated
    # step to resume from (orchd's choice; unset: resume_from). Unset is not encoded.
    replica_secret: str | msgspec.UnsetType = msgspec.UNSET
    replica_every: int | msgspec.UnsetType = msgspec.UNSET
    replica_step: int | msgspec.UnsetType = msgspec.UNSET
    # Where the trainer may load Hugging Face models, tokenizers and datasets from: orchd's [trainer] model_schemes,
    # set by orchd's executor on every start it sends (never from the job); the agent passes it to the ranks as
    # ORCH_MODEL_SCHEMES. Unset (a start stored or sent by an older orchd): the trainer's default, every scheme.
    model_schemes: tuple[str, ...] | msgspec.UnsetType = msgspec.UNSET
    # The node (its node_rank) whose holder keeps this node's ranks' second copies: in another zone when the
    # job spans zones (orchestrator/core/replicas.py ``buddies``); unset: the next node around the ring.
    replica_buddy: int | msgspec.UnsetType = msgspec.UNSET


class StopCmd(_Command, frozen=True, kw_only=True, tag="stop"):
    reason: str
    checkpoint_first: bool = True


class AbandonGenerationCmd(_Command, frozen=True, kw_only=True, tag="abandon_generation"):
    reason: str


class DrainCmd(_Command, frozen=True, kw_only=True, tag="drain"):
    reason: str = "admin"


AgentCommand: TypeAlias = CheckpointCmd | StartGenerationCmd | StopCmd | AbandonGenerationCmd | DrainCmd


class CommandAck(_Wire, frozen=True, kw_only=True, tag="command_ack"):
    cmd_id: str
    node_id: NodeId
    ok: bool
    error: str | None = None  # e.g. "stale_fencing_token", "unknown_generation"
    ts: float


ToOrchd: TypeAlias = PriceTick | PreemptionNotice | Heartbeat | NodeEvent | CommandAck
"""Every record orchd receives (from agents and price feeds): what reaches the core from the wire."""


# ---------------------------------------------------------------------------------------------------
# Job specs (validated by orchestrator.jobspec; carried in admin submit and in state)


class CheckpointPolicy(msgspec.Struct, frozen=True, kw_only=True):
    url: str
    interval_s: float | None = None  # None: derived from the pool's preemption rate (Young/Daly)
    keep: int = 3
    save_s_estimate: float = 30.0  # until measured by a commit
    # Unset is not encoded, so records and specs written before this field keep their bytes.
    start_from: str | None | msgspec.UnsetType = msgspec.UNSET  # committed checkpoint to resume from; writes go to url
    # Shard replicas in peers' host memory every this many steps (trainer.replicas); unset or 0: off.
    replica_every: int | msgspec.UnsetType = msgspec.UNSET


class PricePolicy(msgspec.Struct, frozen=True, kw_only=True):
    pause_above_ratio: float = 0.95  # spot/on-demand price above which a spot job pauses
    resume_below_ratio: float = 0.85  # hysteresis: resume only below this
    migrate_min_saving: float = 0.2  # migrate when a pool is cheaper by this fraction after migration cost


class TrackingSpec(msgspec.Struct, frozen=True, kw_only=True):
    """``[tracking]``: the MLflow run of a job (docs/tracking.md). Never credentials: orchd and the agents
    take those from their own environment (MLFLOW_TRACKING_USERNAME/PASSWORD/TOKEN). The server is one
    orchd's config lists (``[tracking.servers]``), by name or its default: orchd sets ``uri`` from it at
    submit; a spec's own ``uri`` is accepted only when it is a listed server's."""

    uri: str = ""  # MLflow tracking URI (http://, https://), of the server named (set by orchd at submit)
    experiment: str  # experiment name; created by orchd when missing
    run_name: str = ""  # "" = the job's name
    server: str | msgspec.UnsetType = msgspec.UNSET  # a tracking server of orchd's config; unset: its default


class JobSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    trainer: TrainerSpec = TrainerSpec()
    total_steps: int
    step_time_s_estimate: float = 1.0  # until measured from heartbeats
    gpu_type: str
    gpus_per_node: int = 1
    nodes: int = 1  # target
    nodes_min: int = 1
    nodes_max: int = 1
    clouds: tuple[str, ...] = ()  # empty = any
    regions: tuple[str, ...] = ()
    zones: tuple[str, ...] = ()
    instance_types: tuple[str, ...] = ()
    market: MarketPolicy = MarketPolicy.SPOT_WITH_FALLBACK
    deadline_ts: float | None = None
    budget_usd: float | None = None
    checkpoint: CheckpointPolicy
    price: PricePolicy = PricePolicy()
    # Unset is not encoded, so specs and records written before this field keep their bytes.
    tracking: TrackingSpec | msgspec.UnsetType = msgspec.UNSET
    # The sweep this job is a trial of (docs/sweeps.md); the core only carries it. Unset is not encoded,
    # so specs and records written before this field keep their bytes.
    sweep_id: str | msgspec.UnsetType = msgspec.UNSET
    # The sweep's total budget and deadline (set by the sweep controller on each trial): orchd sums the cost
    # of every job with this sweep_id and stops the sweep's trials at either (core/sweeps.py); the smallest
    # value any job of the sweep carries is the sweep's. Unset is not encoded (older specs keep their bytes).
    sweep_budget_usd: float | msgspec.UnsetType = msgspec.UNSET
    sweep_deadline_ts: float | msgspec.UnsetType = msgspec.UNSET
    # Accept a deadline that even on-demand cannot meet (run as fast as possible, the deadline missed);
    # without it such a job is refused at submit. Unset is not encoded (older specs keep their bytes).
    best_effort: bool | msgspec.UnsetType = msgspec.UNSET
