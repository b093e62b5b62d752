"""The core's replica choice (pure): the newest step every rank has on a survivor, else the durable one,
with the reason; refused steps fall back; the expected lost work the policy can use."""

from __future__ import annotations

import msgspec
import pytest

from orchestrator.core import CoreConfig
from orchestrator.core.model import Job, Node
from orchestrator.core.replicas import (
    CROSS_ZONE_USD_PER_GB,
    cause,
    choose,
    command_fields,
    egress_usd_h,
    expected_lost_work_s,
    max_lost_steps,
    newest_complete,
)
from tests.core.harness import pool
from wire import CheckpointPolicy, JobId, JobSpec, NodeId


def _job(every: int | None = 1, held: tuple = (), refused: tuple = (), committed: int = 0) -> Job:
    ckpt = CheckpointPolicy(url="file:///tmp/x", replica_every=every if every else msgspec.UNSET)
    spec = JobSpec(name="j", total_steps=100, gpu_type="cpu", nodes=3, checkpoint=ckpt)
    return Job(job_id=JobId("j"), spec=spec, phase_ts=0.0, submitted_ts=0.0, target_nodes=3,
               replica_secret="s" * 64 if every else msgspec.UNSET, replica_held=held, replica_refused=refused,
               committed_step=committed, committed_url="file:///tmp/x/step_000000005" if committed else None)


# a's own shard and c's (its buddy), b's own and a's; c is lost: c's step 8 survives only on a
HELD = (("a", 0, 8, 3), ("a", 2, 8, 3), ("a", 0, 7, 3), ("a", 2, 7, 3),
        ("b", 1, 8, 3), ("b", 0, 8, 3), ("b", 1, 7, 3), ("b", 0, 7, 3))


def test_newest_step_complete_on_the_survivors() -> None:
    c = choose(_job(held=HELD, committed=5), ["a", "b", "d"], 3)
    assert (c.source, c.step, c.candidates) == ("replica", 8, (8, 7))
    assert command_fields(_job(held=HELD), c)["replica_step"] == 8


@pytest.mark.parametrize(("held", "members", "ws", "why"), [
    (HELD[4:], ["b", "d", "e"], 3, "incomplete"),  # two neighbours lost: rank 2's shard is gone
    ((), ["a", "b", "d"], 3, "no_replica_on_survivors"),
])
def test_durable_when_replicas_cannot_cover(held: tuple, members: list[str], ws: int, why: str) -> None:
    c = choose(_job(held=held, committed=5), members, ws)
    assert c.source == "durable" and c.step == 5 and c.reason.startswith(why), c


def test_a_shrunk_world_reshards_the_full_worlds_replicas() -> None:
    # the survivors a and b start alone: they hold all 3 shards of step 8 between them
    c = choose(_job(held=HELD, committed=5), ["a", "b"], 2)
    assert (c.source, c.step, c.saved_world_size) == ("replica", 8, 3), c
    assert c.reason == "newest_complete_replica_resharded_3_to_2"
    # a step complete at the new size wins over the same step at another size
    both = HELD + (("a", 0, 8, 2), ("b", 1, 8, 2))
    assert choose(_job(held=both, committed=5), ["a", "b"], 2).saved_world_size == 2


def test_a_refused_step_falls_back_to_an_older_complete_one_then_durable() -> None:
    assert choose(_job(held=HELD, refused=(8,)), ["a", "b", "d"], 3).step == 7
    c = choose(_job(held=HELD, refused=(8, 7), committed=5), ["a", "b", "d"], 3)
    assert (c.source, c.step) == ("durable", 5)


def test_never_older_than_the_durable_checkpoint_and_off_per_job() -> None:
    assert choose(_job(held=HELD, committed=9), ["a", "b", "d"], 3).source == "durable"
    off = choose(_job(every=None, held=HELD), ["a", "b", "d"], 3)
    assert (off.source, off.reason) == ("durable", "replicas_off") and command_fields(_job(every=None), off) == {}


def test_expected_lost_work_and_bound() -> None:
    with_r, without = _job(every=2), _job(every=None)
    assert expected_lost_work_s(without, 1.0, 900.0) == 450.0
    assert expected_lost_work_s(with_r, 1.0, 900.0) == 2.0  # (k/2 + 1) steps
    assert expected_lost_work_s(with_r, 1.0, 900.0, uncovered=0.1) == pytest.approx(0.9 * 2.0 + 0.1 * 450.0)
    assert max_lost_steps(with_r) == 3 and max_lost_steps(without) is None


def test_facts_of_other_nodes_and_ranks_out_of_range_do_not_count() -> None:
    facts = [("a", 0, 4, 2), ("zz", 1, 4, 2), ("a", 5, 4, 2)]
    assert newest_complete(facts, ["a", "b"], 2) == ((), "incomplete: step 4 lacks ranks [1]")


def _nodes(*where: tuple[str, str, str]) -> list[Node]:
    return [Node(node_id=NodeId(f"n{i}"), job_id=JobId("j"), pool=pool(cloud=c, region=r, zone=z), pool_name="p",
                 token="t", phase_ts=0.0, requested_ts=0.0) for i, (c, r, z) in enumerate(where)]


def test_the_buddies_egress_is_priced_by_where_the_next_node_is() -> None:
    cfg = CoreConfig()
    job = _job(every=2)  # step_time_s_estimate 1.0 s: 1800 copies an hour, each of 20 GB / 3 per node
    same = _nodes(("aws", "r1", "a"), ("aws", "r1", "a"), ("aws", "r1", "a"))
    assert egress_usd_h(job, same, cfg) == 0.0 and egress_usd_h(_job(every=None), same, cfg) == 0.0
    gb_h = cfg.checkpoint_gb_estimate / 3 * 1800
    # a -> b crosses zones, b -> x crosses clouds, x -> a crosses clouds
    mixed = _nodes(("aws", "r1", "a"), ("aws", "r1", "b"), ("gcp", "g1", "x"))
    want = gb_h * (CROSS_ZONE_USD_PER_GB + 2 * cfg.cross_cloud_usd_per_gb)
    assert egress_usd_h(job, mixed, cfg) == pytest.approx(want)
    regions = _nodes(("aws", "r1", "a"), ("aws", "r2", "a"))
    assert egress_usd_h(job, regions, cfg) == pytest.approx(2 * cfg.checkpoint_gb_estimate / 2 * 1800
                                                             * cfg.cross_region_usd_per_gb)


@pytest.mark.parametrize(("detail", "why"), [
    ("rank 0 step 8: 10.0.0.2:4000: ProtocolError: checksum mismatch in the replica of rank 2 step 8",
     "checksum_mismatch"),
    ("rank 1 step 7: old rank 2: 10.0.0.3:4000: ConnectionRefusedError: [Errno 111] Connection refused",
     "holder_unreachable"),
    ("rank 0 step 7: 10.0.0.3:4000: TimeoutError: timed out", "holder_unreachable"),
    ("rank 0 step 7: restore: ValueError: replica of another shard layout: w (4,)", "layout_mismatch"),
    ("rank 0 step 9: 10.0.0.2:4000: absent; 10.0.0.3:4000: absent", "absent"),
    ("something else", "replica_unusable"),
])
def test_the_audit_names_the_cause_of_a_refused_step(detail: str, why: str) -> None:
    assert cause(detail) == why
