"""``Decider.decide_heartbeats`` (orchestrator/daemon/pipeline.py), what the decide loop runs on every
heartbeat batch, folds runs of heartbeats through the core (``fold_heartbeats``) and must leave exactly
what ``Decider.decide`` - the trust gate then ``decide``, one heartbeat at a time - leaves: the state,
the liveness and dirty keys, the commands and audit of a slow-path heartbeat, the refusals (their
indices, ``on_reject`` calls and ``orchd_messages_rejected_total``), the counts, the clock reads and
the lag samples, and a core error on one heartbeat skips that heartbeat only."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.core import State
from orchestrator.daemon import pipeline
from orchestrator.daemon.coreapi import default_core
from orchestrator.daemon.metrics import Metrics
from orchestrator.settings import Settings
from tests.core.test_heartbeat_fold import IDS, NOW, STATE, world
from wire import AgentState, Heartbeat

CORE = default_core(Settings())


def run(state: State, hbs: list[Any], clock_every: int, folded: bool) -> dict[str, Any]:
    metrics = Metrics()
    rejects: list[tuple[str, str]] = []
    clock = itertools.count(NOW + 1.0)
    reads: list[float] = []

    def now() -> float:
        reads.append(next(clock))
        return reads[-1]

    decider = pipeline.Decider(CORE, state, metrics=metrics, on_decision=lambda e, d: None,
                               on_reject=lambda e, r: rejects.append((e.node_id, r)), clock=now)
    if folded:
        outcome = decider.decide_heartbeats(hbs, clock_every=clock_every)
    else:
        outcome = decider.decide(hbs, clock_every=clock_every)
    out = decider.out
    registry = metrics.registry
    return {
        "failed": outcome.failed, "refused": outcome.refused, "rejects": rejects, "reads": reads,
        "decided": {f.name: getattr(out, f.name) for f in dataclasses.fields(out)},
        "rejected": {(s.labels["kind"], s.labels["reason"]): s.value for m in registry.collect()
                     if m.name == "orchd_messages_rejected" for s in m.samples if s.name.endswith("_total")},
        "lag_samples": registry.get_sample_value("orchd_event_lag_seconds_count"),
    }


@settings(max_examples=100, deadline=None)
@given(world(), st.sampled_from([1, 2, 3, 256]))
def test_decide_heartbeats_leaves_what_decide_leaves(w: tuple[State, list[Heartbeat]], clock_every: int) -> None:
    state, hbs = w
    want = run(state, hbs, clock_every, folded=False)
    got = run(state, hbs, clock_every, folded=True)
    assert got == want


def test_a_core_error_skips_that_heartbeat_only() -> None:
    """A heartbeat the core raises on (a loss that is no number: msgspec structs are not validated when
    built by hand) is failed and counted as ``core_error``; the heartbeats around it are decided."""
    def hb(nid: str, loss: Any) -> Heartbeat:
        node = STATE.nodes[nid]
        return Heartbeat(node_id=nid, seq=1, ts=NOW, state=AgentState.TRAINING, job_id=node.job_id,
                         generation=node.generation, step=3, loss=loss, step_time_s=1.0)

    hbs = [hb(IDS[0], 2.0), hb(IDS[1], "x"), hb(IDS[2], 2.0), hb(IDS[3], 2.0)]
    want = run(STATE, hbs, 256, folded=False)
    got = run(STATE, hbs, 256, folded=True)
    assert got == want
    assert got["failed"] == [1] and got["refused"] == []
    assert got["rejected"] == {("Heartbeat", "core_error"): 1.0}
    assert got["decided"]["liveness"] == {"node." + IDS[i] for i in (0, 2, 3)}
    assert got["decided"]["state"].nodes[IDS[3]].step == 3


def test_steady_heartbeats() -> None:
    """Training heartbeats, each folded: liveness keys only, one clock read and one lag sample per
    ``clock_every`` heartbeats."""
    hbs = [Heartbeat(node_id=nid, seq=1, ts=NOW, state=AgentState.TRAINING, job_id=STATE.nodes[nid].job_id,
                     generation=1, step=2, loss=2.0, step_time_s=1.0) for nid in IDS[:4]]
    got = run(STATE, hbs, 256, folded=True)
    assert got["decided"]["liveness"] == {"node." + nid for nid in IDS[:4]}
    assert got["decided"]["dirty"] == set() and got["decided"]["decided"] == 4
    assert got["reads"] == [NOW + 1.0] and got["lag_samples"] == 1.0
    assert got == run(STATE, hbs, 256, folded=False)
