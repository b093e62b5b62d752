"""What a restore does with the stored state: a record whose id today's names refuse is reported and
parked (never a crash), and the cluster identity is generated once and kept (loop.cluster_identity)."""

from __future__ import annotations

import time

import msgspec

import wire as ev
from orchestrator import core
from orchestrator.core.inputs import JobSubmitted, LeaseChanged
from orchestrator.daemon.coreapi import default_core
from orchestrator.daemon.loop import Daemon, cluster_identity
from orchestrator.daemon.metrics import Metrics
from orchestrator.settings import DaemonSettings, Settings

POOL = ev.PoolKey(cloud="fake", region="r1", zone="r1a", instance_type="gpu.small", market=ev.Market.SPOT)


def _records(*job_ids: str) -> dict[str, bytes]:
    """The records an older orchd stored: a priced pool and each job launched (one node each)."""
    now = time.time()
    s = core.decide(core.State.empty(), ev.PriceTick(id="p", pool=POOL, gpu_type="A100", gpus_per_node=1,
                                                     price_usd_h=1.0, on_demand_usd_h=3.0, ts=now), now).state
    for i, jid in enumerate(job_ids):
        spec = ev.JobSpec(name=f"j{i}", total_steps=10, gpu_type="A100", gpus_per_node=1, nodes=1, clouds=("fake",),
                          checkpoint=ev.CheckpointPolicy(url=f"file:///tmp/restore-{i}"))
        s = core.decide(s, JobSubmitted(job_id=ev.JobId(jid), spec=spec), now).state
    return core.state_to_records(s, core.records.all_keys(s))


def _rejected(m: Metrics) -> float:
    return sum(s.value for f in m.registry.collect() for s in f.samples
               if s.name == "orchd_messages_rejected_total" and s.labels.get("kind") == "state")


def test_a_stored_job_whose_id_is_not_a_token_is_parked_with_its_nodes() -> None:
    records = _records("good-job", "dotted.job")  # an older release took a dotted job id
    assert "job.dotted.job" in records and any(k.startswith("node.dotted_job") for k in records)
    settings = Settings()
    d = Daemon(settings, {}, default_core(settings), Metrics())
    d.restore(records)
    assert d.state is not None and sorted(d.state.jobs) == ["good-job"]
    assert all(n.job_id == "good-job" for n in d.state.nodes.values()) and len(d.state.nodes) == 1
    assert _rejected(d.metrics) == 2  # the job and its node, each reported


def test_the_cluster_identity_is_generated_once_and_kept() -> None:
    empty = core.State.empty()
    fresh = cluster_identity(empty, False, DaemonSettings().cluster_id)
    assert fresh.startswith("orch-") and len(fresh) == 17 and fresh != cluster_identity(empty, False, "orch-default")
    assert cluster_identity(empty, False, "lab-east") == "lab-east"  # the operator's choice for a new state
    assert cluster_identity(empty, True, "orch-default") == "orch-default"  # an older release's state keeps it
    kept = core.decide(empty, LeaseChanged(revision=3, cluster_id=fresh), 1.0).state
    assert kept.meta.cluster_id == fresh
    again = core.decide(kept, LeaseChanged(revision=4, cluster_id="orch-someone-else"), 2.0).state
    assert again.meta.cluster_id == fresh  # recorded once: the state's identity wins
    assert cluster_identity(kept, True, "orch-default") == fresh
    records = core.state_to_records(kept, ["meta"])
    assert msgspec.json.decode(records["meta"])["cluster_id"] == fresh  # persisted with the meta record
    old_meta = core.state_to_records(empty, ["meta"])["meta"]
    assert b"cluster_id" not in old_meta  # unset: an older release's meta record re-encodes to its bytes
