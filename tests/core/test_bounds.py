"""Hostile numbers (security issue items 3 and 7): the state codec refuses non-finite floats, prices are
bounded before any arithmetic, a notice's deadline is clamped into its node's notice window."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest

from orchestrator.core import CoreConfig, Job, JobPhase, Meta, Node, NodePhase, PoolStats, State, decide
from orchestrator.core.costs import burn_usd_h, cost_now, live_step_time, worst_burn_usd_h
from orchestrator.core.inputs import JobSubmitted, Tick
from orchestrator.core.model import pool_record_key
from orchestrator.core.placement import ranked
from orchestrator.core.pricing import MAX_DURATION_S, remaining_work_s, save_seconds
from orchestrator.core.records import NonFiniteRecord, check_records, state_from_records, state_to_records
from orchestrator.core.tx import Tx
from tests.core.harness import (
    AgentState,
    CheckpointCommitted,
    Driver,
    GenerationStarted,
    Heartbeat,
    cmds,
    pool,
    price,
    spec,
)
from wire import CheckpointCmd, Market, NoticeKind, PreemptionNotice, TrainerSpec

R = msgspec.structs.replace
A = pool("p4d.24xlarge", "us-east-1a")
A_OD = pool("p4d.24xlarge", "us-east-1a", market=Market.ON_DEMAND)
B = pool("p4de.24xlarge", "us-east-1a")
EXTREMES = (1e308, -1e308, 5e-324, 0.0)

# --- the codec: every float field of every persisted record -------------------------------------------

Path = tuple[str, ...]  # attribute names; "{}" = a dict's values


def _float_paths(t: mi.Type, path: Path, seen: frozenset[type]) -> Iterator[Path]:
    if isinstance(t, mi.FloatType):
        yield path
    elif isinstance(t, mi.StructType) and t.cls not in seen:
        for f in t.fields:
            yield from _float_paths(f.type, (*path, f.name), seen | {t.cls})
    elif isinstance(t, mi.UnionType):
        for x in t.types:
            yield from _float_paths(x, path, seen)
    elif isinstance(t, mi.DictType):
        yield from _float_paths(t.value_type, (*path, "{}"), seen)
    elif isinstance(t, (mi.VarTupleType, mi.ListType)):
        assert not list(_float_paths(t.item_type, path, seen)), f"a float in a sequence at {path}: extend the test"
    elif isinstance(t, mi.TupleType):
        assert not any(list(_float_paths(x, path, seen)) for x in t.item_types), path


def float_paths(cls: type) -> list[Path]:
    return sorted(set(_float_paths(mi.type_info(cls), (), frozenset())))


def _set(obj: Any, path: Path, value: float) -> Any:
    if path[0] == "{}":
        return {"x": value}
    if len(path) == 1:
        return R(obj, **{path[0]: value})
    inner = getattr(obj, path[0])
    if inner is None or (isinstance(inner, dict) and path[1] == "{}"):
        return R(obj, **{path[0]: {"x": value}}) if path[1] == "{}" else obj
    return R(obj, **{path[0]: _set(inner, path[1:], value)})


def _base_state() -> State:
    sp = spec(trainer=TrainerSpec(args={"lr": 0.1}), budget_usd=5.0, deadline_ts=2e9)
    job = Job(job_id="j1", spec=sp, phase_ts=1.0, submitted_ts=1.0, target_nodes=2, nodes=("j1-n1",))
    node = Node(node_id="j1-n1", job_id="j1", pool=A, pool_name=A.name, token="j1-L1", phase_ts=1.0,
                requested_ts=1.0, phase=NodePhase.BOOTING)
    ps = PoolStats(pool=A, gpu_type="A100", gpus_per_node=8, price_usd_h=1.0)
    return State.empty().__class__(
        State.empty().jobs.set("j1", job), State.empty().nodes.set("j1-n1", node),
        State.empty().pools.set(A.name, ps), Meta())


RECORDS = [("job.j1", "jobs", "j1", Job), ("node.j1-n1", "nodes", "j1-n1", Node),
           (pool_record_key(A.name), "pools", A.name, PoolStats), ("meta", "meta", None, Meta)]


def _with(state: State, where: str, ident: str | None, path: Path, value: float) -> State:
    if where == "meta":
        return R(state, meta=_set(state.meta, path, value))
    records = getattr(state, where)
    return R(state, **{where: records.set(ident, _set(records[ident], path, value))})


def test_every_float_field_is_enumerated() -> None:
    paths = {cls.__name__: float_paths(cls) for _, _, _, cls in RECORDS}
    assert ("cost_usd",) in paths["Job"] and ("spec", "budget_usd") in paths["Job"]
    assert ("spec", "trainer", "args", "{}") in paths["Job"]
    assert ("noticed_until",) in paths["PoolStats"] and ("config", "max_price_usd_h") in paths["Meta"]
    assert sum(map(len, paths.values())) > 70


@pytest.mark.parametrize("key,where,ident,cls", RECORDS, ids=[r[0] for r in RECORDS])
def test_every_float_field_round_trips_extreme_finite_values(key: str, where: str, ident: str | None,
                                                             cls: type) -> None:
    base = _base_state()
    for path in float_paths(cls):
        for value in EXTREMES:
            s = _with(base, where, ident, path, value)
            recs = state_to_records(s)
            back = state_from_records(recs)
            assert back == s, (key, path, value)
            assert state_to_records(back) == recs


@pytest.mark.parametrize("key,where,ident,cls", RECORDS, ids=[r[0] for r in RECORDS])
def test_every_float_field_refuses_inf_and_nan(key: str, where: str, ident: str | None, cls: type) -> None:
    base = _base_state()
    for path in float_paths(cls):
        for value in (math.inf, -math.inf, math.nan):
            s = _with(base, where, ident, path, value)
            with pytest.raises(NonFiniteRecord, match="non-finite"):
                state_to_records(s, [key])
            with pytest.raises(NonFiniteRecord):
                check_records(s, [key])
            state_to_records(s, [k for k, *_ in RECORDS if k != key])  # the other records still encode


def test_a_decision_that_would_write_inf_raises_inside_decide() -> None:
    """The safety net: a record carrying inf never leaves the core (the shell skips the event)."""
    s = _base_state()
    tx = Tx(s, "Tick", 10.0)
    tx.update_job(s.jobs["j1"], cost_usd=math.inf)
    with pytest.raises(NonFiniteRecord, match=r"job\.j1\.cost_usd"):
        tx.decision()


# --- prices: bounded before arithmetic -------------------------------------------------------------


def _ignored(d: Any) -> bool:
    return d.state is not None and any(a.reason == "bad_price" for a in d.audit) and not d.dirty


@pytest.mark.parametrize("usd,od", [(1e308, 30.0), (1e308, None), (1001.0, None), (10.0, 1e308), (301.0, 30.0)])
def test_absurd_price_ticks_are_ignored(usd: float, od: float | None) -> None:
    s = State.empty()
    d = decide(s, price(A, usd, od), 100.0)
    assert _ignored(d) and d.state is s


def test_spot_band_uses_the_pools_on_demand_price_when_the_tick_has_none() -> None:
    s = decide(State.empty(), price(A, 10.0, 30.0), 100.0).state
    assert _ignored(decide(s, price(A, 301.0, None), 101.0))
    assert decide(s, price(A, 299.0, None), 101.0).state.pools[A.name].seen_usd_h == 299.0  # in band: pending
    s = decide(State.empty(), price(A_OD, 20.0, None), 100.0).state  # the on-demand pool of the same key
    assert _ignored(decide(s, price(A, 201.0, None), 101.0))


def test_prices_at_the_bounds_are_admitted_and_costs_stay_finite() -> None:
    cfg = CoreConfig()
    s = decide(State.empty(), price(A, cfg.price_ceiling_usd_h(), cfg.price_ceiling_usd_h()), 100.0).state
    assert s.pools[A.name].price_usd_h == cfg.price_ceiling_usd_h()
    assert s.pools[A_OD.name].price_usd_h == cfg.price_ceiling_usd_h()


def _running_budget_job(budget: float) -> tuple[Driver, list[str]]:
    drv = Driver()
    drv(price(A, 10.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_max=1, budget_usd=budget)))
    ids = drv.launched(d)
    drv.register(ids)
    drv(GenerationStarted(id="g", node_id=ids[0], job_id="j1", generation=1, first_step=1, ts=drv.now), dt=0.3)
    assert drv.job().phase == JobPhase.RUNNING
    return drv, ids


def test_one_absurd_tick_never_stops_a_job_with_budget_left() -> None:
    drv, _ = _running_budget_job(1000.0)
    tx = Tx(drv.state, "Tick", drv.now)
    assert 0 < cost_now(tx, drv.job()) < 0.01
    d = drv(price(A, 1e308, 1e308), dt=0.1)
    assert any(a.reason == "bad_price" for a in d.audit) and not d.commands
    drv(Tick(), dt=1.0)
    assert drv.job().phase == JobPhase.RUNNING and drv.job().cost_usd == 0.0
    # the highest admitted prices: the burn and the tail are finite, the job is not hard-stopped
    cfg = drv.state.config
    drv(price(A, cfg.price_ceiling_usd_h(), cfg.price_ceiling_usd_h()), dt=0.1)
    tx = Tx(drv.state, "Tick", drv.now + 3600.0)
    job = drv.job()
    assert all(math.isfinite(x) for x in (burn_usd_h(tx, job), worst_burn_usd_h(tx, job), cost_now(tx, job)))
    assert not any(a.reason == "budget_hard_stop" for d in drv.decisions for a in d.audit)
    assert drv.job().phase == JobPhase.RUNNING


# --- notices: the deadline clamped into the node's own notice window -------------------------------


def _notice(node_id: str, deadline: float | None, cloud: str = "aws") -> PreemptionNotice:
    return PreemptionNotice(id=f"n-{node_id}-{deadline}", node_id=node_id, cloud=cloud, kind=NoticeKind.TERMINATE,
                            deadline_ts=deadline, observed_ts=0.0)


@pytest.mark.parametrize("deadline,cloud", [(1e300, "aws"), (1e300, "gcp"), (-1e300, "aws"), (None, "gcp"),
                                            (5e-324, "azure")])
def test_notice_deadline_clamped_into_the_nodes_window(deadline: float | None, cloud: str) -> None:
    drv, ids = _running_budget_job(1000.0)
    node = drv.state.nodes[ids[0]]
    assert node.pool.cloud == "aws"
    window = drv.state.config.notice_window_s("aws")  # the node's cloud, whatever the event names
    now = drv.now + 1.0
    d = drv(_notice(ids[0], deadline, cloud), dt=1.0)
    expect = now + window if deadline is None or deadline > now else now
    node = drv.state.nodes[ids[0]]
    assert node.phase == NodePhase.NOTICED and node.notice_deadline == expect
    (ck,) = cmds(d, CheckpointCmd)  # a wrong clock still gets its checkpoint
    assert ck.deadline_ts == expect
    assert drv.state.pools[A.name].noticed_until == expect + drv.state.config.notice_skip_grace_s
    state_from_records(state_to_records(drv.state))


def test_pool_reopens_after_a_far_future_notice() -> None:
    drv, ids = _running_budget_job(1000.0)
    drv(price(B, 11.0))
    drv(_notice(ids[0], 1e300), dt=1.0)
    until = drv.state.pools[A.name].noticed_until
    assert until <= drv.now + 120.0 + 60.0
    spot = frozenset({Market.SPOT})

    def feasible(now: float) -> set[str]:
        return {name for _, name, _ in ranked(drv.state.pools, drv.job(), 1, 0, drv.state.config, now, markets=spot)}

    assert A.name not in feasible(until - 1.0) and B.name in feasible(until - 1.0)
    assert A.name in feasible(until + 1.0)  # reopened after deadline + grace


def test_huge_agent_durations_keep_costs_finite_and_never_hard_stop_the_budget_job() -> None:
    """Without the shell's screen (a direct caller): a save/step time of 1e308 s is read capped at a
    week, so burn x save time and steps x step time stay finite and every record stays persistable. (A
    week-long save at 10 $/h does not fit the $1,000 left: the soft stop with a final checkpoint is the
    policy's answer; what must not happen is an overflow or a hard stop.)"""
    drv, ids = _running_budget_job(1000.0)
    for nid in ids:
        node = drv.state.nodes[nid]
        drv(Heartbeat(node_id=nid, seq=node.hb_seq + 1, ts=drv.now, state=AgentState.TRAINING, job_id="j1",
                      generation=node.generation, step=3, step_time_s=1e308), dt=0.1)
    drv(CheckpointCommitted(id="c", node_id=ids[0], job_id="j1", generation=drv.job().generation, step=3,
                            checkpoint_id="s3", url="file:///ckpt/j1/s3", save_s=1e308, ts=drv.now), dt=0.1)
    drv(Tick(), dt=1.0)
    tx = Tx(drv.state, "Tick", drv.now)
    job = drv.job()
    assert remaining_work_s(job, 3, live_step_time(tx, job)) <= 1000 * MAX_DURATION_S
    assert save_seconds(job) <= MAX_DURATION_S and math.isfinite(cost_now(tx, job))
    assert not any(a.reason == "budget_hard_stop" for d in drv.decisions for a in d.audit)
    assert drv.job().phase != JobPhase.STOPPED
    state_from_records(state_to_records(drv.state))
