"""Node ids count per job: a 2-node job's nodes are <job>-n1 and <job>-n2 whatever ran before it (so
``orchctl nodes drain <job>-n1`` names a node), a replacement takes the next number; a job stored by an
older release keeps the deployment-wide count, and an id a node of the state holds is never reused."""

from __future__ import annotations

import msgspec

import wire as ev
from orchestrator import core
from orchestrator.core.commands import Launch
from orchestrator.core.inputs import JobSubmitted

POOL = ev.PoolKey(cloud="fake", region="r1", zone="r1a", instance_type="gpu.small", market=ev.Market.SPOT)
NOW = 1_000_000.0


def _priced() -> core.State:
    return core.decide(core.State.empty(), ev.PriceTick(id="p", pool=POOL, gpu_type="A100", gpus_per_node=1,
                                                        price_usd_h=1.0, on_demand_usd_h=3.0, ts=NOW), NOW).state


def _submit(state: core.State, job_id: str, nodes: int) -> tuple[core.State, list[str]]:
    spec = ev.JobSpec(name=job_id, total_steps=100, gpu_type="A100", gpus_per_node=1, nodes=nodes,
                      nodes_max=nodes, clouds=("fake",), checkpoint=ev.CheckpointPolicy(url=f"file:///tmp/{job_id}"))
    d = core.decide(state, JobSubmitted(job_id=ev.JobId(job_id), spec=spec), NOW)
    return d.state, [n for c in d.commands if isinstance(c, Launch) for n in c.node_ids]


def test_each_job_counts_its_own_nodes() -> None:
    state, first = _submit(_priced(), "long0", 3)
    state, second = _submit(state, "long1", 2)
    assert first == ["long0-n1", "long0-n2", "long0-n3"]
    assert second == ["long1-n1", "long1-n2"]  # not long1-n4, long1-n5
    assert state.jobs["long1"].node_seq == 2
    job = state.jobs["long1"]
    tx = core.tx.Tx(state, "test", NOW)
    ids, seq = tx.new_node_ids(job, 1)
    assert (ids, seq) == (["long1-n3"], 3)  # a replacement: the next number of its job


def test_an_older_job_keeps_the_deployment_wide_count_and_no_id_is_reused() -> None:
    state, _ = _submit(_priced(), "old", 1)
    old = msgspec.structs.replace(state.jobs["old"], node_seq=msgspec.UNSET)  # as an older release stored it
    state = msgspec.structs.replace(state, jobs=state.jobs.set("old", old))
    tx = core.tx.Tx(state, "test", NOW)
    ids, seq = tx.new_node_ids(old, 1)
    assert seq is None and ids == [f"old-n{state.meta.node_seq + 1}"]
    fresh = msgspec.structs.replace(old, node_seq=0)  # a count of its own that would meet old-n1
    ids, seq = core.tx.Tx(state, "test", NOW).new_node_ids(fresh, 1)
    assert "old-n1" in state.nodes and ids == ["old-n2"] and seq == 2
