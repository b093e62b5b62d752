"""The demo's report, derived from the trainer's own step logs (pure functions, no I/O but ``load_step_logs``).

Role: turn ORCH_STEP_LOG records (generation, step, rank, world size, loss, sample ids, ts) and the list
of injected faults into the figures ``orchctl demo`` prints. Nothing here trusts what the daemon says
about itself:

- ``steps_completed``: distinct steps executed; ``final_loss``: the loss of the last step (its last
  execution, rank 0's record);
- ``generations``: generations that executed at least one step;
- per injected preemption (``kind`` notice | vanished, at wall time ``t``; a vanished on-demand node is
  listed under ``node_failures`` instead, with the same figures: the cloud cannot preempt it): the generation running at
  ``t`` (the newest one whose first step is before ``t``), the next generation (the first whose first
  step is after ``t``), ``lost_steps`` = steps of the hit generation that the next generation executed
  again, ``recovery_s`` = the next generation's first step time - ``t``;
- per price spike: the generation it ended (orchd moved the job) and ``move_s`` = spike -> first step
  of the next generation (training continues while the new nodes boot: make before break);
- ``steps_executed_twice``: every step executed in more than one generation (preemptions, resizes,
  migrations alike);
- ``sample_order_exact``: the trajectory that counts (the last execution of each step) consumed every
  sample id at most once, and every re-executed step fed exactly the same sample ids.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Rec:
    generation: int
    step: int
    rank: int
    world_size: int
    loss: float
    sample_ids: tuple[int, ...]
    ts: float
    node: str = ""  # the node whose step log held the record


@dataclass(frozen=True, slots=True)
class Injection:
    kind: str  # notice | vanished | price_spike
    ts: float
    node: str = ""
    detail: str = ""


def load_step_logs(paths: Iterable[Path]) -> list[Rec]:
    """Records of ORCH_STEP_LOG files; a file at ``<node>/steps/<job>.jsonl`` tags them with <node>."""
    out = []
    for p in paths:
        node = p.parent.parent.name if p.parent.name == "steps" else ""
        for line in p.read_text().splitlines():
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill -9
            out.append(Rec(int(d["generation"]), int(d["step"]), int(d["rank"]), int(d["world_size"]),
                           float(d["loss"]), tuple(d.get("sample_ids") or ()), float(d["ts"]), node))
    return sorted(out, key=lambda r: (r.ts, r.generation, r.step, r.rank))


@dataclass(frozen=True, slots=True)
class GenInfo:
    generation: int
    world_size: int
    first_step: int
    last_step: int
    first_ts: float
    last_ts: float
    steps: frozenset[int]
    nodes: tuple[str, ...] = ()


def generations(recs: Sequence[Rec]) -> list[GenInfo]:
    by: dict[int, list[Rec]] = defaultdict(list)
    for r in recs:
        by[r.generation].append(r)
    out = []
    for g, rs in by.items():
        steps = frozenset(r.step for r in rs)
        out.append(GenInfo(g, max(r.world_size for r in rs), min(steps), max(steps), min(r.ts for r in rs),
                           max(r.ts for r in rs), steps, tuple(sorted({r.node for r in rs if r.node}))))
    return sorted(out, key=lambda gi: gi.first_ts)


def loss_by_step(recs: Sequence[Rec]) -> dict[int, float]:
    """The loss of each step's last execution (rank 0's record, else the lowest rank's)."""
    best: dict[int, Rec] = {}
    for r in recs:
        cur = best.get(r.step)
        if cur is None or (r.generation, -r.rank) > (cur.generation, -cur.rank):
            best[r.step] = r
    return {s: r.loss for s, r in sorted(best.items())}


def sample_order_exact(recs: Sequence[Rec]) -> bool:
    """Every step's complete executions fed the same sample ids, an interrupted one (fewer ranks logged it:
    a peer died inside the step) a subset of them, and the executions that count never share an id."""
    fed: dict[tuple[int, int], set[int]] = defaultdict(set)  # (generation, step) -> sample ids of all ranks
    ranks: dict[tuple[int, int], set[int]] = defaultdict(set)
    size: dict[tuple[int, int], int] = {}
    for r in recs:
        fed[(r.generation, r.step)].update(r.sample_ids)
        ranks[(r.generation, r.step)].add(r.rank)
        size[(r.generation, r.step)] = r.world_size
    per_step: dict[int, list[tuple[frozenset[int], bool]]] = defaultdict(list)
    for (g, s), ids in sorted(fed.items()):
        per_step[s].append((frozenset(ids), len(ranks[(g, s)]) >= size[(g, s)]))
    seen: set[int] = set()
    for s in sorted(per_step):
        complete = [ids for ids, full in per_step[s] if full]
        if not complete:
            return False  # no execution of this step finished on every rank
        final = complete[-1]
        if any(ids != final for ids in complete) or any(not ids <= final for ids, full in per_step[s] if not full):
            return False  # a re-executed step fed other samples
        if seen & final:
            return False  # a sample consumed twice
        seen |= final
    return True


def compute_report(recs: Sequence[Rec], injections: Sequence[Injection], *, total_steps: int,
                   node_pools: dict[str, str] | None = None) -> dict:
    """The report (see the module docstring). ``node_pools``: node -> pool name, to label generations."""
    node_pools = node_pools or {}
    gens = generations(recs)
    losses = loss_by_step(recs)
    executed_in: dict[int, set[int]] = defaultdict(set)
    for r in recs:
        executed_in[r.step].add(r.generation)
    twice = sorted(s for s, g in executed_in.items() if len(g) > 1)
    preemptions: list[dict] = []
    failures: list[dict] = []
    for inj in sorted(injections, key=lambda i: i.ts):
        if inj.kind not in ("notice", "vanished"):
            continue
        hit = [g for g in gens if g.first_ts <= inj.ts]
        nxt = [g for g in gens if g.first_ts > inj.ts]
        market = node_pools[inj.node].rsplit("/", 1)[-1] if inj.node in node_pools else None
        entry: dict = {"kind": inj.kind, "node": inj.node, "ts": round(inj.ts, 3), "market": market}
        if hit and nxt:
            h, n = hit[-1], nxt[0]
            entry.update(generation=h.generation, next_generation=n.generation,
                         lost_steps=sum(1 for s in h.steps if s >= n.first_step),
                         recovery_s=round(n.first_ts - inj.ts, 2),
                         last_step_before=max(s for s in h.steps), first_step_after=n.first_step)
        else:
            entry.update(lost_steps=None, recovery_s=None)
        # an on-demand node that vanished failed: the cloud cannot preempt it (orchd does not count it either)
        (failures if market == "on_demand" else preemptions).append(entry)
    spikes = []
    for inj in injections:
        if inj.kind != "price_spike":
            continue
        nxt = [g for g in gens if g.first_ts > inj.ts]
        hit = [g for g in gens if g.first_ts <= inj.ts]
        entry = {"ts": round(inj.ts, 3), "detail": inj.detail}
        if nxt and hit:
            entry.update(generation=hit[-1].generation, next_generation=nxt[0].generation,
                         lost_steps=sum(1 for s in hit[-1].steps if s >= nxt[0].first_step),
                         move_s=round(nxt[0].first_ts - inj.ts, 2))
        spikes.append(entry)
    last = max(losses) if losses else 0
    return {
        "steps_completed": len(losses),
        "total_steps": total_steps,
        "final_loss": round(losses[last], 6) if losses else None,
        "generations": len(gens),
        "preemptions": preemptions,
        "node_failures": failures,
        "price_spikes": spikes,
        "steps_executed_twice": len(twice),
        "sample_order_exact": sample_order_exact(recs),
        "generation_table": [
            {"generation": g.generation, "world_size": g.world_size, "first_step": g.first_step,
             "last_step": g.last_step, "steps": len(g.steps),
             "nodes": {n: node_pools.get(n, "") for n in g.nodes}} for g in gens
        ],
    }
