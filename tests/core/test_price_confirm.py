"""Two signals before a price moves money (orchestrator/core/confirm.py, docs/core.md "Price confirmation").

A glitch shorter than ``price_confirm_s`` - a 1 s 1000x spike, an on-demand price of 0.0001, an unknown
pool at 0.0001 - leaves an audit record and nothing else; a price that holds moves the job as before.
Each glitch test also runs with ``price_confirm_s=0`` (the behaviour before confirmation) to show the
glitch did move money there.
"""

from __future__ import annotations

from typing import Any

import msgspec

from orchestrator.core import CoreConfig, JobPhase, State, job_cost_usd, state_to_records
from orchestrator.core.commands import Launch, Terminate
from orchestrator.core.inputs import JobSubmitted, Tick
from orchestrator.core.model import pool_record_key
from tests.core.harness import (
    AgentState,
    CheckpointCmd,
    CheckpointCommitted,
    Driver,
    GenerationStarted,
    Heartbeat,
    RanksExited,
    cmds,
    pool,
    price,
    spec,
)
from wire import CheckpointPolicy, Market, MarketPolicy

A = pool("p4d.24xlarge", "us-east-1a")
A_OD = pool("p4d.24xlarge", "us-east-1a", market=Market.ON_DEMAND)
C = pool("p4d.24xlarge", "us-east-1b")
UNKNOWN = pool("x9.glitch", "us-east-1a")
UNKNOWN_OD = pool("x9.glitch", "us-east-1a", market=Market.ON_DEMAND)
KNOWN = ("aws/p4d.24xlarge",)
AT_ONCE = CoreConfig(price_confirm_s=0.0)


def running(config: CoreConfig | None = None, spot: float = 10.0, **kw: Any) -> tuple[Driver, list[str]]:
    """One RUNNING job on spot pool A (on-demand 30 $/h), 1 node."""
    drv = Driver(State.empty(config or CoreConfig()))
    drv(price(A, spot))
    drv(price(A_OD, 30.0, None))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_min=1, nodes_max=1, total_steps=10**6, **kw)))
    ids = drv.launched(d)
    assert [la.pool for la in cmds(d, Launch)] == [A]
    drv.register(ids)
    drv(GenerationStarted(id="g", node_id=ids[0], job_id="j1", generation=1, first_step=1, ts=drv.now), dt=1)
    assert drv.job().phase == JobPhase.RUNNING
    return drv, ids


def run_for(drv: Driver, ids: list[str], seconds: float, dt: float = 5.0) -> list[Any]:
    """Heartbeats and a Tick every ``dt`` for ``seconds``; the commands decided meanwhile."""
    out: list[Any] = []
    t = 0.0
    while t < seconds:
        for nid in ids:
            node = drv.state.nodes.get(nid)
            if node is not None:
                drv(Heartbeat(node_id=nid, seq=node.hb_seq + 1, ts=drv.now, state=AgentState.TRAINING, job_id="j1",
                              generation=node.generation, step=node.step + 1, step_time_s=1.0))
        out.extend(drv(Tick(), dt=dt).commands)
        t += dt
    return out


def of(commands: list[Any], kind: type) -> list[Any]:
    """The commands of ``kind`` (agent commands unwrapped from SendToAgent)."""
    return [c for c in (getattr(c, "command", c) for c in commands) if isinstance(c, kind)]


def money_moves(commands: list[Any]) -> list[Any]:
    """Launches, terminations and checkpoints (pause / migrate / stop all start with one of them)."""
    return of(commands, Launch) + of(commands, Terminate) + of(commands, CheckpointCmd)


def audits(drv: Driver, action: str) -> list[Any]:
    return [a for d in drv.decisions for a in d.audit if a.action == action]


# --- glitches ---------------------------------------------------------------------------------------


def test_a_1s_1000x_spike_moves_nothing_and_costs_nothing_extra() -> None:
    drv, ids = running(spot=0.029)
    twin, twin_ids = running(spot=0.029)
    drv(price(A, 29.0), dt=10)  # 1000x: 0.97 of on-demand, above the pause ratio
    twin(Tick(), dt=10)
    out = run_for(drv, ids, 1.0, dt=1.0)
    run_for(twin, twin_ids, 1.0, dt=1.0)
    drv(price(A, 0.029))  # back after 1 s
    out += run_for(drv, ids, 600.0)
    run_for(twin, twin_ids, 600.0)
    assert drv.now == twin.now
    assert money_moves(out) == [] and drv.job().phase == JobPhase.RUNNING
    (note,) = audits(drv, "price_unconfirmed")
    assert note.details["pool"] == A.name and note.details["price_usd_h"] == 29.0
    assert drv.state.pools[A.name].price_usd_h == 0.029
    assert job_cost_usd(drv.state, "j1", drv.now) == job_cost_usd(twin.state, "j1", twin.now)


def test_the_same_spike_paused_the_job_without_confirmation() -> None:
    drv, ids = running(AT_ONCE, spot=0.029)
    drv(price(A, 29.0), dt=10)
    out = run_for(drv, ids, 1.0, dt=1.0)
    assert [c.reason for c in money_moves(out)] == ["price_pause"]


def test_a_spike_on_a_budget_job_never_stops_it() -> None:
    # 290 $/h for 1 s: the termination tail alone (at the glitch price) is over the budget.
    drv, ids = running(budget_usd=2.0)
    drv(price(A, 290.0), dt=10)
    out = run_for(drv, ids, 1.0, dt=1.0)
    drv(price(A, 10.0))
    out += run_for(drv, ids, 120.0)
    assert money_moves(out) == [] and drv.job().phase == JobPhase.RUNNING
    glitched, _ = running(AT_ONCE, budget_usd=2.0)
    d = glitched(price(A, 290.0), dt=10)
    assert cmds(d, Terminate) and glitched.job().phase == JobPhase.STOPPED  # before: a hard stop


def test_an_on_demand_price_of_0_0001_for_1s_migrates_nothing() -> None:
    drv, ids = running()
    out = run_for(drv, ids, 60.0)
    drv(price(A_OD, 0.0001, None))
    out += run_for(drv, ids, 1.0, dt=1.0)
    drv(price(A_OD, 30.0, None))
    out += run_for(drv, ids, 600.0)
    assert money_moves(out) == [] and drv.job().phase == JobPhase.RUNNING
    assert [a.details["pool"] for a in audits(drv, "price_unconfirmed")] == [A_OD.name]
    glitched, gids = running(AT_ONCE)
    run_for(glitched, gids, 60.0)
    glitched(price(A_OD, 0.0001, None))
    moved = run_for(glitched, gids, 5.0)
    assert [la.pool for la in of(moved, Launch)] == [A_OD]


def test_an_unknown_pool_at_0_0001_is_never_a_launch_target() -> None:
    cfg = CoreConfig(known_instance_types=KNOWN)
    drv, ids = running(cfg)
    out = run_for(drv, ids, 60.0)
    drv(price(UNKNOWN, 0.0001))  # nobody configured x9.glitch; it never sends another tick
    out += run_for(drv, ids, 3600.0, dt=30.0)
    assert money_moves(out) == [] and drv.job().phase == JobPhase.RUNNING
    # the tick created the spot pool and its on-demand pool: both pending, audited once each
    assert [a.details["pool"] for a in audits(drv, "price_unconfirmed")] == [UNKNOWN.name, UNKNOWN_OD.name]
    # a new job launches into the known pool, not the unknown one
    d = drv(JobSubmitted(job_id="j2", spec=spec(nodes=1, nodes_min=1, nodes_max=1, market=MarketPolicy.SPOT,
                                                checkpoint=CheckpointPolicy(url="file:///ckpt/j2"))))
    assert [la.pool for la in cmds(d, Launch)] == [A]
    glitched, gids = running(AT_ONCE)
    run_for(glitched, gids, 60.0)
    glitched(price(UNKNOWN, 0.0001))
    moved = run_for(glitched, gids, 5.0)
    assert [la.pool for la in of(moved, Launch)] == [UNKNOWN]  # before: every node moved


def test_without_a_list_a_new_instance_type_needs_a_second_tick() -> None:
    drv, ids = running()  # no known_instance_types: aws/p4d.24xlarge is known from its pools
    out = run_for(drv, ids, 60.0)
    drv(price(UNKNOWN, 0.0001))
    out += run_for(drv, ids, 3600.0, dt=30.0)  # Ticks alone never confirm a never-priced pool
    assert money_moves(out) == [] and drv.state.pools[UNKNOWN.name].price_usd_h is None
    d = drv(JobSubmitted(job_id="j2", spec=spec(nodes=1, nodes_min=1, nodes_max=1, market=MarketPolicy.SPOT,
                                                checkpoint=CheckpointPolicy(url="file:///ckpt/j2"))))
    assert [la.pool for la in cmds(d, Launch)] == [A]
    drv(price(UNKNOWN, 0.0001))  # the second signal, an hour after the first
    assert drv.state.pools[UNKNOWN.name].price_usd_h == 0.0001


def test_the_first_feed_round_of_a_cloud_is_known_at_once() -> None:
    drv = Driver()
    drv(price(A, 10.0))
    drv(price(UNKNOWN, 9.0), dt=1)  # same round: a new cloud's types all count
    assert drv.state.pools[UNKNOWN.name].price_usd_h == 9.0
    drv(price(pool("x8.later", "us-east-1a"), 8.0), dt=120)  # a new type long after: pending
    assert drv.state.pools[pool("x8.later", "us-east-1a").name].price_usd_h is None
    drv(price(pool("g9.other", "zone-a", cloud="gcp", region="r"), 7.0))  # a new cloud: its first round
    assert drv.state.pools[pool("g9.other", "zone-a", cloud="gcp", region="r").name].price_usd_h == 7.0


def test_a_new_pool_is_a_move_target_only_after_its_price_held() -> None:
    drv, ids = running()
    run_for(drv, ids, 60.0)
    drv(price(C, 1.0))  # a known pool, first price: confirmed for new launches at once
    assert drv.state.pools[C.name].price_usd_h == 1.0
    early = run_for(drv, ids, 55.0)
    assert money_moves(early) == []
    later = run_for(drv, ids, 120.0)
    assert [la.pool for la in of(later, Launch)] == [C]
    assert audits(drv, "migrate")[0].reason == "cheaper_pool"


# --- prices that hold -------------------------------------------------------------------------------


def test_one_tick_and_silence_moves_nothing() -> None:
    """One tick of a known pool at 0.01 $/h (from 1.3), no tick after it: time alone never confirms it,
    however long; the second agreeing tick does, and only then does the job move."""
    drv, ids = running(CoreConfig(price_confirm_s=60.0), spot=1.3)
    drv(price(C, 1.3))
    run_for(drv, ids, 700.0, dt=20.0)  # C held long enough to be a migration target
    drv(price(C, 0.01), dt=1)
    out = run_for(drv, ids, 3600.0, dt=20.0)
    assert money_moves(out) == [] and drv.state.pools[C.name].price_usd_h == 1.3
    drv(price(C, 0.01))  # a second observation that agrees
    assert drv.state.pools[C.name].price_usd_h == 0.01
    assert audits(drv, "price_confirmed")[-1].reason == "second_tick"


def test_a_rise_that_holds_pauses_after_price_confirm_s() -> None:
    drv, ids = running(CoreConfig(price_confirm_s=30.0))
    drv(price(A, 29.0), dt=10)
    seen = drv.now
    early = run_for(drv, ids, 25.0)
    drv(price(A, 29.1))  # within the tolerance, too early: neither restarted, confirmed nor audited again
    early += run_for(drv, ids, 15.0, dt=1.0)  # past price_confirm_s: time alone confirms nothing
    assert money_moves(early) == [] and len(audits(drv, "price_unconfirmed")) == 1
    assert drv.state.pools[A.name].price_usd_h == 10.0
    drv(price(A, 29.0))  # the second observation, after price_confirm_s
    later = run_for(drv, ids, 10.0)
    assert [c.reason for c in money_moves(later)] == ["price_pause"]
    ps = drv.state.pools[A.name]
    assert ps.price_usd_h == 29.0 and ps.price_ts == seen and ps.seen_ts is msgspec.UNSET


def test_a_price_that_keeps_changing_restarts_the_confirmation() -> None:
    drv, ids = running()
    drv(price(A, 29.0), dt=10)
    run_for(drv, ids, 50.0)
    drv(price(A, 20.0))  # outside the tolerance: a new pending price from now
    run_for(drv, ids, 50.0)
    drv(price(A, 20.0))  # agrees, but only 50 s after it was first seen
    assert drv.state.pools[A.name].price_usd_h == 10.0
    run_for(drv, ids, 15.0)
    drv(price(A, 20.0))
    assert drv.state.pools[A.name].price_usd_h == 20.0
    assert [a.details["price_usd_h"] for a in audits(drv, "price_unconfirmed")] == [29.0, 20.0]


def test_cost_accrues_at_the_confirmed_price() -> None:
    drv, ids = running()
    t0, c0 = drv.now, job_cost_usd(drv.state, "j1", drv.now)
    drv(price(A, 20.0))
    run_for(drv, ids, 60.0)
    drv(price(A, 20.0))  # the second observation confirms it (billed from now on)
    t1, c1 = drv.now, job_cost_usd(drv.state, "j1", drv.now)
    assert abs((c1 - c0) - 10.0 * (t1 - t0) / 3600.0) < 1e-9  # the pending 20 $/h was not billed
    run_for(drv, ids, 60.0)
    c2 = job_cost_usd(drv.state, "j1", drv.now)
    assert abs((c2 - c1) - 20.0 * (drv.now - t1) / 3600.0) < 1e-9


def test_a_budget_stop_after_a_confirmed_rise_checkpoints_before_it_terminates() -> None:
    drv, ids = running(budget_usd=2.0)
    drv(price(A, 28.0), dt=5)  # below the pause ratio; the stop comes sooner once it is confirmed
    out: list[Any] = []
    while not of(out, CheckpointCmd):
        out += run_for(drv, ids, 5.0)
        assert drv.now < 2000.0
    moves = money_moves(out)
    assert [type(c).__name__ for c in moves] == ["CheckpointCmd"] and moves[0].reason == "budget"
    assert not audits(drv, "stop")[0].reason.endswith("hard_stop")
    job = drv.job()
    drv(CheckpointCommitted(id="c", node_id=ids[0], job_id="j1", generation=job.generation, step=50,
                            checkpoint_id="s50", url="u50", save_s=5.0, ts=drv.now), dt=1)
    d = drv(RanksExited(id="x", node_id=ids[0], job_id="j1", generation=job.generation, exit_code=75,
                        reason="checkpoint", last_step=50, ts=drv.now))
    assert cmds(d, Terminate) and drv.job().phase == JobPhase.STOPPED
    assert drv.job().cost_usd <= 2.0


# --- settings and records ---------------------------------------------------------------------------


def test_confirmation_off_applies_prices_at_once() -> None:
    drv, _ = running(AT_ONCE)
    drv(price(A, 20.0), dt=1)
    assert drv.state.pools[A.name].price_usd_h == 20.0 and not audits(drv, "price_unconfirmed")


def test_new_fields_are_not_encoded_by_default() -> None:
    drv, _ = running()
    recs = state_to_records(drv.state)
    assert b"price_confirm_s" not in recs["meta"] and b"known_instance_types" not in recs["meta"]
    assert b"seen_" not in recs[pool_record_key(A.name)]
    drv(price(A, 20.0), dt=1)
    assert b"seen_ts" in state_to_records(drv.state)[pool_record_key(A.name)]
