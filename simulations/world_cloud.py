"""The clouds of the faithful world: market, instances, billing and virtual time for one job.

Role: the half of a world that plays the providers, from a trace scenario and the shared random
draws (``simulations.worldparams``); every policy's job driver (``world.World`` for orchd,
``world_policy.PolicyWorld`` for the baselines) subclasses it, so all of them are charged by the same
code and meet the same draws:

  market      PriceTick per zone's spot pool at each trace tick where its price or capacity score
              changed, and again at the next trace tick (a fresh quote, as a polling feed gives: the
              core confirms a price only on a second observation, confirm.py); the score is a noisy
              placement-like score in [0.1, 1.0] from past ticks only (``capacity_hints=False`` sends
              none). The on-demand pool of each zone rides on it.
  Launch      spot: NodeLaunched when the zone has room for the nodes in this tick and the shared
              capacity-error draw lets it through, else LaunchFailed(capacity); on-demand always
              succeeds. NodeRegistered after a launch delay sampled from the shared draws.
  preemption  when the trace's capacity of a zone drops below the job's nodes there: a
              PreemptionNotice the cloud's notice length before the tick boundary (none for the
              share of preemptions drawn "without notice"), then NodeGone at it. Times are exact
              seconds of virtual time.
  billing     cost is integrated per node from NodeLaunched to Terminate/preemption at the tick's price.

Virtual time jumps from event to event (a heap of ``(ts, seq, kind, data)``). The hooks ``feed``,
``instance_lost`` and ``notice`` are the job driver's side.

Single-threaded, no I/O.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from orchestrator.core import CoreConfig, CoreEvent
from orchestrator.core.commands import Launch
from orchestrator.core.inputs import LaunchFailed, NodeGone, NodeLaunched
from simulations.engine import Job
from simulations.scenario import Scenario
from simulations.worldparams import Draws, WorldParams, capacity_scores
from wire import (
    FailureReason,
    InstanceId,
    Market,
    NodeId,
    NodeRegistered,
    PoolKey,
    PreemptionNotice,
    PriceTick,
)

BASE_TS = 1_000_000.0  # virtual epoch of a job's start (avoid 0 in the core's arithmetic)
GPU = "gpu"


def instance_of(node_id: str) -> InstanceId:
    """The simulated instance id of a node."""
    return InstanceId(f"i-{node_id}")


@dataclass(slots=True)
class WNode:
    node_id: NodeId
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


class CloudModel:
    """Market, instances, billing and the event heap of one job's world (see the module docstring)."""

    def __init__(
        self,
        sc: Scenario,
        job: Job,
        wp: WorldParams,
        *,
        config: CoreConfig | None,
        record: bool,
        max_overrun: float,
        capacity_hints: bool,
        draws: Draws | None = None,
        scores: np.ndarray | None = None,
    ) -> None:
        self.sc, self.job, self.wp = sc, job, wp
        self.capacity_hints = capacity_hints
        self.draws = draws if draws is not None else Draws.make(len(sc.zones), sc.n_ticks, wp)
        self.launch_tries: dict[tuple[int, int], int] = {}  # (zone or -1, tick) -> launches so far
        self.record = record
        self.cfg = config or CoreConfig()
        self.heap: list[tuple[float, int, str, tuple[Any, ...]]] = []
        self.seq = itertools.count()
        self.now = BASE_TS
        # read on every event: plain attributes (``Scenario.n_ticks`` is a property)
        self._n_ticks = sc.n_ticks
        self._start_tick = job.start_tick
        self._tick_s = sc.tick_s
        self._od_usd = [float(sc.od_price[sc.zone_region[z]]) for z in range(len(sc.zones))]
        self.step_s = sc.quantum_s
        self.work_s = job.work_q * sc.quantum_s
        self.total_steps = job.work_q
        self.deadline_ts = BASE_TS + job.deadline_ticks * sc.tick_s
        self.stop_ts = BASE_TS + max(job.deadline_ticks * sc.tick_s * max_overrun, self.work_s * 4)
        self.usable = sc.usable(job.nodes)
        self.scores = scores if scores is not None else capacity_scores(self.usable, wp)
        self.nodes: dict[str, WNode] = {}  # every node ever launched (lookups)
        self.live: dict[str, WNode] = {}  # alive ones (iteration)
        self.pools_spot = [
            PoolKey(cloud=z.cloud, region=z.region, zone=z.name, instance_type=z.instance_type, market=Market.SPOT)
            for z in sc.zones
        ]
        self.zone_of_name = {z.name: i for i, z in enumerate(sc.zones)}
        self.last_hint: list[tuple[float, float] | None] = [None] * len(sc.zones)
        self.requote = [False] * len(sc.zones)  # quoted a change at the last trace tick: quote it again
        # accounting
        self.cost = 0.0
        self.billed_s = 0.0
        self.od_s = 0.0
        self.bill_ts = BASE_TS
        self.preemptions = 0
        self.decisions = 0  # events fed to the consumer (orchd: decide() calls)
        self.timeline: list[tuple[float, str, str]] = []
        self.msg = itertools.count()

    # --- the job driver's side -----------------------------------------------------------------

    def feed(self, ev: CoreEvent) -> None:
        raise NotImplementedError

    def instance_lost(self, n: WNode) -> None:
        """``n`` died under the job (after it is marked dead, before NodeGone is fed)."""
        raise NotImplementedError

    def notice(self, n: WNode, death_ts: float) -> None:
        """A preemption notice for ``n`` (default: the agent forwards it to orchd)."""
        self.feed(PreemptionNotice(id=f"n{next(self.msg)}", node_id=n.node_id, cloud=n.pool.cloud,
                                   deadline_ts=death_ts, observed_ts=self.now))

    # --- time and trace ------------------------------------------------------------------------

    def tick_index(self, ts: float) -> int:
        return int(math.floor((ts - BASE_TS) / self._tick_s + 1e-9))

    def trace_t(self, k: int) -> int:
        return (self._start_tick + k) % self._n_ticks

    def price(self, node: WNode, k: int) -> float:
        if node.pool.market == Market.SPOT:
            return float(self.sc.spot_price[node.zone, (self._start_tick + k) % self._n_ticks])
        return self._od_usd[node.zone]

    def capacity(self, z: int, k: int) -> int:
        return int(self.sc.avail[z, self.trace_t(k)])

    def migration_s(self, src: tuple[str, str] | None, dst: tuple[str, str]) -> float:
        """Extra seconds to move the checkpoint from ``src`` to ``dst`` ((cloud, region) pairs)."""
        if src is None or src == dst:
            return 0.0
        return self.wp.cloud_migration_s if src[0] != dst[0] else self.wp.region_migration_s

    def at(self, ts: float, kind: str, *data: Any) -> None:
        heapq.heappush(self.heap, (ts, next(self.seq), kind, data))

    def log(self, what: str, detail: str) -> None:
        if self.record:
            self.timeline.append((self.now - BASE_TS, what, detail))

    # --- accounting ----------------------------------------------------------------------------

    def bill_to(self, ts: float) -> None:
        """Integrate node cost from bill_ts to ts (prices change only at tick boundaries). The same sums in
        the same order as a walk over every segment; segments with no billed node add nothing."""
        t = self.bill_ts
        if t < ts:
            billed = [(n.pool.market == Market.SPOT, n.zone) for n in self.live.values() if n.launched is not None]
            tick_s, spot, od_usd = self._tick_s, self.sc.spot_price, self._od_usd
            cost, billed_s, od_s = self.cost, self.billed_s, self.od_s
            while billed and t < ts:
                k = self.tick_index(t)
                end = min(ts, BASE_TS + (k + 1) * tick_s)
                dt = end - t
                tt = (self._start_tick + k) % self._n_ticks
                for is_spot, z in billed:  # per node, in this order: the float sums of ``price`` per node
                    cost += (float(spot[z, tt]) if is_spot else od_usd[z]) * dt / 3600.0
                    billed_s += dt
                    if not is_spot:
                        od_s += dt
                t = end
            self.cost, self.billed_s, self.od_s = cost, billed_s, od_s
        self.bill_ts = ts

    # --- instances -----------------------------------------------------------------------------

    def do_launch(self, c: Launch) -> None:
        z = self.zone_of_name.get(c.pool.zone)
        ids = list(c.node_ids)
        k = self.tick_index(self.now)
        ok = ids
        if z is None:
            ok = []
        elif c.pool.market == Market.SPOT:
            used = sum(1 for n in self.live.values() if n.zone == z and n.pool.market == Market.SPOT)
            room = self.capacity(z, k) - used if self.usable[z, self.trace_t(k)] else 0
            ok = ids[: max(0, room)]
        spot = c.pool.market == Market.SPOT
        tries = 0
        if z is not None:
            key = (z if spot else -1, k)
            tries = self.launch_tries.get(key, 0)
            self.launch_tries[key] = tries + 1
            if ok and spot and self.draws.cap_error[z, self.trace_t(k + tries)]:
                ok = []  # the cloud answers "no capacity" although the trace shows some
        failed = ids[len(ok):]
        if z is not None:
            doomed = spot and not self.usable[z, self.trace_t(k + 1)]
            row = z if spot else len(self.sc.zones)
            delay = self.wp.launch_delay_s(float(self.draws.launch_u[row, self.trace_t(k + tries)]))
            for nid in ok:
                self.start_instance(c, nid, z, k, doomed, delay)
        if ok:
            self.log("launch", f"{len(ok)} x {c.pool.name}")
        if failed:
            self.log("launch_failed", c.pool.name)
            self.at(self.now, "core", LaunchFailed(node_ids=tuple(failed), job_id=c.job_id, pool=c.pool,
                                                   token=c.token, reason=FailureReason.CAPACITY))

    def start_instance(self, c: Launch, nid: NodeId, z: int, k: int, doomed: bool, delay_s: float) -> None:
        n = WNode(nid, c.pool, z, launched=self.now)
        self.nodes[nid] = n
        self.live[nid] = n
        if doomed:  # launched into a zone that loses its capacity at the next boundary
            self.doom(n, BASE_TS + (k + 1) * self.sc.tick_s)
        self.at(self.now, "core", NodeLaunched(node_id=nid, job_id=c.job_id, instance_id=instance_of(nid),
                                               pool=c.pool, token=c.token))
        self.at(self.now + delay_s, "registered", nid)

    def doom(self, n: WNode, death: float) -> None:
        """``n`` is preempted at ``death``: a notice the cloud's notice length before it, unless the
        shared draw of that zone and tick says this preemption comes without one."""
        if n.doomed_at == death:
            return
        n.doomed_at = death
        if not self.draws.no_notice[n.zone, self.trace_t(self.tick_index(death))]:
            self.at(max(self.now, death - self.wp.notice_for(n.pool.cloud)), "notice", n.node_id, death)
        self.at(death, "death", n.node_id)

    def stop_instance(self, n: WNode) -> None:
        n.alive = False
        self.live.pop(n.node_id, None)

    def kill(self, n: WNode) -> None:
        self.stop_instance(n)
        if not n.noticed:
            self.preemptions += 1  # noticed nodes were counted at their notice
        self.log("preempted", f"{n.node_id} {n.pool.name}")
        self.instance_lost(n)
        self.feed(NodeGone(node_id=n.node_id, instance_id=instance_of(n.node_id), reason="provider_terminated"))

    def handle_instance(self, kind: str, data: tuple[Any, ...]) -> None:
        """The heap events of instances: registered, notice, death."""
        n = self.nodes.get(data[0])
        if n is None or not n.alive:
            return
        if kind == "registered":
            n.registered = True
            self.feed(NodeRegistered(id=f"r{next(self.msg)}", node_id=n.node_id, instance_id=instance_of(n.node_id),
                                     pool=n.pool, host=n.node_id, ts=self.now))
        elif kind == "notice":
            n.noticed = True
            self.preemptions += 1
            self.log("notice", f"{n.node_id} {n.pool.name} {data[1] - self.now:.0f} s before its preemption")
            self.notice(n, data[1])
        elif kind == "death":
            self.kill(n)

    def spot_by_zone(self) -> dict[int, list[WNode]]:
        out: dict[int, list[WNode]] = {}
        for n in self.live.values():
            if n.pool.market == Market.SPOT:
                out.setdefault(n.zone, []).append(n)
        return out

    # --- the market ----------------------------------------------------------------------------

    reads_prices = True  # False: the consumer ignores PriceTicks (a baseline's controller reads the trace)

    def publish_price(self, z: int, pk: PoolKey, price: float, hint: float) -> None:
        if not self.reads_prices:
            self.decisions += 1  # counted as fed: the consumer would have ignored it
            return
        od = self._od_usd[z]
        self.feed(PriceTick(id=f"p{next(self.msg)}", pool=pk, gpu_type=GPU, gpus_per_node=1,
                            price_usd_h=price if math.isfinite(price) else od, on_demand_usd_h=od,
                            capacity_hint=hint if self.capacity_hints else None, ts=self.now))

    def market_tick(self, k: int) -> None:
        """Trace tick ``k``: prices and capacity of this tick (only pools that changed), so that decisions
        taken on the preemptions below already see the new capacity; then the preemptions at this
        boundary (nodes whose zone lost capacity; noticed ones already know); then the notices for the
        next boundary."""
        t = self.trace_t(k)
        prices = self.sc.spot_price[:, t]
        hints = self.scores[:, t]
        for z, pk in enumerate(self.pools_spot):
            price = float(prices[z])
            hint = float(hints[z])
            if self.last_hint[z] != (price, hint):
                self.last_hint[z] = (price, hint)
                self.publish_price(z, pk, price, hint)
                self.requote[z] = True
            elif self.requote[z]:
                self.requote[z] = False
                self.publish_price(z, pk, price, hint)
        for z, spot in self.spot_by_zone().items():
            cap = self.capacity(z, k) if self.usable[z, t] else 0
            for n in spot[cap:] if cap < len(spot) else ():
                self.kill(n)
        nxt = self.trace_t(k + 1)
        death = self.now + self.sc.tick_s
        for z, spot in self.spot_by_zone().items():
            cap = self.capacity(z, k + 1) if self.usable[z, nxt] else 0
            for n in spot[cap:] if cap < len(spot) else ():
                self.doom(n, death)

    def on_tick_prices_only(self) -> None:
        """Prices before the job is submitted (the daemon knows the market when a job arrives)."""
        t = self.trace_t(0)
        for z, pk in enumerate(self.pools_spot):
            price = float(self.sc.spot_price[z, t])
            hint = float(self.scores[z, t])
            self.last_hint[z] = (price, hint)
            self.publish_price(z, pk, price, hint)
