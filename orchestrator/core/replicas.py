"""Shard replicas in the core: the facts agents report, the recovery choice, the expected lost work.

Role (pure): a job with ``[checkpoint] replica_every = k`` has every rank's shard copied into the host
memory of its own node and of the next node every k steps (trainer.replicas). Agents report what their
holder keeps when a generation's ranks exit (``RanksExited.replicas``); ``note_exit`` keeps those facts
per node. When the next generation starts, ``choose`` picks its source: the newest step for which every
rank's shard has a complete replica on a member of the new generation (a survivor: the lost node's
memory is gone), not older than the durable checkpoint and not found unusable before; else the durable
checkpoint, with the reason. A step made by a world of another size (the survivors start without the
lost node) is resharded by the ranks, as a durable checkpoint is: no wait for a replacement.
``start_generation`` records the choice in the audit (``recovery``: ``orchctl explain``). A generation
whose ranks could not restore the chosen step exits ``replica_unusable``; ``note_exit`` then refuses that
step, audits why (``replica_refused``), and the next choice falls back (an older complete replica, then
the durable checkpoint).

``expected_lost_work_s`` is the work since the last usable restore point that a failure without notice
costs: the part of the restart cost r that the policy and the deadline guarantee use.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypedDict

import msgspec

from orchestrator.core.model import CoreConfig, Job, Node
from orchestrator.core.tx import Tx
from wire.messages import PoolKey, RanksExited

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
    saved_world_size: int = 0  # the world size that made the replica step (another one: the ranks reshard)


def complete_steps(held: Iterable[tuple[str, int, int, int]], members: Sequence[str], world_size: int,
                   *, not_before: int = 0, refused: Iterable[int] = ()) -> tuple[dict[int, int], str]:
    """{step: world size that made it} of the complete replica steps, from facts (node, rank, step,
    world_size): a step is complete when every rank 0..ws-1 of the world that made it has a replica on
    one of ``members``. A step complete at ``world_size`` is restored shard by shard; one complete only at
    another size is resharded by the ranks (trainer.replicas.reshard); the same size wins when both are.
    When there are none: why."""
    live, bad = set(members), set(refused)
    ranks: dict[tuple[int, int], set[int]] = {}
    for node, rank, step, ws in held:
        if node in live and step >= not_before and step not in bad and 0 <= rank < ws:
            ranks.setdefault((step, ws), set()).add(rank)
    complete: dict[int, int] = {}
    for (step, ws), got in sorted(ranks.items(), key=lambda kv: (kv[0][0], kv[0][1] == world_size, kv[0][1])):
        if len(got) == ws:
            complete[step] = ws  # sorted: the same world size, else the largest, is the last written
    if complete:
        return dict(sorted(complete.items(), reverse=True)), ""
    if ranks:
        (step, ws), got = max(ranks.items(), key=lambda kv: kv[0])
        return {}, f"incomplete: step {step} lacks ranks {sorted(set(range(ws)) - got)[:8]}"
    return {}, "no_replica_on_survivors"


def newest_complete(held: Iterable[tuple[str, int, int, int]], members: Sequence[str], world_size: int,
                    *, not_before: int = 0, refused: Iterable[int] = ()) -> tuple[tuple[int, ...], str]:
    """The complete replica steps (``complete_steps``), newest first; and, when there are none, why."""
    complete, why = complete_steps(held, members, world_size, not_before=not_before, refused=refused)
    return tuple(complete), why


def choose(job: Job, members: Sequence[str], world_size: int) -> Choice:
    """The source of the generation about to start on ``members`` (rank order) with ``world_size`` ranks."""
    durable = job.committed_step if job.committed_url is not None else 0
    if not every(job) or isinstance(job.replica_secret, msgspec.UnsetType):
        return Choice("durable", durable, "replicas_off")
    held = () if isinstance(job.replica_held, msgspec.UnsetType) else job.replica_held
    refused = () if isinstance(job.replica_refused, msgspec.UnsetType) else job.replica_refused
    complete, why = complete_steps(held, members, world_size, not_before=max(durable, 1), refused=refused)
    if not complete:
        return Choice("durable", durable, why)
    step, ws = next(iter(complete.items()))
    reason = "newest_complete_replica"
    if ws != world_size:
        reason += f"_resharded_{ws}_to_{world_size}"
    return Choice("replica", step, reason, tuple(complete), ws)


class ReplicaFields(TypedDict, total=False):
    replica_secret: str
    replica_every: int
    replica_step: int
    replica_buddy: int


def command_fields(job: Job, choice: Choice, buddy: int | None = None) -> ReplicaFields:
    """StartGenerationCmd's replica fields for one node: none for a job without replicas (its bytes stay as
    before); ``buddy``: the node rank of its buddy (``buddies``)."""
    k = every(job)
    if not k or isinstance(job.replica_secret, msgspec.UnsetType):
        return {}
    fields: ReplicaFields = {"replica_secret": job.replica_secret, "replica_every": k}
    if choice.source == "replica":
        fields["replica_step"] = choice.step
    if buddy is not None:
        fields["replica_buddy"] = buddy
    return fields


CROSS_ZONE_USD_PER_GB = 0.01  # between zones of one region (AWS, GCP: about 0.01 $/GB each way)

_Zone = tuple[str, str, str]  # (cloud, region, zone): a failure domain


def _shift(group: list[int], zone: Sequence[_Zone], out: list[int]) -> None:
    """Buddies within ``group``: its nodes in (cloud, region, zone) order, each one's buddy the node m places
    further around (m: the most nodes one zone has). A permutation without fixed points; when no zone holds
    more than half the group every buddy is in another zone, else only 2m - n of the largest zone's nodes
    share their buddy's zone (the fewest any permutation can)."""
    order = sorted(group, key=lambda i: (zone[i], i))
    m = max(Counter(zone[i] for i in group).values())
    shift = m if m < len(order) else 1  # one zone: the ring
    for pos, i in enumerate(order):
        out[i] = order[(pos + shift) % len(order)]


def _spread(group: list[int], zone: Sequence[_Zone]) -> bool:
    """Every node of ``group`` can have its buddy in another zone: no zone holds more than half of it."""
    return len(group) >= 2 and 2 * max(Counter(zone[i] for i in group).values()) <= len(group)


def buddies(pools: Sequence[PoolKey]) -> list[int]:
    """For each node of a generation (rank order, by its pool), the node whose holder keeps its ranks' second
    copies. When the job spans zones, a node in another zone: of the same region first, then of the same
    cloud, then of another cloud (the egress grows in that order: ``buddy_usd_per_gb``); where the zones
    cannot give every node another zone (one zone with more than half the nodes), the fewest nodes keep a
    buddy of their own zone. A job in one zone keeps the ring: node i's buddy is node i + 1.

    Each node is the buddy of exactly one other (a permutation), so a holder keeps its own ranks' shards and
    one other node's: the memory bound holds wherever the buddies are. Built bottom-up: the nodes of a
    region spread among its zones when they can; those that cannot take in the spread groups of their
    cloud (smallest first) until they can, else move up to the cloud, then to the whole job."""
    n = len(pools)
    if n < 2:
        return list(range(n))
    zone = [(p.cloud, p.region, p.zone) for p in pools]
    left: list[int] = list(range(n))
    done: list[list[int]] = []
    for depth in (2, 1, 0):  # (cloud, region), (cloud,), the whole job
        groups: dict[tuple[str, ...], list[int]] = {}
        for i in left:
            groups.setdefault(zone[i][:depth], []).append(i)
        left = []
        for key, group in groups.items():
            for other in sorted((d for d in done if zone[d[0]][:depth] == key), key=len):
                if _spread(group, zone):
                    break
                done.remove(other)
                group = group + other
            if _spread(group, zone):
                done.append(group)
            else:
                left.extend(group)
    if left:
        done.append(left)
    out = list(range(n))
    for group in done:
        _shift(group, zone, out)
    return out


def zone_loss_covered(pools: Sequence[PoolKey]) -> bool:
    """Every node of a generation (rank order, by its pool) has its buddy in another zone: losing a whole zone
    at once - a spot reclaim takes every node a job has there - leaves a replica of each lost shard on a
    survivor. A job in one zone (where placement keeps it) is not covered: such a loss goes back to the
    durable checkpoint."""
    key = [(p.cloud, p.region, p.zone) for p in pools]
    return len(pools) >= 2 and all(key[b] != key[i] for i, b in enumerate(buddies(pools)))


def buddy_usd_per_gb(src: PoolKey, dst: PoolKey, cfg: CoreConfig) -> float:
    """$ per GB a copy from a node in ``src`` to its buddy in ``dst`` costs."""
    if src.cloud != dst.cloud:
        return cfg.cross_cloud_usd_per_gb
    if src.region != dst.region:
        return cfg.cross_region_usd_per_gb
    return CROSS_ZONE_USD_PER_GB if src.zone != dst.zone else 0.0


def egress_usd_h(job: Job, members: Sequence[Node], cfg: CoreConfig) -> float:
    """$/h of the buddies' copies of a generation on ``members`` (rank order): every k steps each node sends
    its ranks' shards (the checkpoint's size estimate / nodes) to its buddy (``buddies``), priced by where
    that node is (another zone, region or cloud; the same zone: free)."""
    k, n = every(job), len(members)
    if not k or n < 2:
        return 0.0
    step_s = job.step_time_s if job.step_time_s else job.spec.step_time_s_estimate
    copies_h = 3600.0 / (k * max(step_s, 1e-3))
    pools = [m.pool for m in members]
    rate = sum(buddy_usd_per_gb(pools[i], pools[b], cfg) for i, b in enumerate(buddies(pools)))
    return rate * (cfg.checkpoint_gb_estimate / n) * copies_h


def record_choice(tx: Tx, job: Job, choice: Choice, generation: int, world_size: int,
                  egress: float = 0.0) -> Job:
    """The audit entry ``recovery`` (``orchctl explain``) for a job with replicas, and the step tried;
    ``egress``: what the generation's buddy copies cost per hour (``egress_usd_h``)."""
    if not every(job):
        return job
    durable = job.committed_step if job.committed_url is not None else 0
    tx.record(job.job_id, "recovery", choice.reason, generation=generation, source=choice.source,
              replica_egress_usd_h=round(egress, 6),
              step=choice.step, durable_step=durable, replica_steps=list(choice.candidates[:4]),
              saved_world_size=choice.saved_world_size or None, world_size=world_size,
              refused=list(job.replica_refused) if isinstance(job.replica_refused, tuple) else [])
    return tx.update_job(job, replica_step=choice.step if choice.source == "replica" else 0)


def note_exit(tx: Tx, job: Job, ev: RanksExited) -> Job:
    """Keep the node's reported replicas (replacing what it reported before); a ``replica_unusable`` exit
    refuses the step the generation tried (the audit entry ``replica_refused``: the cause and the ranks' detail)."""
    changes: dict[str, object] = {}
    if not isinstance(ev.replica_lag_max, msgspec.UnsetType):
        gen, lag = job.replica_lag if isinstance(job.replica_lag, tuple) else (-1, 0)
        if ev.generation > gen or (ev.generation == gen and ev.replica_lag_max > lag):
            changes["replica_lag"] = (ev.generation, ev.replica_lag_max)
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
            detail = "" if isinstance(ev.detail, msgspec.UnsetType) else ev.detail[:300]
            tx.record(job.job_id, "replica_refused", cause(detail), generation=ev.generation, step=tried,
                      node_id=ev.node_id, detail=detail)
    return tx.update_job(job, **changes) if changes else job


_CAUSES = (("checksum", "checksum_mismatch"), ("shard layout", "layout_mismatch"), ("another model", "layout_mismatch"),
           ("world size", "world_size_mismatch"), ("no complete set", "incomplete"), ("absent", "absent"),
           ("OSError", "holder_unreachable"), ("ConnectionRefused", "holder_unreachable"),
           ("closed after", "holder_unreachable"), ("TimeoutError", "holder_unreachable"),
           ("timed out", "holder_unreachable"))


def cause(detail: str) -> str:
    """The audit's reason for a refused replica step, from the ranks' detail (the first match wins)."""
    for needle, why in _CAUSES:
        if needle in detail:
            return why
    return REPLICA_UNUSABLE


def expected_lost_work_s(job: Job, step_time_s: float, ckpt_interval_s: float | None, *,
                         uncovered: float = 0.0) -> float:
    """Expected seconds of work a failure without notice loses (the work since the last usable restore
    point, part of the restart cost r).

    Without replicas: half the durable checkpoint interval (failures land uniformly between saves). With
    replicas: a failure loses the step in flight plus the steps since the last complete replica (bound
    ``max_lost_steps`` = k' + 1 steps, k' the steps between the copies actually made; mean about k'/2 + 1
    with the copy of the last one still in flight), except in the share ``uncovered`` of failures replicas
    cannot cover (both copies of a shard lost: a node and its buddy at once, a zone reclaim when the
    buddies share the zone, the whole job), which fall back to the durable checkpoint."""
    step = max(step_time_s, 0.0)
    durable = 0.5 * ckpt_interval_s if ckpt_interval_s is not None and ckpt_interval_s > 0 else 0.5 * step
    bound = max_lost_steps(job)
    if bound is None:
        return durable
    k = bound - 1
    replica = min((k / 2 + 1) * step, durable) if durable > 0 else (k / 2 + 1) * step
    share = min(max(uncovered, 0.0), 1.0)
    return (1 - share) * replica + share * durable


def max_lost_steps(job: Job) -> int | None:
    """The bound on steps lost to one node vanishing with replicas; None without their cover. k + 1 when
    every copy ends within a step; the ranks skip a copy while the previous one is still in flight (so k
    adapts to the copy time), and the bound is then over the steps actually replicated: the largest lag the
    newest reporting generation saw (``replica_lag``, from RanksExited), when it is larger. A job with its
    own command is covered only once a generation reported that lag (a ``trainer.lib.Session`` script does;
    a program that ignores the replica variables never does, and keeps the durable checkpoint's bound)."""
    k = every(job)
    if not k:
        return None
    if not isinstance(job.replica_lag, tuple):
        return None if job.spec.trainer.command else k + 1
    return max(k + 1, job.replica_lag[1])
