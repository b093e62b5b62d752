"""``MetricsObserver.after_batch`` follows the progress heartbeats report: each heartbeat's job (named by
the heartbeat, or its node's when it names none) has its steps tracked after the batch (goodput,
recovery), whether the heartbeat was folded (liveness only) or took the slow path."""

from __future__ import annotations

import itertools

from orchestrator.core import job_step
from orchestrator.daemon import pipeline
from orchestrator.daemon.coreapi import default_core
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.observe import MetricsObserver
from orchestrator.settings import Settings
from tests.core.test_heartbeat_fold import IDS, NOW, STATE
from wire import AgentState, Heartbeat


def test_heartbeat_progress_reaches_the_job_tracks() -> None:
    metrics = Metrics()
    observer = MetricsObserver(metrics)
    clock = itertools.count(NOW + 1.0)
    by_job = {jid: [nid for nid in IDS if STATE.nodes[nid].job_id == jid] for jid in ("j1", "j2", "j3")}

    def hb(nid: str, step: int, named: bool) -> Heartbeat:
        node = STATE.nodes[nid]
        return Heartbeat(node_id=nid, seq=1, ts=NOW, state=AgentState.TRAINING,
                         job_id=node.job_id if named else None, generation=node.generation, step=step,
                         loss=2.0, step_time_s=1.0)

    # j1's heartbeats name their job, j2's do not; j3's first training heartbeat takes the slow path
    hbs = ([hb(nid, 7, True) for nid in by_job["j1"]] + [hb(nid, 9, False) for nid in by_job["j2"]]
           + [hb(nid, 4, True) for nid in by_job["j3"]])
    decider = pipeline.Decider(default_core(Settings()), STATE, metrics=metrics, on_decision=lambda e, d: None,
                               clock=lambda: next(clock))
    decider.decide_heartbeats(hbs)
    decided = decider.out
    assert decided.liveness and decided.dirty  # folded ones, and j3's slow path
    observer.after_batch(STATE, decided, NOW + 1)
    after = decided.state
    assert set(observer.jobs) == {"j1", "j2", "j3"}
    assert (job_step(after, "j1"), job_step(after, "j2")) == (7, 9)
    assert observer.jobs["j1"].top == 7 and observer.jobs["j2"].top == 9
    assert observer.jobs["j3"].top == job_step(after, "j3")
