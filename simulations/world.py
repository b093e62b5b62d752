"""A discrete-event world in virtual time that drives the daemon's own decision core.

Role: play the clouds, the agents and the trainer for ONE job around ``orchestrator.core.decide``,
from a trace scenario, so that the ``orchd`` policy in the simulator is the daemon's code and nothing
else. The world feeds the core exactly the events the shell would, and executes the commands it
returns:

  market      PriceTick per zone's spot pool at each trace tick where its price or capacity changed
              (capacity_hint 1/0 from the trace: what a placement score would say; the baselines see
              the same current-tick capacity; ``capacity_hints=False`` sends none, so the core learns
              capacity from LaunchFailed only); the on-demand pool of each zone rides on it.
  Launch      spot: NodeLaunched at once when the zone has room for the nodes in this tick, else
              LaunchFailed(capacity); on-demand always succeeds. NodeRegistered after launch_delay_s.
  StartGenerationCmd   GenerationStarted after restart_s (+ region/cloud migration when the
              checkpoint is elsewhere); training then runs at one step per step_time_s.
  CheckpointCmd        training stops; CheckpointCommitted after checkpoint_s (if every member is
              still alive), then RanksExited(emergency_checkpoint) from each member.
  AbandonGenerationCmd RanksExited(abandoned); progress falls back to the last commit.
  Terminate   billing stops. CheckInstance: NodeGone when the instance is dead.
  preemption  when the trace's capacity of a zone drops below the job's nodes there: a
              PreemptionNotice notice_s before the tick boundary, then NodeGone at it.
  timers      before every Tick (one per trace tick) a Heartbeat per registered node carrying the
              trained step: progress at trace-step granularity, never one event per second.

Virtual time jumps from event to event (a heap). Cost is integrated per node from NodeLaunched to
Terminate/preemption at the tick's price; the same ``Overheads`` constants as the tick engine are
used (launch, restart, save, notice, migration), but here they overlap the way they do in reality
(e.g. the replacement boots while the old node saves), so this accounting is the world's own.

Single-threaded, no I/O; one World per job (the core's state is per daemon).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field

from orchestrator.core import CoreConfig, JobPhase, State, decide
from orchestrator.core.commands import CheckInstance, Launch, SendToAgent, Terminate
from orchestrator.core.inputs import JobSubmitted, LaunchFailed, NodeGone, NodeLaunched, Tick
from wire import (
    AbandonGenerationCmd,
    AgentState,
    CheckpointCmd,
    CheckpointCommitted,
    CheckpointPolicy,
    FailureReason,
    GenerationStarted,
    Heartbeat,
    JobSpec,
    Market,
    MarketPolicy,
    NodeRegistered,
    PoolKey,
    PreemptionNotice,
    PriceTick,
    RanksExited,
    StartGenerationCmd,
    StopCmd,
)
from simulations.engine import Job
from simulations.overheads import Overheads
from simulations.scenario import Scenario

BASE_TS = 1_000_000.0  # virtual epoch of a job's start (avoid 0 in the core's arithmetic)
GPU = "gpu"
JOB_ID = "j"

_TERMINAL = frozenset({JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.CANCELLED, JobPhase.STOPPED})


@dataclass(slots=True)
class WNode:
    node_id: str
    pool: PoolKey
    zone: int
    launched: float | None = None  # billing starts (NodeLaunched)
    alive: bool = True
    registered: bool = False
    generation: int = 0
    training: bool = False
    hb_seq: int = 0
    doomed_at: float | None = None  # notice scheduled for a death at this time
    noticed: bool = False  # the notice was delivered


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
    timeline: list[tuple[float, str, str]] = field(default_factory=list)  # (t, what, detail)
    progress_log: list[tuple[float, float, str]] = field(default_factory=list)


class World:
    def __init__(
        self,
        sc: Scenario,
        job: Job,
        ov: Overheads,
        *,
        config: CoreConfig | None = None,
        record: bool = False,
        max_overrun: float = 3.0,
        capacity_hints: bool = True,
    ) -> None:
        self.sc, self.job, self.ov = sc, job, ov
        self.capacity_hints = capacity_hints
        self.record = record
        self.cfg = config or CoreConfig()
        self.state = State.empty(self.cfg)
        self.heap: list[tuple[float, int, str, tuple]] = []
        self.seq = itertools.count()
        self.now = BASE_TS
        self.step_s = sc.quantum_s
        self.work_s = job.work_q * sc.quantum_s
        self.total_steps = job.work_q
        self.deadline_ts = BASE_TS + job.deadline_ticks * sc.tick_s
        self.stop_ts = BASE_TS + max(job.deadline_ticks * sc.tick_s * max_overrun, self.work_s * 4)
        self.usable = sc.usable(job.nodes)
        self.nodes: dict[str, WNode] = {}  # every node ever launched (lookups)
        self.live: dict[str, WNode] = {}  # alive ones (iteration)
        self.pools_spot = [
            PoolKey(cloud=z.cloud, region=z.region, zone=z.name, instance_type=z.instance_type, market=Market.SPOT)
            for z in sc.zones
        ]
        self.zone_of_name = {z.name: i for i, z in enumerate(sc.zones)}
        self.last_hint: list[tuple[float, float] | None] = [None] * len(sc.zones)
        # job progress
        self.gen = 0
        self.gen_members: tuple[str, ...] = ()
        self.gen_pending: dict[int, list[StartGenerationCmd]] = {}
        self.training_since: float | None = None
        self.p_base = 0.0  # progress (s) when the current training run started
        self.committed = 0.0
        self.ckpt_region: tuple[str, str] | None = None
        self.ckpt_for_gen: set[int] = set()
        # accounting
        self.cost = 0.0
        self.billed_s = 0.0
        self.od_s = 0.0
        self.actions: dict[str, int] = {}
        self.bill_ts = BASE_TS
        self.preemptions = 0
        self.done_ts: float | None = None
        self.decisions = 0
        self.timeline: list[tuple[float, str, str]] = []
        self.progress_log: list[tuple[float, float, str]] = []  # (t, progress_s, idle|spot|od) per tick
        self.msg = itertools.count()

    # --- time and trace ------------------------------------------------------------------------

    def tick_index(self, ts: float) -> int:
        return int(math.floor((ts - BASE_TS) / self.sc.tick_s + 1e-9))

    def trace_t(self, k: int) -> int:
        return (self.job.start_tick + k) % self.sc.n_ticks

    def price(self, node: WNode, k: int) -> float:
        if node.pool.market == Market.SPOT:
            return float(self.sc.spot_price[node.zone, self.trace_t(k)])
        return float(self.sc.od_price[self.sc.zone_region[node.zone]])

    def capacity(self, z: int, k: int) -> int:
        return int(self.sc.avail[z, self.trace_t(k)])

    def at(self, ts: float, kind: str, *data) -> None:
        heapq.heappush(self.heap, (ts, next(self.seq), kind, data))

    def log(self, what: str, detail: str) -> None:
        if self.record:
            self.timeline.append((self.now - BASE_TS, what, detail))

    # --- accounting ----------------------------------------------------------------------------

    def bill_to(self, ts: float) -> None:
        """Integrate node cost from bill_ts to ts (prices change only at tick boundaries)."""
        t = self.bill_ts
        while t < ts:
            k = self.tick_index(t)
            end = min(ts, BASE_TS + (k + 1) * self.sc.tick_s)
            dt = end - t
            for n in self.live.values():
                if n.launched is not None:
                    self.cost += self.price(n, k) * dt / 3600.0
                    self.billed_s += dt
                    if n.pool.market != Market.SPOT:
                        self.od_s += dt
            t = end
        self.bill_ts = ts

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

    # --- the core ------------------------------------------------------------------------------

    def feed(self, ev) -> None:
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

    def execute(self, c) -> None:
        if isinstance(c, Launch):
            self.do_launch(c)
        elif isinstance(c, Terminate):
            n = self.nodes.get(c.node_id)
            if n is not None and n.alive:
                n.alive = False
                self.live.pop(n.node_id, None)
                if n.node_id in self.gen_members and n.training:
                    self.stop_training()
                self.log("terminate", f"{n.node_id} {n.pool.name} ({c.reason})")
        elif isinstance(c, CheckInstance):
            n = self.nodes.get(c.node_id)
            if n is None or not n.alive:
                self.at(self.now, "core", NodeGone(node_id=c.node_id, instance_id=c.instance_id,
                                                    reason="provider_missing"))
        elif isinstance(c, SendToAgent):
            self.do_agent(c.command)

    def do_launch(self, c: Launch) -> None:
        z = self.zone_of_name.get(c.pool.zone)
        ids = list(c.node_ids)
        ok = ids
        if z is None:
            ok = []
        elif c.pool.market == Market.SPOT:
            k = self.tick_index(self.now)
            used = sum(1 for n in self.live.values() if n.zone == z and n.pool.market == Market.SPOT)
            room = self.capacity(z, k) - used if self.usable[z, self.trace_t(k)] else 0
            ok = ids[: max(0, room)]
        failed = ids[len(ok):]
        k = self.tick_index(self.now)
        doomed = (
            c.pool.market == Market.SPOT and z is not None
            and not self.usable[z, self.trace_t(k + 1)]
        )
        for nid in ok:
            n = WNode(nid, c.pool, z, launched=self.now)
            self.nodes[nid] = n
            self.live[nid] = n
            if doomed:  # launched into a zone that loses its capacity at the next boundary
                death = BASE_TS + (k + 1) * self.sc.tick_s
                n.doomed_at = death
                self.at(max(self.now, death - self.ov.notice_s), "notice", nid, death)
                self.at(death, "death", nid)
            self.at(self.now, "core", NodeLaunched(node_id=nid, job_id=c.job_id, instance_id=f"i-{nid}",
                                                   pool=c.pool, token=c.token))
            self.at(self.now + self.ov.launch_delay_s, "registered", nid)
        if ok:
            self.log("launch", f"{len(ok)} x {c.pool.name}")
        if failed:
            self.log("launch_failed", c.pool.name)
            self.at(self.now, "core", LaunchFailed(node_ids=tuple(failed), job_id=c.job_id, pool=c.pool,
                                                   token=c.token, reason=FailureReason.CAPACITY))

    def do_agent(self, cmd) -> None:
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
            self.at(self.now + self.ov.checkpoint_s, "commit", cmd.generation, p)
            self.log("checkpoint", f"gen {cmd.generation} at {p / 3600:.2f} h ({getattr(cmd, 'reason', '')})")
        elif isinstance(cmd, AbandonGenerationCmd):
            if cmd.generation == self.gen and n.node_id in self.gen_members:
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
        dst = (first.pool.cloud, first.pool.region)
        resume = cmds[0].resume_from is not None
        self.p_base = self.committed if resume else 0.0
        delay = self.ov.restart_s + (self.ov.migration_s(self.ckpt_region, dst) if resume else 0.0)
        for nid in self.gen_members:
            self.nodes[nid].generation = gen
        self.at(self.now + delay, "gen_started", gen)
        self.log("start_generation", f"gen {gen} on {first.pool.name} from {self.p_base / 3600:.2f} h")

    # --- world events --------------------------------------------------------------------------

    def handle(self, kind: str, data: tuple) -> None:
        if kind == "core":
            self.feed(data[0])
        elif kind == "tick":
            self.on_tick(data[0])
        elif kind == "registered":
            n = self.nodes.get(data[0])
            if n is not None and n.alive:
                n.registered = True
                self.feed(NodeRegistered(id=f"r{next(self.msg)}", node_id=n.node_id, instance_id=f"i-{n.node_id}",
                                         pool=n.pool, host=n.node_id, ts=self.now))
        elif kind == "gen_started":
            gen = data[0]
            if gen != self.gen or not all(self.nodes[m].alive for m in self.gen_members):
                return
            self.training_since = self.now
            for m in self.gen_members:
                self.nodes[m].training = True
            self.at(self.now + (self.work_s - self.p_base), "complete", gen)
            self.feed(GenerationStarted(id=f"g{next(self.msg)}", node_id=self.gen_members[0], job_id=JOB_ID,
                                        generation=gen, first_step=int(self.p_base // self.step_s) + 1, ts=self.now))
        elif kind == "complete":
            gen = data[0]
            if gen != self.gen or self.training_since is None:
                return
            self.stop_training()
            self.done_ts = self.now
            self.log("complete", f"gen {gen}")
            for m in self.gen_members:
                if self.nodes[m].alive:
                    self.feed(RanksExited(id=f"x{next(self.msg)}", node_id=m, job_id=JOB_ID, generation=gen,
                                          exit_code=0, reason="completed", last_step=self.total_steps, ts=self.now))
        elif kind == "commit":
            gen, p = data
            if gen != self.gen or not all(self.nodes[m].alive for m in self.gen_members):
                return  # a member died before the save finished: nothing committed
            self.committed = p
            first = self.nodes[self.gen_members[0]]
            self.ckpt_region = (first.pool.cloud, first.pool.region)
            step = int(p // self.step_s)
            self.feed(CheckpointCommitted(id=f"c{next(self.msg)}", node_id=first.node_id, job_id=JOB_ID,
                                          generation=gen, step=step, checkpoint_id=f"s{step}",
                                          url=f"sim://{JOB_ID}/s{step}", save_s=self.ov.checkpoint_s,
                                          emergency=True, ts=self.now))
            for m in self.gen_members:
                self.at(self.now, "exit", gen, m, "emergency_checkpoint")
        elif kind == "exit":
            gen, nid, reason = data
            n = self.nodes.get(nid)
            if n is None or not n.alive or gen != self.gen:
                return
            n.training = False
            self.feed(RanksExited(id=f"x{next(self.msg)}", node_id=nid, job_id=JOB_ID, generation=gen,
                                  exit_code=75, reason=reason, last_step=int(self.p_base // self.step_s), ts=self.now))
        elif kind == "notice":
            n = self.nodes.get(data[0])
            if n is not None and n.alive:
                n.noticed = True
                self.preemptions += 1
                self.feed(PreemptionNotice(id=f"n{next(self.msg)}", node_id=n.node_id, cloud=n.pool.cloud,
                                           deadline_ts=data[1], observed_ts=self.now))
        elif kind == "death":
            n = self.nodes.get(data[0])
            if n is not None and n.alive:
                self.kill(n)

    def kill(self, n: WNode) -> None:
        n.alive = False
        self.live.pop(n.node_id, None)
        if not n.noticed:
            self.preemptions += 1  # noticed nodes were counted at their notice
        self.log("preempted", f"{n.node_id} {n.pool.name}")
        if n.node_id in self.gen_members and n.training:
            self.stop_training()
            self.p_base = self.committed
        self.feed(NodeGone(node_id=n.node_id, instance_id=f"i-{n.node_id}", reason="provider_terminated"))

    def spot_by_zone(self) -> dict[int, list[WNode]]:
        out: dict[int, list[WNode]] = {}
        for n in self.live.values():
            if n.pool.market == Market.SPOT:
                out.setdefault(n.zone, []).append(n)
        return out

    def on_tick(self, k: int) -> None:
        t = self.trace_t(k)
        # market first (prices and capacity of this tick; only pools that changed), so that decisions
        # taken on the preemptions below already see the new capacity
        prices = self.sc.spot_price[:, t]
        hints = self.usable[:, t]
        for z, pk in enumerate(self.pools_spot):
            price = float(prices[z])
            hint = 1.0 if hints[z] else 0.0
            if self.last_hint[z] != (price, hint):
                self.last_hint[z] = (price, hint)
                od = float(self.sc.od_price[self.sc.zone_region[z]])
                self.feed(PriceTick(id=f"p{next(self.msg)}", pool=pk, gpu_type=GPU, gpus_per_node=1,
                                    price_usd_h=price if math.isfinite(price) else od, on_demand_usd_h=od,
                                    capacity_hint=hint if self.capacity_hints else None, ts=self.now))
        # then preemptions at this boundary (nodes whose zone lost capacity; noticed ones already know)
        for z, spot in self.spot_by_zone().items():
            cap = self.capacity(z, k) if self.usable[z, t] else 0
            for n in spot[cap:] if cap < len(spot) else ():
                self.kill(n)
        # notices for the next boundary
        nxt = self.trace_t(k + 1)
        death = self.now + self.sc.tick_s
        for z, spot in self.spot_by_zone().items():
            cap = self.capacity(z, k + 1) if self.usable[z, nxt] else 0
            for n in spot[cap:] if cap < len(spot) else ():
                if n.doomed_at != death:
                    n.doomed_at = death
                    self.at(max(self.now, death - self.ov.notice_s), "notice", n.node_id, death)
                    self.at(death, "death", n.node_id)
        # liveness and progress, then the timer
        if self.record:
            running = [n for n in self.live.values() if n.training]
            kind = "idle" if not running else ("spot" if running[0].pool.market == Market.SPOT else "od")
            self.progress_log.append((self.now - BASE_TS, self.progress(), kind))
        step = int(self.progress() // self.step_s)
        for n in list(self.live.values()):
            if n.alive and n.registered:
                n.hb_seq += 1
                training = n.training and n.generation == self.gen
                self.feed(Heartbeat(node_id=n.node_id, seq=n.hb_seq, ts=self.now,
                                    state=AgentState.TRAINING if training else AgentState.IDLE, job_id=JOB_ID,
                                    generation=n.generation, step=step if training else 0,
                                    step_time_s=self.step_s if training else None))
        self.feed(Tick())
        self.at(BASE_TS + (k + 1) * self.sc.tick_s, "tick", k + 1)

    # --- run -----------------------------------------------------------------------------------

    def spec(self) -> JobSpec:
        n = self.job.nodes
        return JobSpec(
            name="sim", total_steps=self.total_steps, step_time_s_estimate=self.step_s, gpu_type=GPU,
            gpus_per_node=1, nodes=n, nodes_min=n, nodes_max=n, market=MarketPolicy.SPOT_WITH_FALLBACK,
            deadline_ts=self.deadline_ts,
            checkpoint=CheckpointPolicy(url=f"sim://{JOB_ID}", save_s_estimate=self.ov.checkpoint_s),
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
        )

    def on_tick_prices_only(self) -> None:
        """Prices before the job is submitted (the daemon knows the market when a job arrives)."""
        t = self.trace_t(0)
        for z, pk in enumerate(self.pools_spot):
            price = float(self.sc.spot_price[z, t])
            hint = 1.0 if self.usable[z, t] else 0.0
            od = float(self.sc.od_price[self.sc.zone_region[z]])
            self.last_hint[z] = (price, hint)
            self.feed(PriceTick(id=f"p{next(self.msg)}", pool=pk, gpu_type=GPU, gpus_per_node=1,
                                price_usd_h=price if math.isfinite(price) else od, on_demand_usd_h=od,
                                capacity_hint=hint if self.capacity_hints else None, ts=self.now))
