"""The wire layer: what orchd, the agent, the providers and the feeds share, and nothing else.

Messages (``wire.messages``), the admin API (``wire.admin``), subjects (``wire.subjects``) and the codec
(``wire.codec``) are re-exported here, so ``import wire`` (often ``import wire as ev``) reaches every
record type and helper. Configuration loading (``wire.config``), logging set-up (``wire.logs``) and
sd_notify (``wire.sdnotify``) are imported from their modules.

Pure data and codecs: no I/O, no clock.
"""

from wire.messages import (
    MAX_MESSAGE_BYTES as MAX_MESSAGE_BYTES,
    SCHEMA_VERSION as SCHEMA_VERSION,
    SUPPORTED_VERSIONS as SUPPORTED_VERSIONS,
    AbandonGenerationCmd as AbandonGenerationCmd,
    AgentCommand as AgentCommand,
    AgentState as AgentState,
    CheckpointCmd as CheckpointCmd,
    CheckpointCommitted as CheckpointCommitted,
    CheckpointPolicy as CheckpointPolicy,
    Cloud as Cloud,
    CommandAck as CommandAck,
    DrainCmd as DrainCmd,
    FailureReason as FailureReason,
    GenerationStarted as GenerationStarted,
    GpuStats as GpuStats,
    Heartbeat as Heartbeat,
    InstanceId as InstanceId,
    JobId as JobId,
    JobSpec as JobSpec,
    LogLine as LogLine,
    Market as Market,
    MarketPolicy as MarketPolicy,
    NodeEvent as NodeEvent,
    NodeId as NodeId,
    NodeLeaving as NodeLeaving,
    NodeRegistered as NodeRegistered,
    NoticeKind as NoticeKind,
    PoolKey as PoolKey,
    PreemptionNotice as PreemptionNotice,
    PricePolicy as PricePolicy,
    PriceTick as PriceTick,
    RanksExited as RanksExited,
    StartGenerationCmd as StartGenerationCmd,
    StopCmd as StopCmd,
    TrainerSpec as TrainerSpec,
)
from wire.admin import (
    ADMIN_ENDPOINTS as ADMIN_ENDPOINTS,
    ADMIN_SERVICE_NAME as ADMIN_SERVICE_NAME,
    ADMIN_SERVICE_VERSION as ADMIN_SERVICE_VERSION,
    AdminErrorBody as AdminErrorBody,
    DrainNodeRequest as DrainNodeRequest,
    EmptyRequest as EmptyRequest,
    EventsReply as EventsReply,
    ExplainReply as ExplainReply,
    JobReply as JobReply,
    JobRequest as JobRequest,
    JobsReply as JobsReply,
    ListJobsRequest as ListJobsRequest,
    ListNodesRequest as ListNodesRequest,
    NodesReply as NodesReply,
    OkReply as OkReply,
    PricesReply as PricesReply,
    ReapReply as ReapReply,
    ReapRequest as ReapRequest,
    StatusReply as StatusReply,
    SubmitJobReply as SubmitJobReply,
    SubmitJobRequest as SubmitJobRequest,
    TailEventsRequest as TailEventsRequest,
)
from wire.codec import (
    WIRE_TYPES as WIRE_TYPES,
    AnyWire as AnyWire,
    WireError as WireError,
    decode as decode,
    encode as encode,
    to_builtins as to_builtins,
)
from wire.subjects import (
    SUBJECT_ADMIN_PREFIX as SUBJECT_ADMIN_PREFIX,
    admin_subject as admin_subject,
    subject_command as subject_command,
    subject_heartbeat as subject_heartbeat,
    subject_logs as subject_logs,
    subject_node_event as subject_node_event,
    subject_notice as subject_notice,
    subject_price as subject_price,
)
