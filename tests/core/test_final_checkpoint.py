"""A job whose final checkpoint is committed is done, whatever the generation that notices it reports."""

from __future__ import annotations

from orchestrator.core import CoreConfig, JobPhase, State
from tests.core.harness import Driver, RanksExited
from tests.core.test_safety_net import T0, H, _commit, _spot_job


def test_a_generation_resumed_from_the_final_checkpoint_completes_the_job() -> None:
    """The final checkpoint was committed by a generation whose node then left; the next generation resumes
    from it, runs no step, reports none and exits 0 "completed": the job succeeded (it was restarted again
    and again, each time held as exited_early)."""
    cfg = CoreConfig(price_confirm_s=0.0, progress_line=False)
    drv = Driver(State.empty(cfg), now=T0)
    total = 600
    (nid,) = _spot_job(drv, total=total, deadline_s=10 * H)
    _commit(drv, nid, 1, total)
    d = drv(RanksExited(id="x1", node_id=nid, job_id="j1", generation=1, exit_code=0, reason="completed",
                        last_step=0, ts=drv.now))
    assert drv.job().phase == JobPhase.SUCCEEDED, [(a.action, a.reason) for a in d.audit]
    assert drv.job().step == total
