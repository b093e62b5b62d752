"""The core's replica choice (pure): the newest step every rank has on a survivor, else the durable one,
with the reason; refused steps fall back; the expected lost work the policy can use."""

from __future__ import annotations

import msgspec
import pytest

from orchestrator.core import CoreConfig, State
from orchestrator.core.commands import SendToAgent
from orchestrator.core.inputs import JobSubmitted
from orchestrator.core.lifecycle import start_generation
from orchestrator.core.model import Job, Node
from orchestrator.core.replicas import (
    CROSS_ZONE_USD_PER_GB,
    buddies,
    cause,
    choose,
    command_fields,
    egress_usd_h,
    expected_lost_work_s,
    max_lost_steps,
    newest_complete,
    note_exit,
)
from orchestrator.core.tx import Tx
from tests.core.harness import Driver, RanksExited, StartGenerationCmd, cmds, pool, price, spec
from wire import CheckpointPolicy, JobId, JobSpec, NodeId, PoolKey, TrainerSpec


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


def _exited(gen: int, lag: int | None) -> RanksExited:
    return RanksExited(id=f"x{gen}-{lag}", node_id=NodeId("a"), job_id=JobId("j"), generation=gen, exit_code=77,
                       reason="peer_lost", ts=0.0, replica_lag_max=msgspec.UNSET if lag is None else lag)


def test_the_bound_is_over_the_steps_actually_replicated() -> None:
    """The ranks skip a copy while the previous is in flight: the lag they report (the most steps a loss
    would have sent back) widens the bound and the expected loss; the newest generation's report counts."""
    def fold(job: Job, *events: RanksExited) -> Job:
        tx = Tx(State.empty(), "test", 0.0)
        job = tx.put_job(job)
        for e in events:
            job = note_exit(tx, job, e)
        return job

    job = fold(_job(every=1), _exited(1, 2), _exited(1, 5), _exited(1, 3))
    assert job.replica_lag == (1, 5) and max_lost_steps(job) == 5  # two copies skipped in a row: 5, not k + 1
    assert expected_lost_work_s(job, 1.0, 900.0) == 3.0  # (k'/2 + 1) steps, k' = 4
    job = fold(job, _exited(2, 2), _exited(1, 9))  # a newer generation kept up; a late report of gen 1 is older
    assert job.replica_lag == (2, 2) and max_lost_steps(job) == 2
    assert max_lost_steps(fold(_job(every=4), _exited(1, 3))) == 5  # never below k + 1
    assert fold(_job(every=1), _exited(1, None)).replica_lag is msgspec.UNSET
    # a job's own command: covered once its ranks reported a lag (a Session script), else the durable bound
    own = msgspec.structs.replace(_job(every=1), spec=msgspec.structs.replace(
        _job().spec, trainer=TrainerSpec(command=("python", "mine.py"))))
    assert max_lost_steps(own) is None and expected_lost_work_s(own, 1.0, 900.0) == 450.0
    assert max_lost_steps(fold(own, _exited(1, 2))) == 2


def _pk(cloud: str, region: str, zone: str) -> PoolKey:
    return pool(cloud=cloud, region=region, zone=zone)


@pytest.mark.parametrize(("where", "same_zone"), [
    ([("aws", "r", "a")] * 3, 3),  # one zone: the ring
    ([("aws", "r", "a"), ("aws", "r", "a"), ("aws", "r", "b"), ("aws", "r", "b")], 0),
    ([("aws", "r", "a")] * 3 + [("aws", "r", "b"), ("aws", "r", "c"), ("aws", "r", "c")], 0),
    ([("aws", "r", "a")] * 3 + [("aws", "r", "b")], 2),  # 3 of 4 in one zone: 2m - n keep their zone
    ([("aws", "r1", "a"), ("aws", "r1", "a"), ("gcp", "g", "x"), ("gcp", "g", "y")], 0),
])
def test_buddies_in_another_zone_when_the_job_spans_zones(where: list[tuple[str, str, str]], same_zone: int) -> None:
    pools = [_pk(*w) for w in where]
    b = buddies(pools)
    assert sorted(b) == list(range(len(pools))) and all(b[i] != i for i in range(len(pools)))  # each holds one
    assert sum(pools[i].zone == pools[b[i]].zone for i in range(len(pools))) == same_zone
    if same_zone == len(pools):
        assert b == [(i + 1) % len(pools) for i in range(len(pools))]


def test_buddies_stay_in_the_region_then_the_cloud_when_they_can() -> None:
    regions = [_pk("aws", "r1", "a"), _pk("aws", "r2", "c"), _pk("aws", "r1", "b"), _pk("aws", "r2", "d")]
    assert [regions[j].region for j in buddies(regions)] == ["r1", "r2", "r1", "r2"]
    clouds = [_pk("aws", "r1", "a"), _pk("gcp", "g", "x"), _pk("aws", "r2", "b"), _pk("gcp", "g", "y")]
    assert [clouds[j].cloud for j in buddies(clouds)] == ["aws", "gcp", "aws", "gcp"]
    # one node alone in its cloud: it must cross clouds, and only it and the node that holds its copies do
    odd = [_pk("aws", "r1", "a"), _pk("aws", "r1", "b"), _pk("gcp", "g", "x")]
    assert sum(odd[i].cloud != odd[j].cloud for i, j in enumerate(buddies(odd))) == 2
    assert buddies([_pk("aws", "r", "a")]) == [0]


def test_each_node_is_told_its_buddy_and_the_audit_prices_them() -> None:
    """Through the real core: one zone, the ring (StartGenerationCmd.replica_buddy, the agent's
    ORCH_REPLICA_BUDDY). The placement keeps a job's nodes in one zone today, so a generation across zones is
    started here by ``start_generation`` itself, on registered nodes whose records name two zones: each
    node's buddy is in the other zone, and the audit prices the cross-zone copies."""
    drv = Driver()
    drv(price(pool(), 10.0, gpn=1))
    ckpt = CheckpointPolicy(url="file:///ckpt/j1", save_s_estimate=20.0, replica_every=1)
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=5, nodes_min=5, nodes_max=5, gpus_per_node=1, checkpoint=ckpt),
                         replica_secret="s" * 64))
    ids = drv.launched(d)
    drv.register(ids[:4])  # the fifth has not registered yet: no generation
    tx = Tx(drv.state, "test", drv.now)
    zones = ["us-east-1a", "us-east-1b", "us-east-1a", "us-east-1b"]
    members = [tx.put_node(msgspec.structs.replace(tx.nodes[n], pool=pool(zone=z)))
               for n, z in zip(ids[:4], zones, strict=True)]
    start_generation(tx, tx.job("j1"), members)
    starts = sorted((c.command for c in tx.cmds if isinstance(c, SendToAgent)
                     and isinstance(c.command, StartGenerationCmd)), key=lambda c: c.node_rank)
    assert [zones[c.replica_buddy] != zones[c.node_rank] for c in starts] == [True] * 4
    (rec,) = [a for a in tx.audit if a.action == "recovery"]
    want = egress_usd_h(tx.job("j1"), members, tx.cfg)
    assert rec.details["replica_egress_usd_h"] == round(want, 6) > 0
    drv.register(ids[4:])  # the real path: one zone, the ring
    ring = cmds(drv.decisions[-1], StartGenerationCmd)
    assert sorted((c.node_rank, c.replica_buddy) for c in ring) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 0)]


def test_facts_of_other_nodes_and_ranks_out_of_range_do_not_count() -> None:
    facts = [("a", 0, 4, 2), ("zz", 1, 4, 2), ("a", 5, 4, 2)]
    assert newest_complete(facts, ["a", "b"], 2) == ((), "incomplete: step 4 lacks ranks [1]")


def _nodes(*where: tuple[str, str, str]) -> list[Node]:
    return [Node(node_id=NodeId(f"n{i}"), job_id=JobId("j"), pool=pool(cloud=c, region=r, zone=z), pool_name="p",
                 token="t", phase_ts=0.0, requested_ts=0.0) for i, (c, r, z) in enumerate(where)]


def test_the_buddies_egress_is_priced_by_where_each_buddy_is() -> None:
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
