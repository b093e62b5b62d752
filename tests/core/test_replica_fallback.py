"""The replica path's own faults through the core: a generation that could not restore the chosen replica
step exits ``replica_unusable`` (79) with the ranks' reason; the core refuses that step, says why in the
audit (``replica_refused``), and chooses again: an older complete replica, then the durable checkpoint.

The node events are the agents' (RanksExited with the holders' inventories and the ranks' detail, as
agent/generations.py sends them); the decisions are the real core's."""

from __future__ import annotations

from typing import Any

from orchestrator.core import JobPhase
from orchestrator.core.inputs import JobSubmitted, NodeGone, Tick
from tests.core.harness import (
    CheckpointCommitted,
    Driver,
    GenerationStarted,
    RanksExited,
    StartGenerationCmd,
    cmds,
    pool,
    price,
    spec,
)
from wire import CheckpointPolicy, ReplicaHeld

CKPT = "file:///ckpt/j1"


def _held(*pairs: tuple[int, int], ws: int = 3) -> tuple[ReplicaHeld, ...]:
    return tuple(ReplicaHeld(rank=r, step=s, world_size=ws) for r, s in pairs)


def _started(drv: Driver) -> tuple[list[str], list[StartGenerationCmd]]:
    job = drv.job()
    starts = [c for d in drv.decisions[-3:] for c in cmds(d, StartGenerationCmd) if c.generation == job.generation]
    return list(job.gen_nodes), starts


def _audit(drv: Driver, action: str) -> list[Any]:
    return [a for d in drv.decisions for a in d.audit if a.action == action]


def _running_job() -> tuple[Driver, list[str]]:
    drv = Driver()
    drv(price(pool(), 10.0, gpn=1))
    ckpt = CheckpointPolicy(url=CKPT, save_s_estimate=20.0, replica_every=1)
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=3, nodes_min=2, nodes_max=3, gpus_per_node=1, checkpoint=ckpt),
                         replica_secret="s" * 64))
    ids = drv.launched(d)
    drv.register(ids)
    drv(GenerationStarted(id="g1", node_id=ids[0], job_id="j1", generation=1, first_step=1, ts=drv.now))
    drv(CheckpointCommitted(id="c5", node_id=ids[0], job_id="j1", generation=1, step=5, url=f"{CKPT}/step_5",
                            checkpoint_id="ck5",
                            save_s=1.0, ts=drv.now), dt=1.0)
    return drv, ids


def _exit(drv: Driver, gen: int, node: str, reason: str, code: int, last: int, held: tuple[ReplicaHeld, ...] = (),
          detail: str | None = None) -> None:
    extra: dict[str, Any] = {"detail": detail} if detail else {}
    drv(RanksExited(id=f"x{gen}-{node}", node_id=node, job_id="j1", generation=gen, exit_code=code, reason=reason,
                    last_step=last, ts=drv.now, replicas=held, **extra), dt=0.1)


def test_refused_steps_fall_back_to_an_older_replica_then_the_durable_checkpoint() -> None:
    drv, (a, b, c) = _running_job()
    # c vanishes at step 9: a holds ranks 0 and 2 (its buddy), b ranks 1 and 0, for steps 8 and 7
    drv(NodeGone(node_id=c, reason="provider_terminated"), dt=1.0)
    _exit(drv, 1, a, "peer_lost", 77, 9, _held((0, 8), (2, 8), (0, 7), (2, 7)))
    _exit(drv, 1, b, "peer_lost", 77, 9, _held((1, 8), (0, 8), (1, 7), (0, 7)))
    members, starts = _started(drv)
    assert members == [a, b] and {s.replica_step for s in starts} == {8}, (members, starts)
    rec = _audit(drv, "recovery")[-1]
    assert rec.reason == "newest_complete_replica_resharded_3_to_2" and rec.details["saved_world_size"] == 3

    # generation 2: a replica of step 8 fails its checksum at fetch; every rank exits 79 with the reason
    gen = drv.job().generation
    why = "rank 0 step 8: 10.0.0.2:4000: ProtocolError: checksum mismatch in the replica of rank 2 step 8"
    _exit(drv, gen, a, "replica_unusable", 79, 8, _held((0, 8), (2, 8), (0, 7), (2, 7)), detail=why)
    _exit(drv, gen, b, "replica_unusable", 79, 8, _held((1, 8), (0, 8), (1, 7), (0, 7)), detail=why)
    (refused,) = _audit(drv, "replica_refused")
    assert (refused.reason, refused.details["step"]) == ("checksum_mismatch", 8), refused
    assert "checksum mismatch" in refused.details["detail"]
    members, starts = _started(drv)
    assert {s.replica_step for s in starts} == {7}, starts  # the older complete replica
    assert _audit(drv, "recovery")[-1].details["refused"] == [8]

    # generation 3: b dies during the recovery (its holder with it): a's ranks cannot fetch rank 1's shard
    gen = drv.job().generation
    lost = "rank 0 step 7: old rank 1: 10.0.0.3:4000: ConnectionRefusedError: [Errno 111] Connection refused"
    _exit(drv, gen, a, "replica_unusable", 79, 7, _held((0, 8), (2, 8), (0, 7), (2, 7)), detail=lost)
    drv(NodeGone(node_id=b, reason="provider_terminated"), dt=1.0)
    refused = _audit(drv, "replica_refused")[-1]
    assert (refused.reason, refused.details["step"]) == ("holder_unreachable", 7), refused
    for _ in range(60):  # a replacement boots; the next generation starts from the durable checkpoint
        for nid in drv.launched(drv.decisions[-1]):
            drv.register([nid])
        if drv.job().phase == JobPhase.STARTING and drv.job().generation > gen:
            break
        drv(Tick(), dt=1.0)
    rec = _audit(drv, "recovery")[-1]
    assert (rec.details["source"], rec.details["step"]) == ("durable", 5), rec
    assert rec.details["refused"] == [8, 7]
    _members, starts = _started(drv)
    assert starts and all(s.replica_step is None or not isinstance(s.replica_step, int) for s in starts), starts
