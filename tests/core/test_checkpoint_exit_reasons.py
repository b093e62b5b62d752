"""How a generation's end by the trainer or the checkpoint store restarts the job.

- Counted against ``max_restarts``: a trainer error ("failed"), "no_usable_checkpoint" (a restart would
  fail the same way) and an exit 0 before ``total_steps`` ("exited_early"; it used to restart without
  limit). Not counted: "storage_error" (the checkpoint store, not the trainer).
- Each of them holds the next generation with backoff (base x 2^k, k = holds in a row since the last
  commit, capped), so a full disk or a crashing script does not spin generations; a commit resets k.
"""

from __future__ import annotations

import msgspec
import pytest

from orchestrator.core import CoreConfig, JobPhase, State
from orchestrator.core.inputs import Tick
from tests.core.harness import AgentState, CheckpointCommitted, Driver, Heartbeat, RanksExited, StartGenerationCmd, cmds
from tests.core.test_tables import setup

BASE, TOP = 30.0, 900.0


def _exit_generation(drv: Driver, reason: str, code: int, step: int = 5) -> None:
    job = drv.job()
    for k, n in enumerate(job.gen_nodes):
        drv(RanksExited(id=f"x{job.generation}-{k}", node_id=n, job_id="j1", generation=job.generation,
                        exit_code=code, reason=reason, last_step=step, ts=drv.now))


def _tick_until_started(drv: Driver, limit_s: float = 4000.0) -> float | None:
    """Tick second by second, the job's idle nodes heartbeating, until a StartGenerationCmd goes out; the
    seconds waited (None: never)."""
    t0 = drv.now
    while drv.now - t0 < limit_s:
        for nid in drv.job().nodes:
            node = drv.state.nodes[nid]
            drv(Heartbeat(node_id=nid, seq=node.hb_seq + 1, ts=drv.now, state=AgentState.IDLE))
        if cmds(drv(Tick(), dt=1.0), StartGenerationCmd):
            return drv.now - t0
    return None


@pytest.mark.parametrize(("reason", "code"), [("failed", 1), ("no_usable_checkpoint", 78), ("completed", 0)])
def test_counted_exits_fail_the_job_after_max_restarts_with_backoff_between(reason: str, code: int) -> None:
    drv, _ = setup("member_running")
    limit = drv.state.config.max_restarts
    waits = []
    for _ in range(limit):
        _exit_generation(drv, reason, code)
        job = drv.job()
        assert job.phase == JobPhase.RESIZING and job.hold_reason == ("exited_early" if code == 0 else reason)
        waits.append(_tick_until_started(drv))
    assert waits == [BASE, 2 * BASE, 4 * BASE]  # the Tick at hold_until starts it
    _exit_generation(drv, reason, code)
    job = drv.job()
    assert job.phase == JobPhase.FAILED
    assert job.reason == {"failed": "trainer_failed", "completed": "exited_early"}.get(reason, reason)
    assert not drv.state.nodes


def test_storage_error_holds_with_capped_backoff_and_is_never_counted() -> None:
    drv, _ = setup("member_running")
    waits = []
    for _ in range(7):
        _exit_generation(drv, "storage_error", 76)
        assert drv.job().hold_reason == "storage_error" and drv.job().failures == 0
        waits.append(_tick_until_started(drv))
    assert waits == [min(TOP, BASE * 2**k) for k in range(7)]
    assert drv.job().phase == JobPhase.STARTING and len(drv.job().nodes) == 2  # the nodes stayed


def test_a_commit_resets_the_backoff_and_the_hold_round_trips_the_records() -> None:
    drv, _ = setup("member_running")
    for _ in range(2):
        _exit_generation(drv, "storage_error", 76)
        _tick_until_started(drv)
    job = drv.job()
    drv(CheckpointCommitted(id="c1", node_id=job.gen_nodes[0], job_id="j1", generation=job.generation, step=40,
                            checkpoint_id="s40", save_s=2.0, url="file:///ckpt/j1/step_000000040", ts=drv.now))
    assert drv.job().holds is msgspec.UNSET
    _exit_generation(drv, "storage_error", 76, step=41)
    assert _tick_until_started(drv) == BASE
    # the held job's record survives the state codec (Driver checks round trips on every step, and here a
    # full reload in the middle of a hold)
    _exit_generation(drv, "storage_error", 76, step=41)
    from orchestrator.core import state_from_records, state_to_records

    reloaded = state_from_records(state_to_records(drv.state))
    assert reloaded.jobs["j1"] == drv.job() and drv.job().held(drv.now)


def test_backoff_is_configurable() -> None:
    cfg = CoreConfig(restart_backoff_base_s=5.0, restart_backoff_max_s=12.0)
    assert [cfg.restart_backoff_s(k) for k in range(4)] == [5.0, 10.0, 12.0, 12.0]
    drv, _ = setup("member_running")
    drv.state = msgspec.structs.replace(drv.state, meta=msgspec.structs.replace(drv.state.meta, config=cfg))
    _exit_generation(drv, "failed", 1)
    assert _tick_until_started(drv) == 5.0
    assert isinstance(State.empty().config.restart_backoff_base_s, msgspec.UnsetType)  # default not encoded
