"""RanksExited reasons of the checkpoint safety work: "no_usable_checkpoint" counts against max_restarts (a
restart would fail the same way), "storage_error" does not (the checkpoint store, not the trainer)."""

from __future__ import annotations

from orchestrator.core import JobPhase
from orchestrator.core.inputs import Tick
from tests.core.harness import Driver, RanksExited
from tests.core.test_tables import setup


def _exit_every_generation(drv: Driver, reason: str, code: int, rounds: int) -> None:
    for g in range(rounds):
        job = drv.job()
        if job.phase == JobPhase.FAILED:
            return
        for k, n in enumerate(job.gen_nodes):
            drv(RanksExited(id=f"x{g}{k}", node_id=n, job_id="j1", generation=job.generation, exit_code=code,
                            reason=reason, last_step=5, ts=drv.now))
        drv(Tick(), dt=1)


def test_no_usable_checkpoint_exhausts_restarts_with_its_reason() -> None:
    drv, _ = setup("member_running")
    _exit_every_generation(drv, "no_usable_checkpoint", 78, drv.state.config.max_restarts + 2)
    assert drv.job().phase == JobPhase.FAILED and drv.job().reason == "no_usable_checkpoint"
    assert not drv.state.nodes


def test_storage_error_is_not_counted_against_max_restarts() -> None:
    drv, _ = setup("member_running")
    _exit_every_generation(drv, "storage_error", 76, drv.state.config.max_restarts + 2)
    assert drv.job().phase != JobPhase.FAILED and drv.job().failures == 0
