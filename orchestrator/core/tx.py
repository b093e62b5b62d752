"""A decision under construction: the working copy of the state, commands, audit and dirty keys.

Role: a small mutable builder that lives only inside one ``decide`` call (so ``decide`` stays pure).
Every phase change goes through ``job_phase`` / ``node_phase``, which check the transition maps; every
record write marks its persistence key dirty; every agent command gets its deterministic cmd_id and the
current fencing token here.
"""

from __future__ import annotations

from typing import TypedDict

import msgspec

from orchestrator.core.commands import Command, SendToAgent
from orchestrator.core.model import (
    TERMINAL_JOB_PHASES,
    AuditEntry,
    Job,
    JobPhase,
    Meta,
    Node,
    NodePhase,
    PoolStats,
    pool_record_key,
    safe_token,
)
from orchestrator.core.records import check_records
from orchestrator.core.state import Decision, State
from orchestrator.core.timers import Timers, build, pool_change
from orchestrator.core.transitions import IllegalTransition, check_job, check_node
from wire.messages import AgentCommand, JobId, NodeId

_replace = msgspec.structs.replace
_NO_WAKE: frozenset[str] = frozenset()
_NO_KINDS: frozenset[int] = frozenset()


class CmdHeader(TypedDict):
    """The fields every agent command of one node gets from ``Tx.header`` (``**``-unpacked into it)."""

    cmd_id: str
    fencing_token: int
    node_id: NodeId
    job_id: JobId
    issued_ts: float


class Tx:
    __slots__ = ("state0", "jobs", "nodes", "pools", "meta", "cfg", "now", "event", "cmds", "audit", "dirty",
                 "timers", "writes", "synced")

    def __init__(self, state: State, event: str, now: float) -> None:
        self.state0 = state
        self.jobs = state.jobs
        self.nodes = state.nodes
        self.pools = state.pools
        self.meta = state.meta
        self.cfg = state.meta.config
        self.now = now
        self.event = event
        self.cmds: list[Command] = []
        self.audit: list[AuditEntry] = []
        self.dirty: set[str] = set()
        # the index of what comes due (timers.py), kept current for the records written here
        self.timers: Timers = state.timers if state.timers is not None else build(state.jobs, state.nodes)
        self.writes: list[tuple[str, str, object]] = []  # (kind, id, the record before this decision)
        self.synced = 0  # writes[:synced] are in self.timers

    # --- records -------------------------------------------------------------------------------

    def put_job(self, job: Job) -> Job:
        self.writes.append(("job", job.job_id, None))
        self.jobs = self.jobs.set(job.job_id, job)
        self.dirty.add("job." + job.job_id)
        return job

    def job(self, job_id: str) -> Job:
        return self.jobs[job_id]

    def update_job(self, job: Job, **changes: object) -> Job:
        if self.jobs.get(job.job_id) is not job:
            raise IllegalTransition(f"update of a stale job record {job.job_id}")
        return self.put_job(_replace(job, **changes))

    def job_phase(self, job: Job, phase: JobPhase, reason: str = "", **changes: object) -> Job:
        if self.jobs.get(job.job_id) is not job:
            raise IllegalTransition(f"phase change of a stale job record {job.job_id}")
        check_job(job.phase, phase)
        if phase != job.phase:
            changes["phase_ts"] = self.now
            if phase in TERMINAL_JOB_PHASES and job.job_id in self.meta.budget_jobs:
                self.put_meta(budget_jobs=tuple(j for j in self.meta.budget_jobs if j != job.job_id))
        return self.put_job(_replace(job, phase=phase, reason=reason or job.reason, **changes))

    def put_node(self, node: Node) -> Node:
        self.writes.append(("node", node.node_id, None))
        self.nodes = self.nodes.set(node.node_id, node)
        self.dirty.add("node." + node.node_id)
        return node

    def update_node(self, node: Node, **changes: object) -> Node:
        if self.nodes.get(node.node_id) is not node:
            raise IllegalTransition(f"update of a stale or deleted node record {node.node_id}")
        return self.put_node(_replace(node, **changes))

    def node_phase(self, node: Node, phase: NodePhase, **changes: object) -> Node:
        if self.nodes.get(node.node_id) is not node:
            raise IllegalTransition(f"phase change of a stale or deleted node record {node.node_id}")
        check_node(node.phase, phase)
        if phase != node.phase:
            changes["phase_ts"] = self.now
        return self.put_node(_replace(node, phase=phase, **changes))

    def drop_node(self, node: Node, phase: NodePhase) -> None:
        """The node reaches a terminal phase: its record is deleted (the shell deletes the key)."""
        check_node(node.phase, phase)
        self.writes.append(("node", node.node_id, node))
        self.nodes = self.nodes.delete(node.node_id)
        self.dirty.add("node." + node.node_id)

    def put_pool(self, name: str, ps: PoolStats) -> PoolStats:
        if ps.changed_ts != self.now:
            ps = _replace(ps, changed_ts=self.now)
        self.writes.append(("pool", name, self.pools.get(name)))
        self.pools = self.pools.set(name, ps)
        self.dirty.add(pool_record_key(name))
        return ps

    def put_meta(self, **changes: object) -> Meta:
        self.meta = _replace(self.meta, **changes)
        self.dirty.add("meta")
        return self.meta

    # --- deterministic ids ----------------------------------------------------------------------

    def new_node_id(self, job_id: str) -> NodeId:
        seq = self.meta.node_seq + 1
        self.put_meta(node_seq=seq)
        return NodeId(f"{safe_token(job_id)}-n{seq}")

    def new_node_ids(self, job: Job, count: int) -> tuple[list[NodeId], int | None]:
        """``count`` new node ids of ``job`` and its node number after them: ``<job>-n<k>`` counted per job
        (``Job.node_seq``), skipping an id a node of the state holds; a job of an older release (no count
        of its own) takes the deployment-wide count, and None."""
        if not isinstance(job.node_seq, int):
            return [self.new_node_id(job.job_id) for _ in range(count)], None
        seq, base = job.node_seq, safe_token(job.job_id)
        ids: list[NodeId] = []
        while len(ids) < count:
            seq += 1
            nid = NodeId(f"{base}-n{seq}")
            if nid not in self.nodes:
                ids.append(nid)
        return ids, seq

    def new_launch_token(self, job_id: str) -> str:
        seq = self.meta.launch_seq + 1
        self.put_meta(launch_seq=seq)
        return f"{safe_token(job_id)}-L{seq}"

    # --- outputs --------------------------------------------------------------------------------

    def emit(self, cmd: Command) -> None:
        self.cmds.append(cmd)

    def header(self, node: Node) -> CmdHeader:
        """The common fields of ``node``'s next agent command: cmd_id f"{node_id}-c{seq}" (seq = the
        node's command counter + 1), the current fencing token, now. Pass the command to ``send``."""
        return CmdHeader(
            cmd_id=f"{node.node_id}-c{node.cmd_seq + 1}",
            fencing_token=self.meta.fencing_token,
            node_id=node.node_id,
            job_id=node.job_id,
            issued_ts=self.now,
        )

    def send(self, node: Node, cmd: AgentCommand) -> Node:
        """Emit SendToAgent(cmd) - ``cmd`` built on ``header(node)`` - and advance the node's counter."""
        seq = node.cmd_seq + 1
        if cmd.cmd_id != f"{node.node_id}-c{seq}":
            raise IllegalTransition(f"command {cmd.cmd_id} not built on header({node.node_id})")
        self.emit(SendToAgent(command=cmd))
        return self.update_node(node, cmd_seq=seq)

    def record(
        self,
        job_id: str | None,
        action: str,
        reason: str,
        alternatives: tuple[tuple[str, float, float], ...] = (),
        **details: object,
    ) -> None:
        self.audit.append(
            AuditEntry(
                ts=self.now,
                job_id=job_id,
                event=self.event,
                action=action,
                reason=reason,
                alternatives=alternatives,
                details=details,
            )
        )

    # --- the index of what comes due ----------------------------------------------------------------

    def sync_timers(self) -> set[str] | frozenset[str]:
        """Bring ``self.timers`` up to the records written so far: re-arm written nodes, wake written jobs
        and the jobs of written nodes that are not awake (and the sleepers a pool or price change
        concerns). Returns the job ids woken. (A finished job leaves the index at its next Tick.)"""
        writes, start = self.writes, self.synced
        if start == len(writes):
            return _NO_WAKE
        self.synced = len(writes)
        t = self.timers
        awake, sleeping = t.awake, bool(t.asleep)
        nodes: list[Node] = []
        wake: set[str] = set()
        kinds: frozenset[int] = _NO_KINDS
        pools: set[str] = set()
        swept: list[Job] = []
        for kind, ident, before in writes[start:] if start else writes:
            if kind == "job":
                if ident not in awake:
                    wake.add(ident)
                job = self.jobs.get(ident)
                if job is not None and isinstance(job.spec.sweep_id, str):
                    swept.append(job)
            elif kind == "node":
                n = self.nodes.get(ident)
                if n is not None:
                    nodes.append(n)
                    if n.job_id not in awake:
                        wake.add(n.job_id)
                elif isinstance(before, Node) and before.job_id not in awake:
                    wake.add(before.job_id)
            elif sleeping and len(kinds) < 2 and ident not in pools:  # pools matter only to jobs asleep
                pools.add(ident)  # the first write since the last sync: ``before`` is the record then
                kinds = kinds | pool_change(before if isinstance(before, PoolStats) else None, self.pools.get(ident))
        if nodes:
            t = t.arm_nodes(nodes)
        if swept:
            t = t.add_sweep_jobs(swept)
        if wake or kinds:
            t, woken = t.update_jobs(wake, kinds)
            self.timers = t
            return woken
        self.timers = t
        return _NO_WAKE

    def decision(self) -> Decision:
        s0 = self.state0
        self.sync_timers()
        # a changed configuration (only ever by hand: no event changes it) drops the index
        timers = self.timers if self.meta.config is s0.meta.config else None
        if (
            self.jobs is s0.jobs
            and self.nodes is s0.nodes
            and self.pools is s0.pools
            and self.meta is s0.meta
        ):
            state = s0 if timers is s0.timers else State(s0.jobs, s0.nodes, s0.pools, s0.meta, timers)
        else:
            state = State(self.jobs, self.nodes, self.pools, self.meta, timers)
            # a record carrying inf/nan must never be persisted: raise here (a core bug, or an input the
            # bounds let through), so the shell skips the event and keeps the previous state
            check_records(state, self.dirty, s0)
        return Decision(state, tuple(self.cmds), tuple(self.audit), frozenset(self.dirty))
