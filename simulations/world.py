"""The faithful world around the daemon's own decision core (the ``orchd`` policy).

Role: play the agents and the trainer for ONE job around ``orchestrator.core.decide``, on top of the
clouds of ``simulations.world_cloud.CloudModel`` (market, launches, notices, billing, the shared
random draws), so that the ``orchd`` policy in the simulator is the daemon's code and nothing else.
The baselines run on the same clouds and the same trainer model (``world_policy.PolicyWorld``).

Trainer model (shared with ``world_policy``):
  periodic    asynchronous saves every ``checkpoint_interval_s`` of the StartGenerationCmd (the
              interval the core chose): training goes on; the checkpoint holds the progress at the
              save's start and is committed ``save_s`` later if every member is still alive.
  emergency   CheckpointCmd / StopCmd: training stops; committed ``save_s`` later if every member is
              still alive (a save that overruns the notice commits nothing: the work since the last
              commit is lost), then RanksExited(emergency_checkpoint) from each member.
  lost node   a member that dies while training (or before its save committed) sends progress back
              to the last commit.

Commands: StartGenerationCmd -> GenerationStarted after restart_s (+ migration when the checkpoint is
in another region/cloud); AbandonGenerationCmd -> RanksExited(abandoned); Terminate -> billing stops;
CheckInstance -> NodeGone when dead. Before every Tick (one per trace tick) a Heartbeat per registered
node carries the trained step.

Single-threaded, no I/O; one World per job (the core's state is per daemon).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from orchestrator.core import Command, CoreConfig, CoreEvent, JobPhase, State, decide
from orchestrator.core.commands import CheckInstance, Launch, SendToAgent, Terminate
from orchestrator.core.inputs import JobSubmitted, NodeGone, Tick
from orchestrator.core.placement import retry_at
from simulations.engine import Job
from simulations.scenario import Scenario
from simulations.world_cloud import BASE_TS, GPU, CloudModel, WNode
from simulations.worldparams import Draws, WorldParams
from wire import (
    AbandonGenerationCmd,
    AgentCommand,
    AgentState,
    CheckpointCmd,
    CheckpointCommitted,
    CheckpointPolicy,
    GenerationStarted,
    Heartbeat,
    JobId,
    JobSpec,
    Market,
    MarketPolicy,
    NodeId,
    RanksExited,
    StartGenerationCmd,
    StopCmd,
)

__all__ = ["BASE_TS", "GPU", "JOB_ID", "WNode", "World", "WorldResult"]

JOB_ID = JobId("j")

_TERMINAL = frozenset({JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.CANCELLED, JobPhase.STOPPED})


@dataclass(slots=True)
class WorldResult:
    cost_usd: float
    done_ts: float | None  # virtual seconds from the start
    deadline_met: bool
    preemptions: int  # provider preemptions of the job's nodes (noticed or not)
    billed_node_s: float
    useful_s: float
    decisions: int
    phase: str
    od_node_s: float = 0.0
    actions: dict[str, int] = field(default_factory=dict)  # audit "action:reason" -> count
    spot_returns: int = 0  # moves from on-demand back to spot (a spot generation right after an on-demand one)
    timeline: list[tuple[float, str, str]] = field(default_factory=list)  # (t, what, detail)
    progress_log: list[tuple[float, float, str]] = field(default_factory=list)
    # (record) seconds of trace ticks in which a zone had room for the job and no member trained, and of
    # those, the ticks in which every such zone's spot pool was in the core's launch backoff (orchd only)
    idle_capacity_s: float = 0.0
    idle_backoff_s: float = 0.0


class World(CloudModel):
    # whether the consumer of the events reads heartbeats (orchd's core does; a baseline's controller
    # ignores them, and price ticks - ``CloudModel.reads_prices`` -, so they are not built for it)
    reads_heartbeats = True

    def __init__(
        self,
        sc: Scenario,
        job: Job,
        wp: WorldParams | None = None,
        *,
        config: CoreConfig | None = None,
        record: bool = False,
        max_overrun: float = 3.0,
        capacity_hints: bool = True,
        draws: Draws | None = None,
        scores: np.ndarray | None = None,
    ) -> None:
        super().__init__(sc, job, wp or WorldParams(), config=config, record=record, max_overrun=max_overrun,
                         capacity_hints=capacity_hints, draws=draws, scores=scores)
        # the core knows the world's pools, as orchd knows its providers' (registry.known_instance_types)
        known = tuple(sorted({f"{z.cloud}/{z.instance_type}" for z in sc.zones}))
        self.cfg = msgspec.structs.replace(self.cfg, known_instance_types=known)
        if isinstance(self.cfg.decision_interval_s, msgspec.UnsetType):  # the feed's period: one trace tick
            self.cfg = msgspec.structs.replace(self.cfg, decision_interval_s=sc.tick_s)
        if self.wp.decision_step:  # the operator knows the restart overhead r that defines this world
            self.cfg = msgspec.structs.replace(self.cfg, restart_overhead_s=self.wp.restart_s)
        self.state = State.empty(self.cfg)
        # job progress
        self.gen = 0
        self.gen_members: tuple[NodeId, ...] = ()
        self.gen_pending: dict[int, list[StartGenerationCmd]] = {}
        self.training_since: float | None = None
        self.p_base = 0.0  # progress (s) when the current training run started
        self.committed = 0.0
        self.ckpt_region: tuple[str, str] | None = None
        self.ckpt_for_gen: set[int] = set()
        self.interval_s: float | None = None  # periodic checkpoints of the current generation
        self.saving = False  # a periodic save is in flight
        # accounting of the core's decisions
        self.actions: dict[str, int] = {}
        self.done_ts: float | None = None
        self.decisions = 0
        self.progress_log: list[tuple[float, float, str]] = []  # (t, progress_s, idle|spot|od) per tick
        self.idle_capacity_s = 0.0
        self.idle_backoff_s = 0.0
        self.held_events: list[CoreEvent] = []  # decision-step world: events waiting for the next boundary
        self.last_market: Market | None = None  # the market of the last generation's nodes
        self.spot_returns = 0  # generations on spot right after one on on-demand

    # --- progress ------------------------------------------------------------------------------

    def progress(self) -> float:
        if self.training_since is None:
            return self.p_base
        return min(self.work_s, self.p_base + (self.now - self.training_since))

    def stop_training(self) -> float:
        p = self.progress()
        self.training_since = None
        self.p_base = p
        for nid in self.gen_members:
            n = self.nodes.get(nid)
            if n is not None:
                n.training = False
        return p

    def instance_lost(self, n: WNode) -> None:
        if n.node_id in self.gen_members and (n.training or self.training_since is not None):
            self.stop_training()
            self.p_base = self.committed

    # --- the core ------------------------------------------------------------------------------

    def feed(self, ev: CoreEvent) -> None:
        """An event for the policy. In the decision-step world (``WorldParams.decision_step``) the policy
        sees events only at step boundaries: one between them waits for the next boundary, in order."""
        if not self.wp.decision_step:
            self.consume(ev)
            return
        if abs((self.now - BASE_TS) / self.sc.tick_s - round((self.now - BASE_TS) / self.sc.tick_s)) > 1e-9:
            self.held_events.append(ev)
            return
        while self.held_events:
            self.consume(self.held_events.pop(0))
        self.consume(ev)

    def consume(self, ev: CoreEvent) -> None:
        d = decide(self.state, ev, self.now)
        self.decisions += 1
        self.state = d.state
        for a in d.audit:
            key = f"{a.action}:{a.reason}"
            self.actions[key] = self.actions.get(key, 0) + 1
        if self.record:
            for a in d.audit:
                self.timeline.append((self.now - BASE_TS, "core:" + a.action, a.reason))
        for c in d.commands:
            self.execute(c)

    def job_phase(self) -> JobPhase | None:
        j = self.state.jobs.get(JOB_ID)
        return None if j is None else j.phase

    def execute(self, c: Command) -> None:
        if isinstance(c, Launch):
            self.do_launch(c)
        elif isinstance(c, Terminate):
            n = self.nodes.get(c.node_id)
            if n is not None and n.alive:
                self.stop_instance(n)
                if n.node_id in self.gen_members and n.training:
                    self.stop_training()
                    self.p_base = self.committed  # a node stopped without a save: back to the last commit
                self.log("terminate", f"{n.node_id} {n.pool.name} ({c.reason})")
        elif isinstance(c, CheckInstance):
            n = self.nodes.get(c.node_id)
            if n is None or not n.alive:
                self.at(self.now, "core", NodeGone(node_id=c.node_id, instance_id=c.instance_id,
                                                    reason="provider_missing"))
        elif isinstance(c, SendToAgent):
            self.do_agent(c.command)

    def do_agent(self, cmd: AgentCommand) -> None:
        n = self.nodes.get(cmd.node_id)
        if n is None or not n.alive:
            return
        if isinstance(cmd, StartGenerationCmd):
            lst = self.gen_pending.setdefault(cmd.generation, [])
            lst.append(cmd)
            if len(lst) == cmd.nnodes:
                self.start_generation(cmd.generation, lst)
        elif isinstance(cmd, CheckpointCmd | StopCmd):
            if cmd.generation != self.gen or cmd.generation in self.ckpt_for_gen:
                return
            self.ckpt_for_gen.add(cmd.generation)
            p = self.stop_training()
            self.at(self.now + self.wp.save_s, "commit", cmd.generation, p)
            self.log("checkpoint", f"gen {cmd.generation} at {p / 3600:.2f} h ({cmd.reason})")
        elif (
            isinstance(cmd, AbandonGenerationCmd) and cmd.generation == self.gen and n.node_id in self.gen_members
        ):
            if self.training_since is not None or self.p_base > self.committed:
                self.stop_training()
                self.p_base = self.committed
            self.at(self.now, "exit", cmd.generation, n.node_id, "abandoned")

    def start_generation(self, gen: int, cmds: list[StartGenerationCmd]) -> None:
        if self.training_since is not None:
            self.stop_training()
        self.gen = gen
        self.gen_members = tuple(c.node_id for c in sorted(cmds, key=lambda c: c.node_rank))
        first = self.nodes[self.gen_members[0]]
        if self.last_market == Market.ON_DEMAND and first.pool.market == Market.SPOT:
            self.spot_returns += 1
        self.last_market = first.pool.market
        dst = (first.pool.cloud, first.pool.region)
        resume = cmds[0].resume_from is not None
        self.p_base = self.committed if resume else 0.0
        self.interval_s = cmds[0].checkpoint_interval_s
        delay = self.wp.restart_s + (self.migration_s(self.ckpt_region, dst) if resume else 0.0)
        for nid in self.gen_members:
            self.nodes[nid].generation = gen
        self.at(self.now + delay, "gen_started", gen)
        self.log("start_generation", f"gen {gen} on {first.pool.name} from {self.p_base / 3600:.2f} h")

    # --- world events --------------------------------------------------------------------------

    def handle(self, kind: str, data: tuple[Any, ...]) -> None:
        if kind == "core":
            self.feed(data[0])
        elif kind == "tick":
            self.on_tick(data[0])
        elif kind == "gen_started":
            self.generation_started(data[0])
        elif kind == "complete":
            self.complete(data[0])
        elif kind == "commit":
            self.commit(*data)
        elif kind == "exit":
            self.ranks_exit(*data)
        elif kind == "periodic":
            self.periodic(data[0])
        elif kind == "psave":
            self.periodic_commit(*data)
        else:
            self.handle_instance(kind, data)

    def generation_started(self, gen: int) -> None:
        if gen != self.gen or gen in self.ckpt_for_gen or not all(self.nodes[m].alive for m in self.gen_members):
            return  # (a checkpoint ordered before the start: the trainer saves and exits, it does not train)
        self.training_since = self.now
        for m in self.gen_members:
            self.nodes[m].training = True
        self.at(self.now + (self.work_s - self.p_base), "complete", gen)
        if self.interval_s and not self.wp.decision_step:
            self.at(self.now + self.interval_s, "periodic", gen)
        self.feed(GenerationStarted(id=f"g{next(self.msg)}", node_id=self.gen_members[0], job_id=JOB_ID,
                                    generation=gen, first_step=int(self.p_base // self.step_s) + 1, ts=self.now))

    def complete(self, gen: int) -> None:
        if gen != self.gen or self.training_since is None:
            return
        self.stop_training()
        self.done_ts = self.now
        self.log("complete", f"gen {gen}")
        for m in self.gen_members:
            if self.nodes[m].alive:
                self.feed(RanksExited(id=f"x{next(self.msg)}", node_id=m, job_id=JOB_ID, generation=gen,
                                      exit_code=0, reason="completed", last_step=self.total_steps, ts=self.now))

    def periodic(self, gen: int) -> None:
        """The trainer's periodic save: asynchronous, training goes on."""
        if gen != self.gen or self.training_since is None or not self.interval_s:
            return
        if not self.saving:
            self.saving = True
            self.at(self.now + self.wp.save_s, "psave", gen, self.progress())
        self.at(self.now + self.interval_s, "periodic", gen)

    def periodic_commit(self, gen: int, p: float) -> None:
        self.saving = False
        if gen != self.gen or p <= self.committed or not all(self.nodes[m].alive for m in self.gen_members):
            return
        step = int(p // self.step_s)
        if step <= 0:
            return
        self.committed = p
        first = self.nodes[self.gen_members[0]]
        self.ckpt_region = (first.pool.cloud, first.pool.region)
        self.log("checkpoint", f"periodic gen {gen} at {p / 3600:.2f} h")
        self.feed(CheckpointCommitted(id=f"c{next(self.msg)}", node_id=first.node_id, job_id=JOB_ID,
                                      generation=gen, step=step, checkpoint_id=f"s{step}",
                                      url=f"sim://{JOB_ID}/s{step}", save_s=self.wp.save_s, ts=self.now))

    def commit(self, gen: int, p: float) -> None:
        if gen != self.gen or not all(self.nodes[m].alive for m in self.gen_members):
            return  # a member died before the save finished: nothing committed
        first = self.nodes[self.gen_members[0]]
        step = int(p // self.step_s)
        if p > self.committed and step > 0:
            self.committed = p
            self.ckpt_region = (first.pool.cloud, first.pool.region)
            self.feed(CheckpointCommitted(id=f"c{next(self.msg)}", node_id=first.node_id, job_id=JOB_ID,
                                          generation=gen, step=step, checkpoint_id=f"s{step}",
                                          url=f"sim://{JOB_ID}/s{step}", save_s=self.wp.save_s,
                                          emergency=True, ts=self.now))
        for m in self.gen_members:
            self.at(self.now, "exit", gen, m, "emergency_checkpoint")

    def ranks_exit(self, gen: int, nid: NodeId, reason: str) -> None:
        n = self.nodes.get(nid)
        if n is None or not n.alive or gen != self.gen:
            return
        if self.training_since is not None:  # one rank exited: the distributed run stops with it
            self.stop_training()
        n.training = False
        self.feed(RanksExited(id=f"x{next(self.msg)}", node_id=nid, job_id=JOB_ID, generation=gen,
                              exit_code=75, reason=reason, last_step=int(self.p_base // self.step_s), ts=self.now))

    def on_tick(self, k: int) -> None:
        """The market of trace tick ``k`` (CloudModel.market_tick), then liveness and progress, then
        the timer."""
        self.market_tick(k)
        if self.wp.decision_step:
            self.boundary_commit()
        if self.record:
            running = [n for n in self.live.values() if n.training]
            kind = "idle" if not running else ("spot" if running[0].pool.market == Market.SPOT else "od")
            self.progress_log.append((self.now - BASE_TS, self.progress(), kind))
            if not running and self.done_ts is None:
                self.count_idle(k)
        step = int(self.progress() // self.step_s)
        for n in list(self.live.values()):
            if n.alive and n.registered:
                n.hb_seq += 1
                if not self.reads_heartbeats:
                    self.decisions += 1  # counted as fed: the consumer would have ignored it
                    continue
                training = n.training and n.generation == self.gen
                self.feed(Heartbeat(node_id=n.node_id, seq=n.hb_seq, ts=self.now,
                                    state=AgentState.TRAINING if training else AgentState.IDLE, job_id=JOB_ID,
                                    generation=n.generation, step=step if training else 0,
                                    step_time_s=self.step_s if training else None))
        self.feed(Tick())
        self.at(BASE_TS + (k + 1) * self.sc.tick_s, "tick", k + 1)

    def boundary_commit(self) -> None:
        """Decision-step world: the progress of a step whose nodes all lived through it is kept (only the
        step in progress is lost to a preemption), committed at the boundary at no cost."""
        if self.training_since is None or not all(self.nodes[m].alive for m in self.gen_members):
            return
        p = self.progress()
        if p > self.committed and int(p // self.step_s) > 0:
            self.periodic_commit(self.gen, p)

    def count_idle(self, k: int) -> None:
        """(record) A tick without training: count it when some zone has room for the job, and apart
        when every such zone's spot pool is closed to it by the core's launch backoff (``retry_at``: a
        waiting job retries a pool ``wait_probe_s`` after its last failure)."""
        room = self.usable[:, self.trace_t(k)]
        if not room.any():
            return
        self.idle_capacity_s += self.sc.tick_s
        zones = self.zone_of_name
        pools = [ps for ps in self.state.pools.values()
                 if ps.pool.market == Market.SPOT and ps.pool.zone in zones and room[zones[ps.pool.zone]]]
        cfg = self.state.config
        if pools and all(retry_at(ps, cfg, True) > self.now for ps in pools):
            self.idle_backoff_s += self.sc.tick_s

    # --- run -----------------------------------------------------------------------------------

    def spec(self) -> JobSpec:
        n = self.job.nodes
        return JobSpec(
            name="sim", total_steps=self.total_steps, step_time_s_estimate=self.step_s, gpu_type=GPU,
            gpus_per_node=1, nodes=n, nodes_min=n, nodes_max=n, market=MarketPolicy.SPOT_WITH_FALLBACK,
            deadline_ts=self.deadline_ts,
            checkpoint=CheckpointPolicy(url=f"sim://{JOB_ID}"),
        )

    def run(self) -> WorldResult:
        self.on_tick_prices_only()
        self.feed(JobSubmitted(job_id=JOB_ID, spec=self.spec()))
        self.at(BASE_TS, "tick", 0)
        while self.heap:
            ts, _, kind, data = heapq.heappop(self.heap)
            if ts > self.stop_ts:
                break
            self.bill_to(ts)
            self.now = ts
            self.handle(kind, data)
            if self.done_ts is not None or self.job_phase() in _TERMINAL:
                break
        self.bill_to(self.now)
        done = None if self.done_ts is None else self.done_ts - BASE_TS
        phase = self.job_phase()
        return WorldResult(
            cost_usd=self.cost,
            done_ts=done,
            deadline_met=self.done_ts is not None and self.done_ts <= self.deadline_ts + 1e-6,
            preemptions=self.preemptions,
            billed_node_s=self.billed_s,
            useful_s=self.progress() if self.done_ts is None else self.work_s,
            decisions=self.decisions,
            phase=str(phase) if phase is not None else "",
            od_node_s=self.od_s,
            actions=self.actions,
            timeline=self.timeline,
            progress_log=self.progress_log,
            idle_capacity_s=self.idle_capacity_s,
            idle_backoff_s=self.idle_backoff_s,
            spot_returns=self.spot_returns,
        )
