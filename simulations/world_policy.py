"""The baselines in the faithful world: the same clouds, trainer and accounting as orchd.

Role: run an online baseline (``simulations.policies.baselines``) in ``world.World`` instead of the
daemon's core. The World is unchanged (same market, launches, notices, saves, billing and shared
random draws); only ``feed`` differs: the events orchd would receive go to a small controller that
asks the baseline what to run and answers with the commands orchd would send (Launch, Terminate,
StartGenerationCmd, CheckpointCmd).

Controller:
  decide      at every trace tick, and at once after a preemption or a failed launch (the zone that
              failed is off the policy's view for the rest of the tick). The policy sees what it saw
              in the tick engine: its own state and the current tick's capacity of every zone (the
              present, never the future; orchd sees only noisy scores, so this favours the
              baselines) and prices.
  moves       a new deployment is launched at once; the running generation is told to checkpoint
              (the save's time is paid, a save that does not commit loses the work since the last
              commit), its nodes are terminated when their ranks exit, and the new generation starts
              from the last commit when its nodes are up and the old generation has exited.
  notices     the trainer saves on a notice (an emergency checkpoint); the nodes go at the preemption,
              then the policy decides.
  periodic    every ``WorldParams.baseline_checkpoint_interval_s`` (the baselines choose none).

Single-threaded, no I/O.
"""

from __future__ import annotations

import itertools

import numpy as np

from orchestrator.core import CoreEvent
from orchestrator.core.commands import Launch, Terminate
from orchestrator.core.inputs import LaunchFailed, NodeGone, NodeLaunched, Tick
from simulations.engine import IDLE, Job, Modes, Policy, Run, _action
from simulations.overheads import start_table
from simulations.scenario import Scenario
from simulations.world import JOB_ID, World, WorldResult
from simulations.world_cloud import instance_of
from simulations.worldparams import Draws, WorldParams
from wire import (
    CheckpointCmd,
    CheckpointCommitted,
    GenerationStarted,
    Market,
    NodeId,
    NodeRegistered,
    PoolKey,
    PreemptionNotice,
    RanksExited,
    StartGenerationCmd,
)


class PolicyWorld(World):
    reads_heartbeats = False  # ``feed`` ignores Heartbeat and PriceTick: the controller reads the trace
    reads_prices = False

    def __init__(
        self,
        policy: Policy,
        sc: Scenario,
        job: Job,
        wp: WorldParams | None = None,
        *,
        record: bool = False,
        draws: Draws | None = None,
        scores: np.ndarray | None = None,
    ) -> None:
        super().__init__(sc, job, wp, record=record, capacity_hints=False, draws=draws, scores=scores)
        self.policy = policy
        self.modes = Modes(sc)
        ov = self.wp.policy_overheads()
        self.view = Run(sc=sc, job=job, modes=self.modes, ov=ov, ovq=start_table(ov, list(sc.regions), sc.quantum_s),
                        mode=self.modes.FRESH)
        policy.reset(self.view)
        self.ids = itertools.count()
        self.cmd_ids = itertools.count()
        self.dep_mode: int | None = None  # mode of the current deployment (launching or running)
        self.dep_nodes: tuple[NodeId, ...] = ()
        self.dep_gen = 0  # generation running on the deployment (0: none started yet)
        self.old_gen_open = False  # a previous generation is still saving / exiting
        self.old_nodes: tuple[NodeId, ...] = ()
        self.exits: set[NodeId] = set()
        self.next_gen = 0
        self.failed_zones: set[int] = set()
        self.failed_tick = -1
        self.ckpt_url: str | None = None
        self.deciding = False

    # --- the events orchd would get ---------------------------------------------------------------

    def consume(self, ev: CoreEvent) -> None:
        self.decisions += 1
        if isinstance(ev, Tick):
            self.decide()
        elif isinstance(ev, NodeRegistered):
            self.maybe_start()
        elif isinstance(ev, LaunchFailed):
            if ev.node_ids and ev.node_ids[0] in self.dep_nodes:
                k = self.tick_index(self.now)
                if self.failed_tick != k:
                    self.failed_tick, self.failed_zones = k, set()
                self.failed_zones.add(self.zone_of_name[ev.pool.zone])
                self.terminate(self.dep_nodes, "launch_failed")  # the part of a group that did launch
                self.drop_deployment()
                self.decide()
        elif isinstance(ev, PreemptionNotice):
            if ev.node_id in self.dep_nodes and self.dep_gen and self.dep_gen == self.gen:
                self.checkpoint(self.dep_gen, "preemption_notice")
        elif isinstance(ev, NodeGone):
            if ev.node_id in self.dep_nodes:
                self.terminate(self.dep_nodes, "lost")
                self.drop_deployment()
                self.decide()
        elif isinstance(ev, RanksExited):
            self.exited(ev)
        elif isinstance(ev, GenerationStarted | NodeLaunched):
            pass
        elif isinstance(ev, CheckpointCommitted) and ev.step > 0:
            self.ckpt_url = ev.url

    def job_phase(self):  # noqa: ANN201 - no core job: the World's loop ends at completion
        return None

    # --- the controller -------------------------------------------------------------------------

    def current_mode(self) -> int:
        m = self.modes
        if self.dep_mode is not None:
            return self.dep_mode
        if self.ckpt_region is None or self.committed <= 0:
            return m.FRESH
        return m.idle(self.sc.regions.index(self.ckpt_region))

    def decide(self) -> None:
        if self.deciding or self.done_ts is not None:
            return
        self.deciding = True
        try:
            k = self.tick_index(self.now)
            v = self.view
            t = self.trace_t(k)
            col = self.usable[:, t].copy()
            if self.failed_tick == k:
                for z in self.failed_zones:
                    col[z] = False
            v.k, v.t, v.mode, v.p, v.r = k, t, self.current_mode(), int(self.progress() // self.step_s), 0
            v.usable, v.prices = col, self.sc.spot_price[:, t]
            a = _action(self.policy, v, col)
            if a == IDLE:
                if self.dep_mode is not None:
                    self.retire()
                return
            if a == self.dep_mode:
                return
            if self.dep_mode is not None:
                self.retire()
            self.launch(a)
        finally:
            self.deciding = False

    def pool_of(self, a: int) -> tuple[PoolKey, int]:
        m = self.modes
        if a < m.Z:
            return self.pools_spot[a], a
        cloud, region = self.sc.regions[a - m.Z]
        z = next(i for i, zr in enumerate(self.sc.zone_region) if int(zr) == a - m.Z)
        zone = self.sc.zones[z]
        return PoolKey(cloud=cloud, region=region, zone=zone.name, instance_type=zone.instance_type,
                       market=Market.ON_DEMAND), z

    def launch(self, a: int) -> None:
        pool, _ = self.pool_of(a)
        ids = tuple(NodeId(f"b{next(self.ids)}") for _ in range(self.job.nodes))
        self.dep_mode, self.dep_nodes, self.dep_gen = a, ids, 0
        self.do_launch(Launch(job_id=JOB_ID, pool=pool, node_ids=ids, token=f"t{next(self.cmd_ids)}"))

    def drop_deployment(self) -> None:
        self.dep_mode, self.dep_nodes, self.dep_gen = None, (), 0

    def retire(self) -> None:
        """Leave the current deployment: checkpoint its generation first, if one trains."""
        if self.dep_gen and self.dep_gen == self.gen and self.training_since is not None:
            self.old_nodes, self.old_gen_open = self.dep_nodes, True
            self.exits = set()
            self.checkpoint(self.dep_gen, "move")
        else:
            self.terminate(self.dep_nodes, "move")
        self.drop_deployment()

    def checkpoint(self, gen: int, reason: str) -> None:
        for nid in self.gen_members:
            self.do_agent(CheckpointCmd(cmd_id=f"c{next(self.cmd_ids)}", fencing_token=0, node_id=nid,
                                        job_id=JOB_ID, generation=gen, issued_ts=self.now, reason=reason))

    def exited(self, ev: RanksExited) -> None:
        if ev.node_id in self.old_nodes:
            self.exits.add(ev.node_id)
            if self.exits >= set(self.old_nodes):
                self.terminate(self.old_nodes, "moved")
                self.old_nodes, self.old_gen_open = (), False
                self.maybe_start()

    def terminate(self, ids: tuple[NodeId, ...], reason: str) -> None:
        for nid in ids:
            self.execute(Terminate(node_id=nid, instance_id=instance_of(nid), reason=reason))

    def maybe_start(self) -> None:
        if not self.dep_nodes or self.dep_gen or self.done_ts is not None:
            return
        if self.old_gen_open and not all(self.nodes[n].alive for n in self.old_nodes):
            self.old_nodes, self.old_gen_open = (), False  # the old generation died saving
        if self.old_gen_open or not all(self.nodes[n].alive and self.nodes[n].registered for n in self.dep_nodes):
            return
        self.next_gen = max(self.next_gen, self.gen) + 1
        self.dep_gen = self.next_gen
        resume = self.ckpt_url if self.committed > 0 else None
        n = len(self.dep_nodes)
        for rank, nid in enumerate(self.dep_nodes):
            self.do_agent(StartGenerationCmd(
                cmd_id=f"s{next(self.cmd_ids)}", fencing_token=0, node_id=nid, job_id=JOB_ID,
                generation=self.dep_gen, issued_ts=self.now, node_rank=rank, nnodes=n, gpus_per_node=1,
                world_size=n, master_addr=str(self.dep_nodes[0]), master_port=29500, resume_from=resume,
                checkpoint_url=f"sim://{JOB_ID}", total_steps=self.total_steps,
                checkpoint_interval_s=self.wp.baseline_checkpoint_interval_s))

    def instance_lost(self, n) -> None:  # noqa: ANN001
        super().instance_lost(n)
        if n.node_id in self.old_nodes:
            self.old_nodes, self.old_gen_open = (), False
            self.maybe_start()


def run_policy_job(policy: Policy, sc: Scenario, job: Job, wp: WorldParams | None = None, *,
                   draws: Draws | None = None, scores: np.ndarray | None = None, record: bool = False) -> WorldResult:
    r = PolicyWorld(policy, sc, job, wp, draws=draws, scores=scores, record=record).run()
    if r.done_ts is not None:
        r.phase = "succeeded"
    return r
