"""The admin service of orchd: a ``nats.micro`` service on ``orch.admin.v1.<resource>.<verb>``.

Role: the only way operators (``orchctl``) and tools talk to orchd. Reads are answered from the
daemon's current (immutable) state; intents (submit, cancel, drain) are fed to the decide loop as core
events and answered only after their decision is persisted. Request/reply types are in
``wire`` (``ADMIN_ENDPOINTS``); docs/admin.md lists them.

Fault injection (``nodes.preempt``, ``nodes.kill``) is the provider's work, not the core's: the handler
asks the node's provider (only the local provider can: ``inject_preemption`` / ``inject_kill``) and the
core learns of it as of any reclaim - the agent reports the notice, the instance ends, the heartbeats
stop. A node of any other provider is refused (409).

Errors: bad request 400, unknown job/node 404, conflict 409, internal 500, not deciding it 503 (the
lease was lost: ``NotLeader``; shutting down: ``ShuttingDown``) - sent with the micro error headers and an
``AdminErrorBody`` payload. No exception text other than ours leaves the daemon.

Concurrency contract: handlers run on the daemon's event loop (one task per subscription, nats-py);
each binds the request's job/node to the log context with ``bound_contextvars``.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import anyio
import msgspec
import nats.micro
import structlog
from nats.aio.client import Client
from nats.js.errors import NotFoundError
from nats.micro.request import Request
from nats.micro.service import Service

import wire as ev
from orchestrator import bus
from orchestrator.core.feasibility import deadline_problem, submit_problems
from orchestrator.core.inputs import JobCancelled, JobSubmitted, NodeDrainRequested
from orchestrator.core.model import TERMINAL_JOB_PHASES, Job, Node
from orchestrator.core.roots import Overlap, find_overlap
from orchestrator.core.state import State
from orchestrator.core.sweeps import refusal_view as sweep_refusal
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.records import NotLeader, ShuttingDown
from orchestrator.daemon.store import Store
from orchestrator.daemon.summaries import (
    counts,
    job_summary,
    known_nodes,
    new_job_id,
    node_summary,
    pool_summary,
    record_dict,
    sweep_summary,
)
from orchestrator.daemon.tracking import TrackingGate
from orchestrator.daemon.tracking import submit_problems as tracking_submit_problems
from orchestrator.daemon.view import DaemonView
from orchestrator.jobspec import spec_problems
from orchestrator.specchecks import model_source_problems
from trainer import rootowner
from wire.admin import (
    DeadLetter,
    DeadListReply,
    DeadListRequest,
    DeadReplayRequest,
    KillNodeRequest,
    PreemptNodeRequest,
)
from wire.names import BadName, check_job_id, is_token

log = structlog.get_logger("orchd.admin")

VERSION = "0.1.0"


class AdminFailure(Exception):
    def __init__(self, code: int, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason  # the rejection counter's label (default: from the code)


class AdminService:
    """The running admin service: the micro Service and the number of requests being handled."""

    def __init__(self, svc: Service) -> None:
        self.svc = svc
        self.in_flight = 0

    async def stop(self, wait_s: float = 2.0) -> None:
        """Stop once the requests being handled are answered (at most ``wait_s``): nats.micro's stop
        cancels a running handler, and its client would get no answer, though the final batch
        (``Daemon.finish``, before this) decided its request or handed it back."""
        with anyio.move_on_after(wait_s):
            while self.in_flight:
                await anyio.sleep(0.005)
        await self.svc.stop()


async def start_service(nc: Client, d: DaemonView) -> AdminService:
    """Register every endpoint of ``ev.ADMIN_ENDPOINTS``; return the service (``stop()`` it after the final batch)."""
    svc = await nats.micro.add_service(nc, name=ev.ADMIN_SERVICE_NAME, version=ev.ADMIN_SERVICE_VERSION,
                                       description="orchd admin API", queue_group="orchd-admin")
    service = AdminService(svc)
    handlers = Handlers(d)
    root = svc.add_group(name=ev.SUBJECT_ADMIN_PREFIX)
    for (resource, verb), (req_type, _reply_type) in ev.ADMIN_ENDPOINTS.items():
        fn = getattr(handlers, f"{resource}_{verb}")
        group = root.add_group(name=resource)
        await group.add_endpoint(name=f"{resource}-{verb}", subject=verb,
                                 handler=_wrap(resource, verb, req_type, fn, d.metrics, service))
    return service


_ERROR_REASONS = {400: "bad_request", 404: "not_found", 409: "conflict"}


def _wrap(resource: str, verb: str, req_type: type, fn: Callable[[Any], Awaitable[msgspec.Struct]],
          metrics: Metrics | None = None, service: AdminService | None = None
          ) -> Callable[[Request], Awaitable[None]]:
    """Every error answer is counted in ``orchd_messages_rejected{kind="admin", reason}``: the wire
    reason of an undecodable request (bad_json, bad_schema, bad_version, too_large...), else
    bad_request / not_found / conflict / internal_error."""

    def count(reason: str) -> None:
        if metrics is not None:
            metrics.rejected.labels("admin", reason).inc()

    async def handler(request: Request) -> None:
        if service is not None:
            service.in_flight += 1
        try:
            await answer(request)
        finally:
            if service is not None:
                service.in_flight -= 1

    async def answer(request: Request) -> None:
        t0 = time.perf_counter()
        try:
            try:
                # An empty body means the defaults; a request type with required fields then fails
                # as a bad_schema 400 (not as a TypeError 500).
                req: msgspec.Struct = ev.decode(request.data or b"{}", req_type)
            except ev.WireError as e:
                raise AdminFailure(400, f"bad {resource}.{verb} request: {e.detail}", e.reason) from None
            ctx = {k: getattr(req, k) for k in ("job_id", "node_id") if getattr(req, k, None)}
            with structlog.contextvars.bound_contextvars(admin=f"{resource}.{verb}", **ctx):
                reply = await fn(req)
                log.debug("admin_request", ms=round((time.perf_counter() - t0) * 1000, 2))
            await request.respond(ev.encode(reply))
        except (NotLeader, ShuttingDown) as e:  # lease lost / final batch taken: the client retries (503)
            count("not_leader" if isinstance(e, NotLeader) else "shutting_down")
            await request.respond_error("503", str(e), data=ev.encode(ev.AdminErrorBody(code=503, message=str(e))))
        except AdminFailure as e:
            count(e.reason or _ERROR_REASONS.get(e.code, f"http_{e.code}"))
            await request.respond_error(str(e.code), _one_line(e.message),
                                        data=ev.encode(ev.AdminErrorBody(code=e.code, message=e.message)))
        except Exception as e:  # never let a handler bug reach the client as a repr, never crash
            log.exception("admin_handler_failed", endpoint=f"{resource}.{verb}")
            count("internal_error")
            msg = f"internal error in {resource}.{verb}: {type(e).__name__}"
            await request.respond_error("500", msg, data=ev.encode(ev.AdminErrorBody(code=500, message=msg)))

    return handler


def root_refusal(spec: ev.JobSpec, job_id: str, cluster_id: str) -> str | None:
    """Why the storage says ``job_id`` may not use its checkpoint root (``trainer.rootowner``: the owner
    marker names another job or cluster, the root nests in or holds another job's), or None. Blocking: run
    it in a worker thread. A store this host cannot read (no library, no credentials, unreachable) is not a
    refusal: the node checks the same before the trainer writes a byte."""
    opts = spec.trainer.args.get("storage_options")
    try:
        return rootowner.problem(spec.checkpoint.url, job_id, cluster_id, opts if isinstance(opts, dict) else None)
    except Exception as e:  # ImportError, StoreConfigError, an outage: the node's check decides
        log.info("checkpoint_root_not_checked", job=job_id, error=f"{type(e).__name__}: {e}"[:200])
        return None


def job_id_problems(job_id: str | None) -> list[str]:
    """A job id given with a submit must be a token (it becomes subject tokens and KV keys)."""
    if job_id is None:
        return []
    try:
        check_job_id(job_id)
    except BadName as e:
        return [str(e)]
    return []


def _one_line(text: str) -> str:
    """Header values cannot hold newlines; the payload carries the full message."""
    return " ".join(text.split())[:1000]


def _overlap_message(job_id: str, clash: Overlap, other: Job) -> str:
    where = {"equal": "is the checkpoint root of", "inside": "lies inside the checkpoint root of",
             "contains": "contains the checkpoint root of"}[clash.relation]
    phase = getattr(other.phase, "value", other.phase)
    hint = (f'; to start from its last committed checkpoint, set [checkpoint] start_from = "{other.committed_url}"'
            if other.committed_url else "")
    return (f"job {job_id!r} refused: checkpoint.url {clash.root} {where} job {clash.job_id!r} ({phase}, root "
            f"{clash.other_root}). One job, one checkpoint root: choose a checkpoint.url outside it{hint}.")


class Handlers:
    """One method per endpoint (``<resource>_<verb>``), over what a ``DaemonView`` shows."""

    def __init__(self, d: DaemonView) -> None:
        self.d = d

    def _state(self) -> State:
        state = self.d.state
        if state is None:  # admin starts after the state is loaded: cannot happen, kept typed
            raise NotLeader("this orchd has not loaded its state yet; retry")
        return state

    def _store(self) -> Store:
        store = self.d.store
        if store is None:  # as ``_state``
            raise NotLeader("this orchd is not connected to its store yet; retry")
        return store

    def _job(self, job_id: str) -> Job:
        job = self._state().jobs.get(job_id)
        if job is None:
            raise AdminFailure(404, f"no job {job_id!r}")
        return job

    async def status_get(self, req: ev.EmptyRequest) -> ev.StatusReply:
        d = self.d
        c = counts(self._state())
        return ev.StatusReply(
            version=VERSION, pid=os.getpid(), started_ts=d.started_ts, uptime_s=round(time.time() - d.started_ts, 1),
            nats_url=d.nats_url, nats_connected=d.connected, metrics_url=d.metrics_url,
            fencing_token=d.fencing_token, events_decided=d.events_decided, batches=d.batches,
            commands_in_flight=len(d.executor.in_flight) if d.executor else 0,
            providers=sorted(d.providers), jobs=c["jobs"], nodes=c["nodes"], pools=c["pools"],
            cluster_id=d.settings.daemon.cluster_id,
        )

    async def jobs_submit(self, req: ev.SubmitJobRequest) -> ev.SubmitJobReply:
        spec = self._checked_spec(req)
        job_id = req.job_id or new_job_id(spec, secrets.token_hex(3))
        if job_id in self._state().jobs:
            return ev.SubmitJobReply(job_id=job_id, created=False)
        owned = await anyio.to_thread.run_sync(root_refusal, spec, job_id, self.d.settings.daemon.cluster_id)
        if owned is not None:
            raise AdminFailure(409, f"job {job_id!r} refused: {owned}", "checkpoint_root_owned")
        try:
            replicas = isinstance(spec.checkpoint.replica_every, int) and spec.checkpoint.replica_every > 0
            await self.d.submit(JobSubmitted(job_id=ev.JobId(job_id), spec=spec,  # the replicas' secret: drawn here
                                             replica_secret=secrets.token_hex(32) if replicas else msgspec.UNSET))
        except NotLeader as e:  # it may have been written all the same: a retry under another id would be a 2nd job
            raise NotLeader(f"{e}; submit it again as job {job_id} (orchctl jobs submit --id {job_id}): it may have"
                            " been written, and the same id cannot make a second job") from None
        if job_id not in self._state().jobs:
            self._refusal(job_id, spec)
        late = deadline_problem(spec, self._state().meta.config, time.time()) if spec.best_effort else None
        log.info("job_submitted", job=job_id, name=spec.name, **({"best_effort": late} if late else {}))
        return ev.SubmitJobReply(job_id=job_id, created=True)

    def _checked_spec(self, req: ev.SubmitJobRequest) -> ev.JobSpec:
        """The spec to submit (its tracking server resolved), or a 400 that lists every problem."""
        spec, tracked = TrackingGate(self.d.settings.tracking).resolve(req.spec)
        if tracked and isinstance(spec.sweep_id, str):  # a trial of a sweep template stored before the list
            log.warning("tracking_server_refused", sweep=spec.sweep_id, problems=tracked,
                        hint="the trial runs untracked: name a server of [tracking.servers] in the template")
            self.d.metrics.rejected.labels("tracking", "server_not_listed").inc()
            spec, tracked = msgspec.structs.replace(spec, tracking=msgspec.UNSET), []
        problems = job_id_problems(req.job_id) + spec_problems(spec) + tracking_submit_problems(spec)
        problems += tracked + model_source_problems(spec, self.d.settings.trainer.model_schemes)
        if problems:
            raise AdminFailure(400, "invalid job spec:\n" + "\n".join(f"  - {p}" for p in problems), "invalid_spec")
        problems = submit_problems(spec, self._state().meta.config, time.time(), clouds=self.d.providers)
        if problems:  # no enabled cloud / catalog entry can run it, or its deadline is out of reach
            raise AdminFailure(400, "job cannot run:\n" + "\n".join(f"  - {p}" for p in problems), "infeasible")
        return spec

    def _refusal(self, job_id: str, spec: ev.JobSpec) -> NoReturn:
        """Why the core did not take the job, said again from the core's own rules (its audit has it too)."""
        state = self._state()
        clash = find_overlap(((j.job_id, j.spec.checkpoint.url) for j in state.jobs.values()), spec.checkpoint.url)
        if clash is not None:
            raise AdminFailure(409, _overlap_message(job_id, clash, state.jobs[clash.job_id]),
                               "checkpoint_root_overlap")
        closed = sweep_refusal(state, spec, time.time())
        if closed is not None:
            raise AdminFailure(409, f"job {job_id!r} refused: {closed[1]}", "sweep_closed")
        raise AdminFailure(409, f"the core did not accept job {job_id!r} (see orchctl explain {job_id})")

    async def jobs_list(self, req: ev.ListJobsRequest) -> ev.JobsReply:
        state, now = self._state(), time.time()
        jobs = [job_summary(state, j, now) for j in state.jobs.values()
                if req.include_finished or j.phase not in TERMINAL_JOB_PHASES]
        jobs.sort(key=lambda j: j["job_id"])
        return ev.JobsReply(jobs=jobs)

    async def jobs_show(self, req: ev.JobRequest) -> ev.JobReply:
        job = self._job(req.job_id)
        nodes = self._state().nodes
        now = time.time()
        summary = job_summary(self._state(), job, now)
        if isinstance(job.spec.sweep_id, str):  # its sweep's cap and cost, as orchd enforces them
            summary["sweep"] = sweep_summary(self._state(), job.spec.sweep_id, now)
        return ev.JobReply(summary=summary, job=record_dict(job),
                           nodes=[node_summary(nodes[n], now) for n in job.nodes if n in nodes])

    async def jobs_cancel(self, req: ev.JobRequest) -> ev.OkReply:
        self._job(req.job_id)
        await self.d.submit(JobCancelled(job_id=ev.JobId(req.job_id), reason=req.reason))
        job = self._state().jobs.get(req.job_id)
        phase = getattr(getattr(job, "phase", None), "value", "deleted")
        return ev.OkReply(message=f"cancel of {req.job_id} decided; phase now {phase}")

    async def jobs_explain(self, req: ev.JobRequest) -> ev.ExplainReply:
        # A job's audit is on a subject of its id: an id that is not a token has none (and is no subject)
        raw = await self._store().read_audit(req.job_id, limit=max(1, min(req.limit, 5000))) \
            if is_token(req.job_id) else []
        if not raw and req.job_id not in self._state().jobs:
            raise AdminFailure(404, f"no job {req.job_id!r} and no audit for it")
        return ev.ExplainReply(job_id=req.job_id, entries=[msgspec.json.decode(r) for r in raw])

    async def nodes_list(self, req: ev.ListNodesRequest) -> ev.NodesReply:
        now = time.time()
        nodes = [node_summary(n, now) for n in self._state().nodes.values()
                 if req.job_id is None or n.job_id == req.job_id]
        nodes.sort(key=lambda n: n["node_id"])
        return ev.NodesReply(nodes=nodes)

    async def nodes_drain(self, req: ev.DrainNodeRequest) -> ev.OkReply:
        if req.node_id not in self._state().nodes:
            raise AdminFailure(404, f"no node {req.node_id!r}")
        await self.d.submit(NodeDrainRequested(node_id=ev.NodeId(req.node_id), reason=req.reason))
        node = self._state().nodes.get(req.node_id)
        phase = getattr(getattr(node, "phase", None), "value", "gone")
        return ev.OkReply(message=f"drain of {req.node_id} decided; phase now {phase}")

    def _injectable(self, node_id: str, verb: str, hook: str) -> tuple[Node, Callable[..., Any]]:
        """The node and its provider's fault-injection hook; 404 for an unknown node, 409 for a node
        that is not the local provider's (a cloud's reclaim or host failure cannot be caused from here)."""
        node = self._state().nodes.get(node_id)
        if node is None:
            raise AdminFailure(404, f"no node {node_id!r}")
        cloud = node.pool.cloud
        fn = getattr(self.d.providers.get(cloud), hook, None)
        if fn is None:
            raise AdminFailure(409, f"nodes {verb} {node_id}: the node runs on {cloud!r}; faults can be injected "
                                    f"only into the local provider's nodes (to take a cloud node out, use "
                                    f"'orchctl nodes drain {node_id}')", "not_local")
        return node, fn

    async def _inject(self, call: Callable[[], Any], node_id: str, verb: str) -> Any:
        try:
            return await anyio.to_thread.run_sync(call)
        except LookupError as e:
            raise AdminFailure(404, f"nodes {verb} {node_id}: {e.args[0] if e.args else e}") from None
        except ValueError as e:
            raise AdminFailure(409, f"nodes {verb} {node_id}: {e}") from None

    async def nodes_preempt(self, req: PreemptNodeRequest) -> ev.OkReply:
        if not 0.0 <= req.notice_s <= 3600.0:  # NaN fails too
            raise AdminFailure(400, f"notice_s must be within 0 .. 3600 seconds, got {req.notice_s}")
        node, fn = self._injectable(req.node_id, "preempt", "inject_preemption")
        deadline = await self._inject(lambda: fn(req.node_id, node.instance_id, req.notice_s), req.node_id, "preempt")
        log.warning("node_preemption_injected", node=req.node_id, notice_s=req.notice_s, deadline_ts=deadline)
        return ev.OkReply(message=f"preemption of {req.node_id} injected: termination notice for "
                                  f"{req.notice_s:g} s from now, its processes are killed at the deadline")

    async def nodes_kill(self, req: KillNodeRequest) -> ev.OkReply:
        node, fn = self._injectable(req.node_id, "kill", "inject_kill")
        await self._inject(lambda: fn(req.node_id, node.instance_id), req.node_id, "kill")
        log.warning("node_kill_injected", node=req.node_id)
        return ev.OkReply(message=f"{req.node_id} killed (every process, no notice)")

    async def prices_list(self, req: ev.EmptyRequest) -> ev.PricesReply:
        pools = [pool_summary(p) for p in self._state().pools.values()]
        pools.sort(key=lambda p: p["pool"])
        return ev.PricesReply(pools=pools)

    async def events_tail(self, req: ev.TailEventsRequest) -> ev.EventsReply:
        events = self.d.events
        return ev.EventsReply(events=events.tail(req.after_seq, min(req.limit, 2000)), last_seq=events.seq)

    async def reap_run(self, req: ev.ReapRequest) -> ev.ReapReply:
        if not self.d.providers:
            return ev.ReapReply(report={"dry_run": req.dry_run, "message": "no providers configured"})
        reaper = self.d.reaper_for()
        known = known_nodes(self._state())
        report = await anyio.to_thread.run_sync(
            lambda: reaper.reconcile(known, state_ok=self.d.may_act(), dry_run=req.dry_run))
        return ev.ReapReply(report=report.to_dict())

    async def dead_list(self, req: DeadListRequest) -> DeadListReply:
        parked = await bus.dead_list(self._store().js, limit=max(1, min(req.limit, 1000)))
        return DeadListReply(messages=[
            DeadLetter(seq=p.seq, ts=p.ts, subject=p.subject, reason=p.reason, deliveries=p.deliveries,
                       size=len(p.data), preview=p.data[:200].decode("utf-8", "replace")) for p in parked])

    async def dead_replay(self, req: DeadReplayRequest) -> ev.OkReply:
        if not 1 <= req.seq < 2**63:  # a stream sequence; nats-server refuses anything else
            raise AdminFailure(400, f"seq must be within 1 .. 2**63-1, got {req.seq}")
        try:
            dead = await bus.replay(self._store().js, req.seq)
        except NotFoundError:
            raise AdminFailure(404, f"no dead letter {req.seq} in {bus.STREAM_DEAD}") from None
        except ValueError as e:
            raise AdminFailure(400, str(e)) from None
        log.info("dead_letter_replayed", seq=req.seq, subject=dead.subject, reason=dead.reason)
        return ev.OkReply(message=f"dead letter {req.seq} republished to {dead.subject}")
