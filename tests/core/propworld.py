"""A small world for the core's liveness and deadline properties (tests/core/test_policy_properties.py,
benchmarks/properties.py): a cloud that launches (or refuses to), agents that train one step per second
when every member of the generation runs, commit periodic and emergency checkpoints and obey
checkpoint/abandon orders, spot capacity that comes and goes per pool, and orchd restarts (the state is
re-loaded from its records)."""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.core import CoreConfig, JobPhase, NodePhase, State, decide, state_from_records, state_to_records
from orchestrator.core.commands import Launch, SendToAgent, Terminate
from orchestrator.core.inputs import LaunchFailed, NodeGone, NodeLaunched, Tick
from orchestrator.core.model import Job
from tests.core.harness import pool, price
from wire import (
    AbandonGenerationCmd,
    AgentState,
    CheckpointCmd,
    CheckpointCommitted,
    FailureReason,
    GenerationStarted,
    Heartbeat,
    Market,
    NodeRegistered,
    PoolKey,
    PreemptionNotice,
    RanksExited,
    StartGenerationCmd,
)

SPOT = [pool("p4d.24xlarge", z) for z in ("a", "b")]
OD_PRICE = 30.0
JOB = "j"
BOOT_S = 20.0  # launch -> registered in this world
# the core's estimates at or above this world's physics (boot 22 s, restart 1 s, save 3 s)
CONFIG = CoreConfig(
    boot_s_estimate=30.0, restart_overhead_s=5.0, launch_timeout_s=120.0, backoff_base_s=10.0,
    backoff_max_s=120.0, checkpoint_timeout_s=60.0, price_confirm_s=5.0, ckpt_interval_min_s=60.0,
    ckpt_interval_max_s=300.0,
)
TRAINING = frozenset({JobPhase.STARTING, JobPhase.RUNNING, JobPhase.CHECKPOINTING, JobPhase.RECOVERING})
ACTIVE = TRAINING | {JobPhase.PENDING, JobPhase.PLACING, JobPhase.RESIZING}


def od(pk: PoolKey) -> str:
    return PoolKey(cloud=pk.cloud, region=pk.region, zone=pk.zone, instance_type=pk.instance_type,
                   market=Market.ON_DEMAND).name


@dataclass
class World:
    config: CoreConfig = CONFIG
    state: State = field(init=False)
    now: float = 1000.0
    queue: list[tuple[float, int, object]] = field(default_factory=list)
    running: dict[str, tuple[int, int, float]] = field(default_factory=dict)  # node -> (gen, step, interval)
    dead: set[str] = field(default_factory=set)
    fail_launches: bool = False  # every launch fails (capacity)
    spot_down: set[str] = field(default_factory=set)  # spot pools without capacity
    seq: int = 0
    restarts: int = 0

    def __post_init__(self) -> None:
        self.state = State.empty(self.config)

    def eid(self) -> str:
        self.seq += 1
        return f"e{self.seq}"

    def later(self, dt: float, ev: object) -> None:
        self.seq += 1
        self.queue.append((self.now + dt, self.seq, ev))

    def feed(self, ev: object) -> None:
        d = decide(self.state, ev, self.now)
        self.state = d.state
        for c in d.commands:
            self.execute(c)

    def restart(self) -> None:
        """orchd restarts: the state is whatever its records say."""
        self.state = state_from_records(state_to_records(self.state))
        self.restarts += 1

    def execute(self, c: object) -> None:
        if isinstance(c, Launch):
            down = c.pool.market == Market.SPOT and c.pool.name in self.spot_down
            if self.fail_launches or down:
                self.later(2, LaunchFailed(node_ids=c.node_ids, job_id=c.job_id, pool=c.pool, token=c.token,
                                           reason=FailureReason.CAPACITY))
                return
            for nid in c.node_ids:
                self.later(2, NodeLaunched(node_id=nid, job_id=c.job_id, instance_id=f"i-{nid}", pool=c.pool,
                                           token=c.token))
                self.later(BOOT_S, NodeRegistered(id=self.eid(), node_id=nid, host=f"h-{nid}", ts=0))
        elif isinstance(c, Terminate):
            self.dead.add(c.node_id)
            self.running.pop(c.node_id, None)
        elif isinstance(c, SendToAgent):
            self.agent(c.command)

    def agent(self, cmd: object) -> None:
        nid = getattr(cmd, "node_id", "")
        if nid in self.dead:
            return
        if isinstance(cmd, StartGenerationCmd):
            resume = int(cmd.resume_from[1:]) if cmd.resume_from else 0
            self.running[nid] = (cmd.generation, resume, cmd.checkpoint_interval_s)
            self.later(1, GenerationStarted(id=self.eid(), node_id=nid, job_id=JOB, generation=cmd.generation,
                                            first_step=resume + 1, ts=0))
        elif isinstance(cmd, CheckpointCmd) and nid in self.running:
            gen, step, _ = self.running.pop(nid)
            self.later(3, CheckpointCommitted(id=self.eid(), node_id=nid, job_id=JOB, generation=gen, step=step,
                                              checkpoint_id=f"s{step}", url=f"s{step}", save_s=3.0, emergency=True,
                                              ts=0))
            self.later(4, RanksExited(id=self.eid(), node_id=nid, job_id=JOB, generation=gen, exit_code=75,
                                      reason="emergency_checkpoint", last_step=step, ts=0))
        elif isinstance(cmd, AbandonGenerationCmd) and nid in self.running:
            gen, step, _ = self.running.pop(nid)
            self.later(1, RanksExited(id=self.eid(), node_id=nid, job_id=JOB, generation=gen, exit_code=77,
                                      reason="abandoned", last_step=step, ts=0))

    def live_spot(self, pool_name: str | None = None) -> list[str]:
        return sorted(n for n, x in self.state.nodes.items()
                      if x.phase in (NodePhase.REGISTERED, NodePhase.RUNNING) and n not in self.dead
                      and x.pool.market == Market.SPOT and (pool_name is None or x.pool_name == pool_name))

    def notice(self, nid: str, notice_s: float = 30.0) -> None:
        self.feed(PreemptionNotice(id=self.eid(), node_id=nid, cloud="gcp", deadline_ts=self.now + notice_s,
                                   observed_ts=self.now))
        self.later(notice_s, ("kill", nid))

    def vanish(self, nid: str) -> None:
        self.running.pop(nid, None)
        self.dead.add(nid)
        self.later(15, NodeGone(node_id=nid, reason="provider_missing"))

    def set_prices(self, usd: dict[str, float]) -> None:
        for pk in SPOT:
            self.feed(price(pk, usd.get(pk.name, 8.0), od=OD_PRICE, ts=self.now))

    def second(self) -> None:
        self.now += 1.0
        due = sorted(q for q in self.queue if q[0] <= self.now)
        self.queue = [q for q in self.queue if q[0] > self.now]
        for _, _, ev in due:
            if isinstance(ev, tuple):  # a noticed node dies at its deadline
                self.running.pop(ev[1], None)
                self.dead.add(ev[1])
                self.later(5, NodeGone(node_id=ev[1], reason="provider_terminated"))
            else:
                self.feed(ev)
        job = self.state.jobs.get(JOB)
        if job is None:
            return
        self.train(job)
        if int(self.now) % 2 == 0:
            for nid, node in sorted(self.state.nodes.items()):
                if node.phase in (NodePhase.REGISTERED, NodePhase.RUNNING, NodePhase.NOTICED) and nid not in self.dead:
                    g, s, _ = self.running.get(nid, (node.generation, 0, 0.0))
                    st = AgentState.TRAINING if nid in self.running else AgentState.IDLE
                    self.feed(Heartbeat(node_id=nid, seq=int(self.now), ts=self.now, state=st, job_id=JOB,
                                        generation=g, step=s, step_time_s=1.0))
            self.feed(Tick())

    def train(self, job: Job) -> None:
        """All ranks of the generation step together (1 step/s) while every member runs; rank 0 commits
        every checkpoint interval; at total_steps every rank exits 0."""
        gen = job.generation
        members = [n for n in job.gen_nodes if n in self.running and self.running[n][0] == gen]
        alive = len(job.gen_nodes) - len(job.gen_exited)
        if job.phase != JobPhase.RUNNING or not members or len(members) != alive:
            return
        total = job.spec.total_steps
        for n in members:
            g, s, iv = self.running[n]
            self.running[n] = (g, s + 1, iv)
        g, step, iv = self.running[members[0]]
        if iv > 0 and step % max(int(iv), 1) == 0 and step < total:
            self.feed(CheckpointCommitted(id=self.eid(), node_id=members[0], job_id=JOB, generation=g, step=step,
                                          checkpoint_id=f"s{step}", url=f"s{step}", save_s=3.0, emergency=False,
                                          ts=0))
        if step >= total:
            for n in members:
                self.running.pop(n)
                self.later(0.5, RanksExited(id=self.eid(), node_id=n, job_id=JOB, generation=g, exit_code=0,
                                            reason="completed", last_step=step, ts=0))
