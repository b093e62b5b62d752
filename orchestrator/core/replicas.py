"""Shard replicas in the core: the facts agents report, the recovery choice, the expected lost work.

Role (pure): a job with ``[checkpoint] replica_every = k`` has every rank's shard copied into the host
memory of its own node and of the next node every k steps (trainer.replicas). Agents report what their
holder keeps when a generation's ranks exit (``RanksExited.replicas``); ``note_exit`` keeps those facts
per node. When the next generation starts, ``choose`` picks its source: the newest step for which every
rank's shard has a complete replica on a member of the new generation (a survivor: the lost node's
memory is gone), at the same world size, not older than the durable checkpoint and not found unusable
before; else the durable checkpoint, with the reason. ``start_generation`` records the choice in the
audit (``recovery``: ``orchctl explain``). A generation whose ranks could not restore the chosen step
exits ``replica_unusable``; ``note_exit`` then refuses that step and the next choice falls back (an
older complete replica, then the durable checkpoint).

``expected_lost_work_s`` is the work since the last usable restore point that a failure without notice
costs: the part of the restart cost r that the policy and the deadline guarantee use.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypedDict

import msgspec

from orchestrator.core.model import Job, Node
from orchestrator.core.tx import Tx
from wire.messages import RanksExited

REPLICA_UNUSABLE = "replica_unusable"
MAX_FACTS_PER_NODE = 256  # a node's holder keeps 2 steps of 2 ranks per GPU: far below this


def every(job: Job) -> int:
    """k: replicas every k steps; 0 when the job has none."""
    k = job.spec.checkpoint.replica_every
    return k if isinstance(k, int) and k > 0 else 0


@dataclass(frozen=True, slots=True)
class Choice:
    source: str  # "replica" | "durable"
    step: int  # the step the generation resumes after (durable: the committed step, 0 when none)
    reason: str  # why this source
    candidates: tuple[int, ...] = ()  # complete replica steps, newest first


def newest_complete(held: Iterable[tuple[str, int, int, int]], members: Sequence[str], world_size: int,
                    *, not_before: int = 0, refused: Iterable[int] = ()) -> tuple[tuple[int, ...], str]:
    """Complete replica steps (newest first) from facts (node, rank, step, world_size): a step is complete
    when every rank 0..world_size-1 has a replica of it, made at ``world_size``, on one of ``members``;
    and, when there are none, why."""
    live, bad = set(members), set(refused)
    ranks: dict[int, set[int]] = {}
    other_ws = False
    for node, rank, step, ws in held:
        if node not in live:
            continue
        if ws != world_size:
            other_ws = True
            continue
        if step >= not_before and step not in bad and 0 <= rank < world_size:
            ranks.setdefault(step, set()).add(rank)
    complete = tuple(sorted((s for s, r in ranks.items() if len(r) == world_size), reverse=True))
    if complete:
        return complete, ""
    if ranks:
        step = max(ranks)
        return (), f"incomplete: step {step} lacks ranks {sorted(set(range(world_size)) - ranks[step])[:8]}"
    if other_ws:
        return (), "world_size_changed"
    return (), "no_replica_on_survivors"


def choose(job: Job, members: Sequence[str], world_size: int) -> Choice:
    """The source of the generation about to start on ``members`` (rank order) with ``world_size`` ranks."""
    durable = job.committed_step if job.committed_url is not None else 0
    if not every(job) or isinstance(job.replica_secret, msgspec.UnsetType):
        return Choice("durable", durable, "replicas_off")
    held = () if isinstance(job.replica_held, msgspec.UnsetType) else job.replica_held
    refused = () if isinstance(job.replica_refused, msgspec.UnsetType) else job.replica_refused
    complete, why = newest_complete(held, members, world_size, not_before=max(durable, 1), refused=refused)
    if not complete:
        return Choice("durable", durable, why)
    return Choice("replica", complete[0], "newest_complete_replica", complete)


class ReplicaFields(TypedDict, total=False):
    replica_secret: str
    replica_every: int
    replica_step: int


def worth_waiting(job: Job, ready: Sequence[Node], world_size: int) -> bool:
    """Wait for the replacement in flight rather than start a smaller world: the ready nodes hold a complete
    replica step of the full world (``world_size``) newer than the durable checkpoint, which a smaller
    world could not use (replicas are per shard)."""
    if not every(job) or isinstance(job.replica_held, msgspec.UnsetType):
        return False
    durable = job.committed_step if job.committed_url is not None else 0
    refused = () if isinstance(job.replica_refused, msgspec.UnsetType) else job.replica_refused
    complete, _ = newest_complete(job.replica_held, [n.node_id for n in ready], world_size,
                                  not_before=durable + 1, refused=refused)
    return bool(complete)


def command_fields(job: Job, choice: Choice) -> ReplicaFields:
    """StartGenerationCmd's replica fields: none for a job without replicas (its bytes stay as before)."""
    k = every(job)
    if not k or isinstance(job.replica_secret, msgspec.UnsetType):
        return {}
    fields: ReplicaFields = {"replica_secret": job.replica_secret, "replica_every": k}
    if choice.source == "replica":
        fields["replica_step"] = choice.step
    return fields


def record_choice(tx: Tx, job: Job, choice: Choice, generation: int) -> Job:
    """The audit entry ``recovery`` (``orchctl explain``) for a job with replicas, and the step tried."""
    if not every(job):
        return job
    durable = job.committed_step if job.committed_url is not None else 0
    tx.record(job.job_id, "recovery", choice.reason, generation=generation, source=choice.source,
              step=choice.step, durable_step=durable, replica_steps=list(choice.candidates[:4]),
              refused=list(job.replica_refused) if isinstance(job.replica_refused, tuple) else [])
    return tx.update_job(job, replica_step=choice.step if choice.source == "replica" else 0)


def note_exit(tx: Tx, job: Job, ev: RanksExited) -> Job:
    """Keep the node's reported replicas (replacing what it reported before); a ``replica_unusable`` exit
    refuses the step the generation tried."""
    changes: dict[str, object] = {}
    if not isinstance(ev.replicas, msgspec.UnsetType):
        held = () if isinstance(job.replica_held, msgspec.UnsetType) else job.replica_held
        live = set(job.nodes)
        kept = tuple(h for h in held if h[0] != ev.node_id and h[0] in live)
        mine = tuple((str(ev.node_id), r.rank, r.step, r.world_size) for r in ev.replicas[:MAX_FACTS_PER_NODE])
        changes["replica_held"] = kept + mine
    tried = job.replica_step
    if ev.reason == REPLICA_UNUSABLE and isinstance(tried, int) and tried > 0:
        refused = () if isinstance(job.replica_refused, msgspec.UnsetType) else job.replica_refused
        if tried not in refused:
            changes["replica_refused"] = (*refused, tried)[-16:]
    return tx.update_job(job, **changes) if changes else job


def expected_lost_work_s(job: Job, step_time_s: float, ckpt_interval_s: float | None, *,
                         uncovered: float = 0.0) -> float:
    """Expected seconds of work a failure without notice loses (the work since the last usable restore
    point, part of the restart cost r).

    Without replicas: half the durable checkpoint interval (failures land uniformly between saves). With
    replicas every k steps: a failure loses the step in flight plus the steps since the last complete
    replica (bound k + 1 steps, mean about k/2 + 1 with the copy of the last one still in flight), except
    in the share ``uncovered`` of failures replicas cannot cover (both copies of a shard lost: two
    neighbours at once, a zone reclaim, the whole job), which fall back to the durable checkpoint."""
    step = max(step_time_s, 0.0)
    durable = 0.5 * ckpt_interval_s if ckpt_interval_s is not None and ckpt_interval_s > 0 else 0.5 * step
    k = every(job)
    if not k:
        return durable
    replica = min((k / 2 + 1) * step, durable) if durable > 0 else (k / 2 + 1) * step
    share = min(max(uncovered, 0.0), 1.0)
    return (1 - share) * replica + share * durable


def max_lost_steps(job: Job) -> int | None:
    """The bound on steps lost to one node vanishing with replicas (k + 1); None without replicas."""
    k = every(job)
    return k + 1 if k else None
