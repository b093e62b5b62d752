"""Test helpers: builders for specs/prices and a tiny driver that feeds events through decide."""

from __future__ import annotations

from typing import Any

from orchestrator.core import Decision, State, decide, state_from_records, state_to_records
from orchestrator.core.commands import CheckInstance, Launch, SendToAgent, Terminate
from orchestrator.core.inputs import LaunchFailed, NodeLaunched
from wire import (
    AgentState,
    CheckpointCmd,
    CheckpointCommitted,
    CheckpointPolicy,
    FailureReason,
    GenerationStarted,
    Heartbeat,
    JobSpec,
    Market,
    NodeRegistered,
    PoolKey,
    PriceTick,
    RanksExited,
    StartGenerationCmd,
)


def spec(**kw: Any) -> JobSpec:
    base: dict[str, Any] = dict(
        name="t", total_steps=1000, gpu_type="A100", gpus_per_node=8, nodes=2, nodes_min=1, nodes_max=2,
        checkpoint=CheckpointPolicy(url="file:///ckpt/j1", save_s_estimate=20.0),
    )
    base.update(kw)
    return JobSpec(**base)


def pool(itype: str = "p4d.24xlarge", zone: str = "us-east-1a", market: Market = Market.SPOT,
         cloud: str = "aws", region: str = "us-east-1") -> PoolKey:
    return PoolKey(cloud=cloud, region=region, zone=zone, instance_type=itype, market=market)


_seq = [0]


def price(
    pk: PoolKey, usd: float, od: float | None = 30.0, ts: float = 0.0, gpu: str = "A100", gpn: int = 8
) -> PriceTick:
    _seq[0] += 1
    return PriceTick(id=f"p{_seq[0]}", pool=pk, gpu_type=gpu, gpus_per_node=gpn, price_usd_h=usd,
                     on_demand_usd_h=od, ts=ts)


class Driver:
    """Feeds events through decide, checks the records round trip on every step, keeps all outputs."""

    def __init__(self, state: State | None = None, now: float = 1000.0, check_records: bool = True) -> None:
        self.state = state or State.empty()
        self.now = now
        self.check_records = check_records
        self.decisions: list[Decision] = []

    def __call__(self, event: Any, dt: float = 0.0) -> Decision:
        self.now += dt
        d = decide(self.state, event, self.now)
        if self.check_records and d.dirty:
            recs = state_to_records(d.state, d.dirty)
            for k, v in recs.items():
                assert (v == b"") == (k not in state_to_records(d.state)), k
        self.state = d.state
        self.decisions.append(d)
        return d

    # --- helpers emulating the shell/agents ---

    def launched(self, d: Decision) -> list[str]:
        ids: list[str] = []
        for c in d.commands:
            if isinstance(c, Launch):
                for nid in c.node_ids:
                    self(NodeLaunched(node_id=nid, job_id=c.job_id, instance_id=f"i-{nid}", pool=c.pool, token=c.token))
                    ids.append(nid)
        return ids

    def register(self, ids: list[str]) -> Decision:
        d = None
        for nid in ids:
            d = self(NodeRegistered(id=f"r-{nid}", node_id=nid, host=f"10.0.0.{len(nid)}-{nid}", ts=self.now))
        assert d is not None
        return d

    def job(self, job_id: str = "j1"):
        return self.state.jobs[job_id]

    def fail_launches(self, launches: list[Launch]) -> None:
        """Answer every launch (and the launches that answer makes) with a capacity failure."""
        while launches:
            la = launches.pop(0)
            d = self(LaunchFailed(node_ids=la.node_ids, job_id=la.job_id, pool=la.pool, token=la.token,
                                  reason=FailureReason.CAPACITY))
            launches.extend(cmds(d, Launch))

    def heartbeat(self, nid: str, gen: int, step: int, step_time: float = 1.0, job: str = "j1") -> Decision:
        """A training heartbeat of ``nid`` at ``step`` (sequence: the clock's second)."""
        return self(Heartbeat(node_id=nid, seq=int(self.now), ts=self.now, state=AgentState.TRAINING, job_id=job,
                              generation=gen, step=step, step_time_s=step_time))


def cmds(d: Decision, kind: type) -> list[Any]:
    out = []
    for c in d.commands:
        if isinstance(c, SendToAgent) and isinstance(c.command, kind):
            out.append(c.command)
        elif isinstance(c, kind):
            out.append(c)
    return out


__all__ = [
    "AgentState", "CheckInstance", "CheckpointCmd", "CheckpointCommitted", "Driver", "GenerationStarted",
    "Heartbeat", "Launch", "RanksExited", "StartGenerationCmd", "Terminate", "cmds", "pool", "price", "spec",
    "state_from_records", "state_to_records",
]
