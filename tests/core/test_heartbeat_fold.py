"""``fold_heartbeats`` (orchestrator/core/decide.py), the daemon's hot path: a run of heartbeats folded
through the trust gate's heartbeat rule and ``decide``'s fast path in one state rebuild gives the very
results of ``authorize`` then ``decide`` one by one - the same refusals, the same final state, an empty
``dirty`` and no command for every heartbeat it folds - and stops at the first heartbeat that needs the
slow path, whatever the nodes' and jobs' records and the heartbeats say (hypothesis)."""

from __future__ import annotations

import itertools
import math
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.core import NodePhase, State, authorize, decide
from orchestrator.core.decide import _heartbeat_fast, fold_heartbeats
from orchestrator.core.inputs import JobSubmitted
from tests.core.harness import Driver, pool, price, spec
from wire import AgentState, CheckpointPolicy, GenerationStarted, Heartbeat

A = pool("p4d.24xlarge", "us-east-1a")


def fleet() -> tuple[State, list[str], float]:
    """j1 and j2 training (2 nodes each), j3 started but not yet confirmed training (its first
    TRAINING heartbeat takes the slow path)."""
    drv = Driver()
    drv(price(A, 10.0))
    ids: list[str] = []
    for job in ("j1", "j2", "j3"):
        d = drv(JobSubmitted(job_id=job, spec=spec(nodes=2, nodes_min=2, nodes_max=2,
                                                   checkpoint=CheckpointPolicy(url=f"file:///ckpt/{job}"))))
        nodes = drv.launched(d)
        drv.register(nodes)
        ids += nodes
        if job != "j3":
            drv(GenerationStarted(id=f"g-{job}", node_id=nodes[0], job_id=job, generation=1, first_step=1,
                                  ts=drv.now), dt=1)
    return drv.state, ids, drv.now


STATE, IDS, NOW = fleet()
NAN, INF = math.nan, math.inf

# What a node's record may hold that changes the path a heartbeat takes.
node_changes = st.fixed_dictionaries({}, optional={
    "suspect_since": st.just(NOW - 5.0),
    "disconnected": st.just(True),
    "phase": st.sampled_from([NodePhase.BOOTING, NodePhase.REGISTERED, NodePhase.RUNNING, NodePhase.NOTICED]),
    "step": st.sampled_from([0, 5, 999, 2000]),
    "generation": st.sampled_from([0, 1, 2]),
    "loss": st.sampled_from([None, 1.5]),
    "step_time_s": st.sampled_from([None, 0.5]),
})


@st.composite
def heartbeat(draw: Any, ids: list[str]) -> Heartbeat:
    nid = draw(st.sampled_from([*ids, "ghost"]))
    node = STATE.nodes.get(nid)
    gen = node.generation if node is not None else 1
    return Heartbeat(
        node_id=nid,
        seq=draw(st.integers(0, 5)),
        ts=NOW,
        state=draw(st.sampled_from(list(AgentState))),
        job_id=draw(st.sampled_from([None, node.job_id if node is not None else "j1", "j2"])),
        generation=gen + draw(st.sampled_from([-1, 0, 0, 0, 1])),
        step=draw(st.sampled_from([0, 1, 5, 6, 500, 999, 1000, 1001, 10**6])),
        loss=draw(st.sampled_from([None, 2.0, 0.0, NAN, INF])),
        step_time_s=draw(st.sampled_from([None, 0.0, -0.0, 1.0, NAN, INF])),
    )


@st.composite
def world(draw: Any) -> tuple[State, list[Heartbeat]]:
    state = STATE
    for nid in draw(st.lists(st.sampled_from(IDS), max_size=3, unique=True)):
        state = State(state.jobs, state.nodes.set(nid, msgspec.structs.replace(state.nodes[nid],
                                                                                **draw(node_changes))),
                      state.pools, state.meta, state.timers)
    return state, draw(st.lists(heartbeat(IDS), min_size=1, max_size=12))


def one_by_one(state: State, hbs: list[Heartbeat], now: float) -> tuple[State, list[tuple[Any, ...]]]:
    out: list[tuple[Any, ...]] = []
    for i, hb in enumerate(hbs):
        reason = authorize(state, hb, now)
        if reason is not None:
            out.append((i, "refused", reason))
            continue
        d = decide(state, hb, now)
        out.append((i, "decided", d.dirty, d.commands, d.audit))
        state = d.state
    return state, out


def folded(state: State, hbs: list[Heartbeat], now: float) -> tuple[State, list[tuple[Any, ...]], int]:
    """As the daemon folds (``Decider.decide_heartbeats``): fold, decide the one that stops it, fold on."""
    out: list[tuple[Any, ...]] = []
    i, slow = 0, 0
    while i < len(hbs):
        fold = fold_heartbeats(state, hbs, i, len(hbs), now)
        refused = dict(fold.refused)
        live = iter(fold.live)
        for j in range(i, fold.stop):
            if j in refused:
                out.append((j, "refused", refused[j]))
            else:
                assert next(live) == "node." + hbs[j].node_id
                out.append((j, "decided", frozenset(), (), ()))
        assert next(live, None) is None
        state, i = fold.state, fold.stop
        if i < len(hbs):
            slow += 1
            assert authorize(state, hbs[i], now) is None  # the gate passed it: only the slow path stops a fold
            assert _heartbeat_fast(state, hbs[i], now) is None  # and the fast path refused it
            d = decide(state, hbs[i], now)
            out.append((i, "decided", d.dirty, d.commands, d.audit))
            state = d.state
            i += 1
    return state, out, slow


@settings(max_examples=300, deadline=None)
@given(world())
def test_fold_equals_gate_then_decide_one_by_one(w: tuple[State, list[Heartbeat]]) -> None:
    state, hbs = w
    now = NOW + 1.0
    want_state, want = one_by_one(state, hbs, now)
    got_state, got, _slow = folded(state, hbs, now)
    assert got == want
    assert got_state == want_state
    assert got_state.nodes == want_state.nodes  # State equality skips nothing the records hold


def test_the_steady_state_folds_in_one_call_and_the_first_training_heartbeat_stops_it() -> None:
    """Training nodes' heartbeats fold whole; j3's first TRAINING heartbeat (STARTING -> RUNNING) is the
    slow path: the fold stops right there, and the heartbeats before it are folded."""
    j3 = [nid for nid in IDS if STATE.nodes[nid].job_id == "j3"]
    training = [nid for nid in IDS if nid not in j3]

    def hb(nid: str, step: int) -> Heartbeat:
        node = STATE.nodes[nid]
        return Heartbeat(node_id=nid, seq=1, ts=NOW, state=AgentState.TRAINING, job_id=node.job_id,
                         generation=node.generation, step=step, loss=2.0, step_time_s=1.0)

    steady = [hb(nid, 7) for nid in training]
    fold = fold_heartbeats(STATE, steady, 0, len(steady), NOW + 1)
    assert (fold.stop, fold.refused) == (len(steady), [])
    assert fold.live == ["node." + nid for nid in training]
    assert all(fold.state.nodes[nid].step == 7 and fold.state.nodes[nid].last_seen == NOW + 1 for nid in training)
    mixed = [*steady[:2], hb(j3[0], 3), *steady[2:]]
    fold = fold_heartbeats(STATE, mixed, 0, len(mixed), NOW + 1)
    assert fold.stop == 2 and len(fold.live) == 2
    assert decide(fold.state, mixed[2], NOW + 1).state.jobs["j3"].phase != STATE.jobs["j3"].phase


def test_refusals_are_the_gates() -> None:
    node = STATE.nodes[IDS[0]]
    base = dict(seq=1, ts=NOW, state=AgentState.TRAINING, generation=node.generation, step=2)
    hbs = [Heartbeat(node_id="ghost", job_id=None, **base),
           Heartbeat(node_id=IDS[0], job_id="j2", **base),
           Heartbeat(node_id=IDS[0], job_id=node.job_id, **{**base, "step": 10**6}),
           Heartbeat(node_id=IDS[0], job_id=node.job_id, **base)]
    fold = fold_heartbeats(STATE, hbs, 0, len(hbs), NOW)
    assert fold.refused == [(i, authorize(STATE, h, NOW)) for i, h in enumerate(hbs[:3])]
    assert [r for _, r in fold.refused] == ["unknown_node", "wrong_job", "bad_step"]
    assert fold.stop == 4 and fold.live == ["node." + IDS[0]]


def test_every_record_and_heartbeat_variant_alone() -> None:
    """Exhaustive over what decides the path of one heartbeat: the node's record (suspect, disconnected,
    phase, generation against its job's; a training job and a starting one) and the heartbeat (its
    generation, state, step against the node's and the job's total, job, loss and step time)."""
    cases = 0
    for nid in (IDS[0], IDS[4]):  # j1 (running) and j3 (starting)
        for suspect, gone, phase, gen in itertools.product([None, NOW - 5.0], [False, True],
                                                  [NodePhase.BOOTING, NodePhase.REGISTERED, NodePhase.RUNNING,
                                                   NodePhase.NOTICED], [0, 1, 2]):
            node = msgspec.structs.replace(STATE.nodes[nid], suspect_since=suspect, disconnected=gone, phase=phase,
                                           generation=gen, step=5, loss=1.5, step_time_s=0.5)
            state = State(STATE.jobs, STATE.nodes.set(nid, node), STATE.pools, STATE.meta, STATE.timers)
            for dg, agent, step, job, (loss, st_s) in itertools.product(
                    [-1, 0, 1], [AgentState.TRAINING, AgentState.IDLE], [4, 5, 6, 1001], [None, node.job_id, "j2"],
                    [(None, None), (NAN, 0.0), (2.0, NAN), (INF, 1.0)]):
                hb = Heartbeat(node_id=nid, seq=3, ts=NOW, state=agent, job_id=job, generation=gen + dg, step=step,
                               loss=loss, step_time_s=st_s)
                want_state, want = one_by_one(state, [hb], NOW + 1)
                got_state, got, _ = folded(state, [hb], NOW + 1)
                assert (got, got_state) == (want, want_state), (node, hb)
                cases += 1
    assert cases == 2 * 48 * 288


def test_a_step_past_the_total_is_refused_only_as_progress() -> None:
    """The gate bounds progress (a step above the node's) by the job's total: a node whose record already
    holds a step past the total (a job whose total was lowered) may still report a step at or below it."""
    nid = IDS[0]
    node = msgspec.structs.replace(STATE.nodes[nid], step=2000)
    state = State(STATE.jobs, STATE.nodes.set(nid, node), STATE.pools, STATE.meta, STATE.timers)
    hbs = [Heartbeat(node_id=nid, seq=1, ts=NOW, state=AgentState.TRAINING, job_id=node.job_id,
                     generation=node.generation, step=step) for step in (1500, 2000, 2001)]
    want_state, want = one_by_one(state, hbs, NOW + 1)
    got_state, got, _ = folded(state, hbs, NOW + 1)
    assert (got, got_state) == (want, want_state)
    assert [r[1:] for r in got if r[1] == "refused"] == [("refused", "bad_step")]
