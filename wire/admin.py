"""The admin service's requests and replies (nats.micro service "orchd", subjects
``orch.admin.v1.<resource>.<verb>``; see docs/admin.md).

Requests and replies are JSON objects with ``v``. Errors come back as the micro error headers
(Nats-Service-Error-Code: 400 bad request, 404 unknown job/node, 409 conflict, 500 internal) with an
AdminErrorBody payload. Job/node/pool documents inside replies are the core's records as JSON
objects (their fields are documented in docs/admin.md), typed at this level as dicts.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from wire.messages import SCHEMA_VERSION, JobSpec

ADMIN_SERVICE_NAME: Final = "orchd"
ADMIN_SERVICE_VERSION: Final = "1.0.0"


class _Admin(msgspec.Struct, frozen=True, kw_only=True):
    v: int = SCHEMA_VERSION


class EmptyRequest(_Admin, frozen=True, kw_only=True):
    pass


class SubmitJobRequest(_Admin, frozen=True, kw_only=True):
    spec: JobSpec
    job_id: str | None = None  # chosen by orchd when absent; giving one makes the submit idempotent


class SubmitJobReply(_Admin, frozen=True, kw_only=True):
    job_id: str
    created: bool  # False: a job with this id already existed (idempotent resubmit)


class JobRequest(_Admin, frozen=True, kw_only=True):
    """jobs.show / jobs.cancel / jobs.explain."""

    job_id: str
    reason: str = "admin"  # cancel only
    limit: int = 200  # explain only: the newest entries


class ListJobsRequest(_Admin, frozen=True, kw_only=True):
    include_finished: bool = True


class ListNodesRequest(_Admin, frozen=True, kw_only=True):
    job_id: str | None = None


class DrainNodeRequest(_Admin, frozen=True, kw_only=True):
    node_id: str
    reason: str = "admin"


MAX_NOTICE_S = 3600.0
"""The longest notice ``nodes.preempt`` injects (orchd refuses more; orchctl says so before sending)."""


class PreemptNodeRequest(_Admin, frozen=True, kw_only=True):
    """nodes.preempt: a spot reclaim injected into a local node (local provider only): its metadata
    service announces termination ``notice_s`` from now and the node is killed at that deadline."""

    node_id: str
    notice_s: float = 30.0  # 0 .. 3600 (MAX_NOTICE_S)


class KillNodeRequest(_Admin, frozen=True, kw_only=True):
    """nodes.kill: a host failure injected into a local node (local provider only): every process of
    the node is killed now, with no notice."""

    node_id: str


class TailEventsRequest(_Admin, frozen=True, kw_only=True):
    after_seq: int = 0  # only entries with seq > after_seq (for --watch)
    limit: int = 100


class ReapRequest(_Admin, frozen=True, kw_only=True):
    dry_run: bool = True


class StatusReply(_Admin, frozen=True, kw_only=True):
    version: str
    pid: int
    started_ts: float
    uptime_s: float
    nats_url: str
    nats_connected: bool
    metrics_url: str
    fencing_token: int
    events_decided: int
    batches: int
    commands_in_flight: int
    providers: list[str]
    jobs: dict[str, int]  # by phase
    nodes: dict[str, int]  # by phase
    pools: int
    cluster_id: str = ""  # this deployment's identity (instance tags, MLflow runs, checkpoint roots)


class JobsReply(_Admin, frozen=True, kw_only=True):
    jobs: list[dict[str, Any]]


class JobReply(_Admin, frozen=True, kw_only=True):
    summary: dict[str, Any]
    job: dict[str, Any]  # the core's full job record
    nodes: list[dict[str, Any]]


class NodesReply(_Admin, frozen=True, kw_only=True):
    nodes: list[dict[str, Any]]


class OkReply(_Admin, frozen=True, kw_only=True):
    ok: bool = True
    message: str = ""


class PricesReply(_Admin, frozen=True, kw_only=True):
    pools: list[dict[str, Any]]


class EventsReply(_Admin, frozen=True, kw_only=True):
    events: list[dict[str, Any]]  # decided commands: seq, ts, event, job, node, command, ...
    last_seq: int


class ExplainReply(_Admin, frozen=True, kw_only=True):
    job_id: str
    entries: list[dict[str, Any]]  # the core's AuditEntry records, oldest first


class ReapReply(_Admin, frozen=True, kw_only=True):
    report: dict[str, Any]  # providers.reaper.ReapReport.to_dict()


class DeadListRequest(_Admin, frozen=True, kw_only=True):
    limit: int = 100  # the newest parked messages


class DeadLetter(_Admin, frozen=True, kw_only=True):
    """A JetStream message orchd gave up on, parked in the ``ORCH_DEAD`` stream."""

    seq: int  # its sequence in ORCH_DEAD (``dead.replay``)
    ts: float  # when it was parked
    subject: str  # the subject it arrived on
    reason: str  # why: core_error, max_deliveries, ...
    deliveries: int  # how often it had been delivered to orchd
    size: int  # bytes of its payload
    preview: str  # the start of its payload, as text (invalid UTF-8 replaced)


class DeadListReply(_Admin, frozen=True, kw_only=True):
    messages: list[DeadLetter]  # oldest first


class DeadReplayRequest(_Admin, frozen=True, kw_only=True):
    seq: int  # the sequence of the parked message in ORCH_DEAD


class AdminErrorBody(_Admin, frozen=True, kw_only=True):
    code: int
    message: str


ADMIN_ENDPOINTS: Final[dict[tuple[str, str], tuple[type[_Admin], type[_Admin]]]] = {
    ("status", "get"): (EmptyRequest, StatusReply),
    ("jobs", "submit"): (SubmitJobRequest, SubmitJobReply),
    ("jobs", "list"): (ListJobsRequest, JobsReply),
    ("jobs", "show"): (JobRequest, JobReply),
    ("jobs", "cancel"): (JobRequest, OkReply),
    ("jobs", "explain"): (JobRequest, ExplainReply),
    ("nodes", "list"): (ListNodesRequest, NodesReply),
    ("nodes", "drain"): (DrainNodeRequest, OkReply),
    ("nodes", "preempt"): (PreemptNodeRequest, OkReply),
    ("nodes", "kill"): (KillNodeRequest, OkReply),
    ("prices", "list"): (EmptyRequest, PricesReply),
    ("events", "tail"): (TailEventsRequest, EventsReply),
    ("reap", "run"): (ReapRequest, ReapReply),
    ("dead", "list"): (DeadListRequest, DeadListReply),
    ("dead", "replay"): (DeadReplayRequest, OkReply),
}
"""(resource, verb) -> (request type, reply type): the whole admin API."""
