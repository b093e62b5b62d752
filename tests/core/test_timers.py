"""The index of what comes due (timers.py) changes the cost of a Tick, never its decision.

- Property: random cooperative/chaotic runs (the action mix of test_properties.py, plus jobs no pool
  can place, long quiet stretches and price moves) decide every event twice - with the index the
  previous decisions kept, and with one freshly built from the records (every active job visited, every
  node and pending price checked: the full scan) - and the two decisions must be equal: commands, audit,
  dirty keys and every record.
- Quiet jobs are not visited: steady running jobs fall asleep until their next price evaluation,
  waiting jobs until a pool could place them; a confirmed price change, a backoff that expires or a
  node that falls silent wakes what it concerns.
"""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.core import CoreConfig, JobPhase, State, decide, state_from_records, state_to_records
from orchestrator.core import tick as tick_mod
from orchestrator.core.commands import CheckInstance, Launch
from orchestrator.core.inputs import JobSubmitted, LaunchFailed, LeaseChanged, Tick
from orchestrator.core.model import TERMINAL_JOB_PHASES
from orchestrator.core.timers import POOLS, PRICE, Timers
from orchestrator.core.tx import Tx
from tests.core import test_properties as tp
from tests.core.harness import Driver, pool, price, spec
from wire import AgentState, CheckpointPolicy, FailureReason, GenerationStarted, Heartbeat, MarketPolicy


def _fresh(s: State) -> State:
    """The same records with no index: decide builds it from the records (the full scan)."""
    return State(s.jobs, s.nodes, s.pools, s.meta)


class TwinWorld(tp.World):
    """test_properties' world, deciding every event with the kept index and with a fresh one."""

    def __init__(self, config: CoreConfig) -> None:
        super().__init__()
        self.state = State.empty(config)
        self.steps = 0

    def feed(self, ev: Any, redeliver_check: bool = True) -> None:
        before = self.state
        ref = decide(_fresh(before), ev, self.now)
        d = decide(before, ev, self.now)
        assert d.commands == ref.commands, (ev, d.commands, ref.commands)
        assert d.audit == ref.audit, (ev, d.audit, ref.audit)
        assert d.dirty == ref.dirty, ev
        assert state_to_records(d.state) == state_to_records(ref.state), ev
        assert isinstance(d.state.timers, Timers)
        _check_sweep_index(d.state)
        self.state = d.state
        self.steps += 1
        self.launches += [c for c in d.commands if isinstance(c, Launch)]


def _check_sweep_index(s: State) -> None:
    """The kept index of the sweeps' jobs against the records: every job of each sweep, and every sweep
    with an unfinished job among the open ones (open ones may be more: they close at a Tick)."""
    assert s.timers is not None
    members: dict[str, set[str]] = {}
    unfinished: set[str] = set()
    for job in s.jobs.values():
        if isinstance(sid := job.spec.sweep_id, str):
            members.setdefault(sid, set()).add(job.job_id)
            if job.phase not in TERMINAL_JOB_PHASES:
                unfinished.add(sid)
    assert {sid: set(ids) for sid, ids in s.timers.sweeps.items()} == members
    assert unfinished <= set(s.timers.open_sweeps)


quiet = st.tuples(st.just("quiet"), st.integers(1, 40), st.booleans())
twin_action = st.one_of(tp.action, quiet, quiet)


def _quiet(w: TwinWorld, ticks: int, beat: bool) -> None:
    """A quiet stretch: Ticks every tick_s, the live nodes heartbeating (the fast path) or not (with
    heartbeats, the cloud and agents first do what they were asked: jobs reach their steady state)."""
    if beat:
        w.cooperate()
        w.cooperate()
    for _ in range(ticks):
        w.now += tp.TICK_S
        if beat:
            for node in list(w.state.nodes.values()):
                if node.node_id in w.state.nodes and node.phase.value in ("registered", "running"):
                    st_ = AgentState.TRAINING if node.phase.value == "running" else AgentState.IDLE
                    w.feed(Heartbeat(node_id=node.node_id, seq=node.hb_seq + 1, ts=w.now, state=st_,
                                     job_id=node.job_id, generation=node.generation, step=node.step + 1,
                                     step_time_s=1.0))
        w.feed(Tick())


# calm runs: jobs reach their steady state (where they sleep) and budgets and deadlines run down
calm_action = st.one_of(
    st.just(("auto",)), quiet, quiet, quiet,
    st.tuples(st.just("price"), st.integers(0, 3), st.floats(0.05, 1.0)),
    st.tuples(st.just("exec"), st.integers(0, 9), st.sampled_from(["ok", "fail"])),
    st.tuples(st.just("notice"), st.integers(0, 99), st.booleans()),
    st.tuples(st.just("commit"), st.integers(0, 1)),
)
calm_spec = st.fixed_dictionaries(
    {
        "nodes": st.integers(1, 2),
        "nodes_min": st.just(1),
        "budget_usd": st.one_of(st.none(), st.floats(0.5, 5.0)),
        "deadline": st.one_of(st.none(), st.floats(600.0, 5_000.0)),
        "market": st.sampled_from(list(tp.MarketPolicy)),
        "total_steps": st.integers(500, 5000),
        # jobs of two sweeps, with caps (sweeps.py reads the index of the sweeps' jobs and open sweeps)
        "sweep": st.sampled_from([None, None, "sa", "sb"]),
        "sweep_budget_usd": st.one_of(st.none(), st.floats(0.5, 5.0)),
        "sweep_deadline": st.one_of(st.none(), st.floats(600.0, 5_000.0)),
    }
)


def _run(specs: list[dict], waiting: int, confirm: float, actions: list[tuple]) -> None:
    w = TwinWorld(CoreConfig(price_confirm_s=confirm, price_eval_interval_s=20.0))
    w.feed(LeaseChanged(revision=3))
    for i, pk in enumerate(tp.POOLS):
        w.feed(price(pk, 5.0 + i, od=tp.OD, ts=w.now))
    for i, sp in enumerate(specs):
        deadline = sp.pop("deadline")
        sp["nodes_max"] = max(sp["nodes"], sp["nodes_min"]) + 1
        deadline_ts = None if deadline is None else w.now + deadline
        sweep, sweep_budget, sweep_deadline = sp.pop("sweep", None), sp.pop("sweep_budget_usd", None), \
            sp.pop("sweep_deadline", None)
        if sweep is not None:
            sp["sweep_id"] = sweep
            if sweep_budget is not None:
                sp["sweep_budget_usd"] = sweep_budget
            if sweep_deadline is not None:
                sp["sweep_deadline_ts"] = w.now + sweep_deadline
        ck = CheckpointPolicy(url=f"file:///ck/job.{i}", save_s_estimate=20.0)
        w.feed(JobSubmitted(job_id=f"job.{i}", spec=spec(**sp, deadline_ts=deadline_ts, checkpoint=ck)))
    for i in range(waiting):  # a GPU no pool offers yet: pending until a price for it arrives
        ck = CheckpointPolicy(url=f"file:///ck/wait.{i}", save_s_estimate=20.0)
        w.feed(JobSubmitted(job_id=f"wait.{i}", spec=spec(nodes=1, gpu_type="H100", checkpoint=ck)))
    for k, a in enumerate(actions):
        if a[0] == "quiet":
            _quiet(w, a[1], a[2])
        else:
            w.act(a)
        if waiting and k == len(actions) // 2:  # the waiting jobs' GPU appears
            w.feed(price(pool("p5.48xlarge", "z3"), 9.0, od=tp.OD, ts=w.now, gpu="H100"))
    _quiet(w, 30, True)
    # the index a restart rebuilds from the records decides like the kept one too
    w.state = state_from_records(state_to_records(w.state))
    _quiet(w, 5, True)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(tp.job_spec, min_size=1, max_size=3),
    waiting=st.integers(0, 2),
    confirm=st.sampled_from([0.0, 60.0]),
    actions=st.lists(twin_action, min_size=10, max_size=60),
)
def test_kept_index_decides_like_a_full_scan(specs: list[dict], waiting: int, confirm: float,
                                             actions: list[tuple]) -> None:
    _run(specs, waiting, confirm, actions)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(calm_spec, min_size=1, max_size=3),
    waiting=st.integers(0, 1),
    confirm=st.sampled_from([0.0, 60.0]),
    actions=st.lists(calm_action, min_size=5, max_size=25),
)
def test_kept_index_decides_like_a_full_scan_in_calm_runs(specs: list[dict], waiting: int, confirm: float,
                                                          actions: list[tuple]) -> None:
    _run(specs, waiting, confirm, actions)


# --- quiet jobs are not visited -------------------------------------------------------------------


def _visits(monkeypatch: Any) -> list[str]:
    seen: list[str] = []
    orig = tick_mod.job_tick

    def spy(tx: Tx, job: Any, evals: list[int]) -> None:
        seen.append(job.job_id)
        orig(tx, job, evals)

    monkeypatch.setattr(tick_mod, "job_tick", spy)
    return seen


def _running(n: int, cfg: CoreConfig) -> Driver:
    drv = Driver(State.empty(cfg))
    drv(price(pool(), 10.0))
    for j in range(n):
        ck = CheckpointPolicy(url=f"file:///ck/r{j}", save_s_estimate=20.0)
        d = drv(JobSubmitted(job_id=f"r{j}", spec=spec(nodes=1, nodes_max=1, checkpoint=ck)))
        ids = drv.launched(d)
        drv.register(ids)
        drv(GenerationStarted(id=f"g{j}", node_id=ids[0], job_id=f"r{j}", generation=1, first_step=1, ts=drv.now))
        assert drv.state.jobs[f"r{j}"].phase == JobPhase.RUNNING
    return drv


def _beat(drv: Driver, dt: float) -> None:
    for nid, node in list(drv.state.nodes.items()):
        drv(Heartbeat(node_id=nid, seq=node.hb_seq + 1, ts=drv.now, state=AgentState.TRAINING,
                      job_id=node.job_id, generation=node.generation, step=node.step + 1, step_time_s=1.0))
    drv(Tick(), dt=dt)


def test_steady_and_waiting_jobs_sleep_and_wake_on_what_concerns_them(monkeypatch: Any) -> None:
    cfg = CoreConfig(price_confirm_s=0.0, price_eval_interval_s=60.0)
    drv = _running(3, cfg)
    for j in range(4):  # waiting: no pool offers H100
        ck = CheckpointPolicy(url=f"file:///ck/w{j}", save_s_estimate=20.0)
        drv(JobSubmitted(job_id=f"w{j}", spec=spec(nodes=1, gpu_type="H100", checkpoint=ck)))
    for _ in range(3):
        _beat(drv, 1.0)
    timers = drv.state.timers
    assert timers is not None and not timers.awake
    assert {k: v for k, v in timers.asleep.items()} == {**{f"r{j}": PRICE for j in range(3)},
                                                         **{f"w{j}": POOLS for j in range(4)}}
    seen = _visits(monkeypatch)
    _beat(drv, 1.0)
    assert seen == []  # nothing due: no job visited
    # the price evaluation comes due: the running jobs are visited, the waiting ones are not
    for _ in range(60):
        _beat(drv, 1.0)
    assert set(seen) == {"r0", "r1", "r2"}
    seen.clear()
    # a capacity change of a pool wakes the waiting jobs only; a confirmed price change wakes both kinds
    drv(msgspec.structs.replace(price(pool(), 10.0), capacity_hint=5.0))
    _beat(drv, 1.0)
    assert sorted(seen) == ["w0", "w1", "w2", "w3"]
    seen.clear()
    _beat(drv, 1.0)
    assert seen == []
    drv(price(pool(), 11.0))
    _beat(drv, 1.0)
    assert sorted(seen) == ["r0", "r1", "r2", "w0", "w1", "w2", "w3"]
    # a finished job leaves the index
    drv.state = state_from_records(state_to_records(drv.state))
    assert drv.state.timers is not None and len(drv.state.timers.awake) == 7


def test_a_backoff_that_expires_wakes_a_waiting_job_and_it_launches() -> None:
    cfg = CoreConfig(price_confirm_s=0.0, backoff_base_s=60.0)
    drv = Driver(State.empty(cfg))
    drv(price(pool(), 10.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_max=1, market=MarketPolicy.SPOT)))
    (la,) = [c for c in d.commands if isinstance(c, Launch)]
    drv(LaunchFailed(node_ids=la.node_ids, job_id="j1", pool=la.pool, token=la.token, reason=FailureReason.CAPACITY))
    for _ in range(3):
        drv(Tick(), dt=5.0)
    assert drv.state.jobs["j1"].phase == JobPhase.PENDING
    assert drv.state.timers is not None and drv.state.timers.asleep.get("j1") == POOLS
    launched = []
    for _ in range(20):
        d = drv(Tick(), dt=5.0)
        launched += [c for c in d.commands if isinstance(c, Launch)]
    assert launched and drv.state.jobs["j1"].phase == JobPhase.PLACING


def test_a_silent_node_is_found_though_its_heartbeats_never_touched_the_index() -> None:
    drv = _running(2, CoreConfig(price_confirm_s=0.0, heartbeat_timeout_s=10.0))
    for _ in range(30):  # both nodes heartbeat through the fast path (no index update)
        _beat(drv, 1.0)
    quiet_node = sorted(drv.state.nodes)[0]
    suspects = []
    for _ in range(15):  # one falls silent
        for nid, node in list(drv.state.nodes.items()):
            if nid != quiet_node:
                drv(Heartbeat(node_id=nid, seq=node.hb_seq + 1, ts=drv.now, state=AgentState.TRAINING,
                              job_id=node.job_id, generation=node.generation, step=node.step + 1))
        d = drv(Tick(), dt=1.0)
        suspects += [c.node_id for c in d.commands if isinstance(c, CheckInstance)]
    assert suspects == [quiet_node]
