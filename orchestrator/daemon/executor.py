"""Executor: turns the core's commands into provider calls and agent requests; results become events.

Role: the only place where orchd calls clouds or agents. Each command runs in its own task inside the
executor's task group; blocking provider calls run in worker threads (``anyio.to_thread.run_sync``)
under a per-cloud ``CapacityLimiter``. Every result is handed back through ``feed(Result)`` (the
intake's channel, ``Intake.put_result``) so that the decide loop decides it and, in the same persisted
batch, deletes the command's outbox entry.

    Launch         provider.launch (idempotency token = the core's token) -> NodeLaunched per instance,
                   LaunchFailed(reason) for the nodes that got none. TransientError: retry with backoff,
                   same token, up to executor.max_attempts; then LaunchFailed(transient).
    Terminate      provider.terminate -> NodeGone(reason="terminated_by_us")
    (credentials)  with ``credentials`` set: enrolment tokens minted before a launch go into its
                   bootstrap; every NodeGone / LaunchFailed node has its credential revoked.
    CheckInstance  provider.describe  -> NodeGone(provider_missing | provider_terminated), or nothing
    CreateTrackingRun  the job's MLflow run (tracking.create_run, in a thread) -> TrackingRunCreated; retried
                   with backoff (up to executor.retry_max_s apart) until the tracking server answers.
    SendToAgent    request/reply on orch.cmd.<node>, CommandAck reply fed to the core; retried with the
                   same cmd_id every command_ack_timeout_s up to command_retries, then CommandFailed.
                   While orchd's own NATS connection is down, attempts are not spent (an outage is not
                   an agent failure). A generation start goes out with orchd's ``[trainer] model_schemes``
                   (``_outgoing``), whenever it was decided.

Concurrency contract: ``submit`` is called from the decide loop (same event loop); a command whose
outbox key is already in flight is not started twice. ``run`` owns the task group; cancelling it
cancels in-flight commands, which stay in the outbox and are re-executed by the next daemon.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar, TypeVarTuple

import anyio
import msgspec
import nats.errors
import structlog
from anyio.abc import TaskGroup, TaskStatus
from nats.aio.client import Client

import wire as ev
from orchestrator.core.commands import (
    UNOWNED_REASONS,
    CheckInstance,
    Command,
    CreateTrackingRun,
    Launch,
    SendToAgent,
    Terminate,
)
from orchestrator.core.inputs import (
    CommandFailed,
    CoreEvent,
    LaunchFailed,
    NodeGone,
    NodeLaunched,
    TrackingRunCreated,
)
from orchestrator.daemon import tracking
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.records import Result, agent_command_kind
from orchestrator.security.credentials import Credentials
from orchestrator.settings import Settings
from providers.base import CloudProvider, InstanceState, LaunchRequest, NodeBootstrap, ProviderError
from trainer.contract import scheme_names

log = structlog.get_logger("orchd.executor")

T = TypeVar("T")
Args = TypeVarTuple("Args")


@dataclass
class Executor:
    settings: Settings
    providers: Mapping[str, CloudProvider]
    nc: Client
    feed: Callable[[Result], None]
    metrics: Metrics
    nats_urls: tuple[str, ...] = ()
    may_act: Callable[[], bool] | None = None
    """False while this daemon does not hold a valid leader lease (HA): commands are then left in the
    outbox for the leader, never executed (clouds know nothing of fencing tokens). None: no lease (a
    single orchd always may)."""
    credentials: Credentials | None = None
    """Per-node NATS credentials (orchestrator/credentials.py): enrolment tokens into the launch's
    bootstrap, revoked on NodeGone and for launch nodes that got no instance. None: no credentials."""
    tracking_gate: tracking.TrackingGate = field(init=False)
    _tg: TaskGroup | None = None
    _limiters: dict[str, anyio.CapacityLimiter] = field(default_factory=dict)
    in_flight: set[str] = field(default_factory=set)
    _notice_ts: dict[str, float] = field(default_factory=dict)  # checkpoint cmd_id -> its notice's publish ts

    def __post_init__(self) -> None:
        self.tracking_gate = tracking.TrackingGate(self.settings.tracking)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            await anyio.sleep_forever()

    def submit_all(self, commands: Iterable[tuple[str, Command, float | None]]) -> None:
        """``submit`` each (outbox key, command, notice_ts), in order."""
        for key, cmd, notice_ts in commands:
            self.submit(key, cmd, notice_ts=notice_ts)

    def submit(self, key: str, cmd: Command, *, inherited: bool = False, notice_ts: float | None = None) -> None:
        """Execute ``cmd`` once (``key``: its outbox key). ``inherited``: an outbox entry a previous
        leader decided and may have executed already: a Terminate then asks the provider first and calls
        terminate only for an instance that is not already going (no second terminate from a second
        daemon). ``notice_ts``: the publish time of the notice a checkpoint command answers (its first
        send observes ``orchd_notice_to_command_seconds``)."""
        if key in self.in_flight:
            return
        if notice_ts is not None and isinstance(cmd, SendToAgent):
            self._notice_ts[cmd.command.cmd_id] = notice_ts
        assert self._tg is not None, "executor not running"
        self.in_flight.add(key)
        self._tg.start_soon(self._execute, key, cmd, inherited)

    # -------------------------------------------------------------------------------------------

    async def _execute(self, key: str, cmd: Command, inherited: bool = False) -> None:
        if self.may_act is not None and not self.may_act():
            self.in_flight.discard(key)
            if isinstance(cmd, SendToAgent):
                self._notice_ts.pop(cmd.command.cmd_id, None)
            log.warning("command_not_executed_no_lease", key=key)
            return  # stays in the outbox
        try:
            match cmd:
                case Launch():
                    events = await self._launch(cmd)
                case Terminate():
                    # an instance the state does not own is often one that a launch re-executed from the
                    # outbox returned after another daemon had terminated it: asked first, as inherited ones
                    check = inherited or cmd.reason in UNOWNED_REASONS
                    events = (await self._already_going(cmd) if check else ()) or await self._terminate(cmd)
                case CheckInstance():
                    events = await self._check(cmd)
                case SendToAgent():
                    try:
                        events = await self._send(cmd)
                    finally:
                        self._notice_ts.pop(cmd.command.cmd_id, None)
                case CreateTrackingRun():
                    events = await self._tracking_run(cmd)
                case _:
                    log.error("unknown_command", command=repr(cmd))
                    events = ()
        except Exception as e:  # a bug in a provider adapter must not take the daemon down
            log.exception("command_crashed", key=key, error=repr(e))
            events = _failure_events(cmd, ev.FailureReason.UNKNOWN, repr(e))
        finally:
            self.in_flight.discard(key)
        if self.credentials is not None:
            await _revoke_departed(self.credentials, events)
        self.feed(Result(key, tuple(events)))

    def limiter(self, cloud: str) -> anyio.CapacityLimiter:
        """The CapacityLimiter of a cloud's provider calls (shared with its price feed)."""
        lim = self._limiters.get(cloud)
        if lim is None:
            lim = self._limiters[cloud] = anyio.CapacityLimiter(self.settings.executor.concurrency_per_cloud)
        return lim

    async def _call(self, cloud: str, op: str, fn: Callable[[*Args], T], *args: *Args) -> T:
        """Call a provider method in a thread; retry TransientError with backoff (same arguments)."""
        xs = self.settings.executor
        attempt = 0
        while True:
            attempt += 1
            try:
                out = await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter(cloud))
                self.metrics.provider_calls.labels(cloud, op, "ok").inc()
                return out
            except ProviderError as e:
                self.metrics.provider_calls.labels(cloud, op, e.reason.value).inc()
                if not e.retryable or e.reason is not ev.FailureReason.TRANSIENT or attempt >= xs.max_attempts:
                    raise
                delay = min(xs.retry_base_s * 2 ** (attempt - 1), xs.retry_max_s)
                log.warning("provider_retry", cloud=cloud, op=op, attempt=attempt, delay_s=delay, error=str(e))
                await anyio.sleep(delay)

    async def _launch(self, cmd: Launch) -> tuple[CoreEvent, ...]:
        provider = self.providers.get(cmd.pool.cloud)
        if provider is None:
            return _failure_events(cmd, ev.FailureReason.UNKNOWN, f"no provider for cloud {cmd.pool.cloud!r}")
        req = LaunchRequest(
            pool=cmd.pool,
            node_ids=cmd.node_ids,
            idempotency_token=cmd.token,
            cluster_id=self.settings.daemon.cluster_id,
            job_id=cmd.job_id,
            bootstrap=NodeBootstrap(nats_urls=self.nats_urls, node_credentials=(
                {} if self.credentials is None
                else await anyio.to_thread.run_sync(functools.partial(
                    self.credentials.on_launch, cmd.node_ids, job_id=cmd.job_id, cloud=cmd.pool.cloud)))),
        )
        try:
            result = await self._call(cmd.pool.cloud, "launch", provider.launch, req)
        except ProviderError as e:
            log.warning("launch_failed", job=cmd.job_id, pool=cmd.pool.name, reason=e.reason.value, error=str(e))
            return _failure_events(cmd, e.reason, str(e))
        out: list[CoreEvent] = []
        got = set()
        for inst in result.instances:
            if inst.node_id is None:
                continue
            got.add(inst.node_id)
            out.append(NodeLaunched(node_id=inst.node_id, job_id=cmd.job_id, instance_id=inst.instance_id,
                                    pool=inst.pool, token=cmd.token))
        rest = tuple(n for n in cmd.node_ids if n not in got)
        if rest:
            reason = result.failure or ev.FailureReason.CAPACITY
            out.append(LaunchFailed(node_ids=rest, job_id=cmd.job_id, pool=cmd.pool, token=cmd.token,
                                    reason=reason, message=result.message))
        log.info("launched", job=cmd.job_id, pool=cmd.pool.name, nodes=len(got), missing=len(rest))
        return tuple(out)

    async def _terminate(self, cmd: Terminate) -> tuple[CoreEvent, ...]:
        if cmd.instance_id is not None and cmd.pool is not None:
            provider = self.providers.get(cmd.pool.cloud)
            if provider is None:
                log.error("terminate_no_provider", node=cmd.node_id, cloud=cmd.pool.cloud)
            else:
                try:
                    await self._call(cmd.pool.cloud, "terminate", provider.terminate, [cmd.instance_id],
                                     self.settings.daemon.cluster_id)
                except ProviderError as e:
                    log.error("terminate_failed", node=cmd.node_id, error=str(e))
                    return ()  # the reaper finds leftovers; the core keeps the node until it is gone
        return (NodeGone(node_id=cmd.node_id, instance_id=cmd.instance_id, reason="terminated_by_us"),)

    async def _already_going(self, cmd: Terminate) -> tuple[CoreEvent, ...]:
        """The Terminate's own result (NodeGone terminated_by_us) when the provider shows the instance
        missing, terminated or stopping; () when it is running or the provider cannot tell."""
        if cmd.instance_id is None or cmd.pool is None:
            return ()
        gone = await self._check(CheckInstance(node_id=cmd.node_id, instance_id=cmd.instance_id, pool=cmd.pool))
        if not gone:
            return ()
        log.info("terminate_already_done", node=cmd.node_id, instance=cmd.instance_id)
        return (NodeGone(node_id=cmd.node_id, instance_id=cmd.instance_id, reason="terminated_by_us"),)

    async def _check(self, cmd: CheckInstance) -> tuple[CoreEvent, ...]:
        provider = self.providers.get(cmd.pool.cloud)
        if provider is None:
            return ()
        try:
            found = await self._call(cmd.pool.cloud, "describe", provider.describe, [cmd.instance_id])
        except ProviderError as e:
            log.warning("check_instance_failed", node=cmd.node_id, error=str(e))
            return ()
        insts = [i for i in found if i.instance_id == cmd.instance_id]
        if not insts:
            return (NodeGone(node_id=cmd.node_id, instance_id=cmd.instance_id, reason="provider_missing"),)
        if insts[0].state in (InstanceState.TERMINATED, InstanceState.STOPPING):
            return (NodeGone(node_id=cmd.node_id, instance_id=cmd.instance_id, reason="provider_terminated"),)
        return ()

    async def _tracking_run(self, cmd: CreateTrackingRun) -> tuple[CoreEvent, ...]:
        """Create (or find) the job's MLflow run; an outage or a missing package is retried, never fatal."""
        why = self.tracking_gate.refusal(cmd.uri)
        if why is not None:  # never contacted with orchd's credentials: the job runs untracked
            self.metrics.rejected.labels("tracking", why).inc()
            log.warning("tracking_server_refused", job=cmd.job_id, reason=why,
                        hint="the job runs untracked: its server is not one of [tracking.servers]")
            return ()
        xs = self.settings.executor
        delay = xs.retry_base_s
        while True:
            try:
                run_id = await anyio.to_thread.run_sync(tracking.create_run, cmd, self.settings.daemon.cluster_id,
                                                        abandon_on_cancel=True)  # idempotent: safe to abandon
                log.info("tracking_run", job=cmd.job_id, run_id=run_id, experiment=cmd.experiment)
                return (TrackingRunCreated(job_id=cmd.job_id, run_id=run_id),)
            except ImportError:
                log.error("tracking_unavailable", job=cmd.job_id, hint=tracking.PACKAGE_HINT, retry_s=delay)
            except Exception as e:  # the tracking server is down or refused: try again later
                log.warning("tracking_run_retry", job=cmd.job_id, error=type(e).__name__, retry_s=delay)
            await anyio.sleep(delay)
            delay = min(delay * 2, max(xs.retry_max_s, xs.retry_base_s))

    def _outgoing(self, c: ev.AgentCommand) -> ev.AgentCommand:
        """A generation start as orchd's configuration has it, whenever the core decided it (an outbox entry
        may predate this run): the model schemes of ``[trainer] model_schemes``, and (``_untracked``) no tracking
        variables for a server the config does not list."""
        if not isinstance(c, ev.StartGenerationCmd):
            return c
        c = msgspec.structs.replace(c, model_schemes=scheme_names(self.settings.trainer.model_schemes))
        return self._untracked(c)

    def _untracked(self, c: ev.StartGenerationCmd) -> ev.StartGenerationCmd:
        """A generation start whose trainer would log to a tracking server orchd's config does not list:
        without the trainer's tracking variables (the agent's credentials go nowhere else either)."""
        uri = c.trainer.env.get("MLFLOW_TRACKING_URI")
        if uri is None or self.tracking_gate.refusal(uri) != "server_not_listed":
            return c
        env = {k: v for k, v in c.trainer.env.items() if k not in tracking.TRAINER_ENV}
        return msgspec.structs.replace(c, trainer=msgspec.structs.replace(c.trainer, env=env))

    def _sent(self, cmd_id: str) -> None:
        """A command's first send: the notice-to-command latency, when it answers a notice."""
        ts = self._notice_ts.pop(cmd_id, None)
        if ts is not None:
            self.metrics.notice_to_command.observe(max(0.0, time.time() - ts))

    async def _send(self, cmd: SendToAgent) -> tuple[CoreEvent, ...]:
        c = self._outgoing(cmd.command)
        subject = ev.subject_command(c.node_id)
        payload = ev.encode(c)
        ds = self.settings.daemon
        kind = agent_command_kind(c)
        tries = 0
        first = True
        while tries <= ds.command_retries:
            while not self.nc.is_connected:  # an outage of our own connection is not the agent's fault
                await anyio.sleep(0.1)
            if first:
                self._sent(c.cmd_id)
            first = False
            tries += 1
            try:
                reply = await self.nc.request(subject, payload, timeout=ds.command_ack_timeout_s)
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as e:
                log.info("agent_command_retry", node=c.node_id, cmd_id=c.cmd_id, kind=kind, attempt=tries,
                         error=type(e).__name__)
                if isinstance(e, nats.errors.NoRespondersError):
                    await anyio.sleep(min(ds.command_ack_timeout_s, 0.2 * 2**tries))
                continue
            except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError,
                    nats.errors.ConnectionDrainingError):
                await anyio.sleep(0.1)
                continue
            try:
                ack = ev.decode(reply.data, ev.CommandAck)
            except ev.WireError as e:
                self.metrics.rejected.labels("command_ack", e.reason).inc()
                continue
            if ack.cmd_id != c.cmd_id:
                self.metrics.rejected.labels("command_ack", "wrong_cmd_id").inc()
                continue
            return (ack,)
        log.warning("agent_command_failed", node=c.node_id, cmd_id=c.cmd_id, kind=kind, attempts=tries)
        return (CommandFailed(node_id=c.node_id, cmd_id=c.cmd_id, kind=kind),)


def _failure_events(cmd: Command, reason: ev.FailureReason, message: str) -> tuple[CoreEvent, ...]:
    match cmd:
        case Launch():
            return (LaunchFailed(node_ids=cmd.node_ids, job_id=cmd.job_id, pool=cmd.pool, token=cmd.token,
                                 reason=reason, message=message[:500]),)
        case SendToAgent():
            c = cmd.command
            return (CommandFailed(node_id=c.node_id, cmd_id=c.cmd_id, kind=agent_command_kind(c)),)
        case _:
            return ()


async def _revoke_departed(credentials: Credentials, events: tuple[CoreEvent, ...]) -> None:
    """Revoke the credentials of every node that left (NodeGone) or never got an instance (LaunchFailed)."""
    gone = [e.node_id for e in events if isinstance(e, NodeGone)]
    gone += [n for e in events if isinstance(e, LaunchFailed) for n in e.node_ids]
    for node_id in gone:
        try:
            await anyio.to_thread.run_sync(credentials.on_gone, node_id)
        except Exception as e:  # a failed revoke must not lose the event; logged
            log.error("credential_revoke_failed", node=node_id, error=repr(e))
