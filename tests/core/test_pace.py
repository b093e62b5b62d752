"""Slack-aware on-demand by the job's own pace (pricing.projected_wait_s), a tuning (``progress_prior_h``,
off by default): a waiting job takes on-demand once its spare slack no longer covers the waiting the rest
of its work is expected to cost at its pace so far, with ``progress_prior_h`` hours of uninterrupted work
assumed before any observation."""

from __future__ import annotations

import math

import pytest

from orchestrator.core import CoreConfig, JobPhase, State
from orchestrator.core.commands import Launch
from orchestrator.core.feasibility import wake_up
from orchestrator.core.inputs import JobSubmitted, Tick
from orchestrator.core.pricing import projected_wait_s, spare_slack_s, wait_reserve_s
from tests.core.harness import Driver, cmds, pool, price, spec
from wire import Market

A = pool("p4d.24xlarge", "us-east-1a")
A_OD = pool("p4d.24xlarge", "us-east-1a", market=Market.ON_DEMAND)
T0 = 1000.0
H = 3600.0
ALONE = dict(line_slack_share=0.0, deadline_margin_restarts=0.0)  # the pace rule alone (it is a tuning)


def _job(cfg: CoreConfig, *, work_h: float, deadline_h: float) -> Driver:
    drv = Driver(State.empty(cfg), now=T0)
    drv(price(A, 10.0, od=30.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_min=1, nodes_max=1, total_steps=int(work_h * H),
                                                 deadline_ts=T0 + deadline_h * H, step_time_s_estimate=1.0)))
    drv.fail_launches(cmds(d, Launch))
    return drv


@pytest.mark.parametrize("prior_h", [0.0, 12.0, 1e6])
def test_the_projected_wait_is_the_rest_of_the_work_at_the_pace_so_far(prior_h: float) -> None:
    cfg = CoreConfig(progress_prior_h=prior_h, **ALONE)
    drv = _job(cfg, work_h=20, deadline_h=40)
    job = drv.job()
    # half the work done in three quarters of the time: the other half is expected to take as long again
    wait, growth = projected_wait_s(job, int(10 * H), cfg, T0 + 15 * H)
    prior = prior_h * H
    assert wait == pytest.approx(10 * H * ((15 * H + prior) / (10 * H + prior) - 1.0))
    assert growth == pytest.approx(10 * H / (10 * H + prior))
    # a job that has not started yet: no wait expected, unless no prior at all makes its pace unknown
    fresh, _ = projected_wait_s(job, 0, cfg, T0)
    assert fresh == (math.inf if prior_h == 0.0 else 0.0)


def test_a_waiting_job_takes_on_demand_when_its_pace_no_longer_fits_the_slack() -> None:
    """20 h of work, 40 h to the deadline, spot never has room. The uniform-progress line would take
    on-demand at once (the job is behind it from the first second); a greedy wait, at the last moment (20 h
    in). With a 12 h prior, the job waits while the slack covers the wait its pace projects: until about
    7.5 h (20 - t = 20 t / 12, less the margins), and not a tick later."""
    cfg = CoreConfig(price_confirm_s=0.0, progress_prior_h=12.0, **ALONE)
    drv = _job(cfg, work_h=20, deadline_h=40)
    od_at = None
    for _ in range(int(20 * H / 600)):
        before = drv.job()
        seen = len(drv.decisions)
        drv(Tick(), dt=600.0)
        launches = [la for d in drv.decisions[seen:] for la in cmds(d, Launch)]
        drv.fail_launches([la for la in launches if la.pool == A])  # spot never has room
        launches = [la for d in drv.decisions[seen:] for la in cmds(d, Launch)]
        if any(la.pool == A_OD for la in launches):
            od_at = drv.now
            # the tick before, the job still had the slack for its projected wait; now it does not
            t_prev = drv.now - 600.0
            assert spare_slack_s(before, 0, cfg, t_prev) >= wait_reserve_s(before, 0, cfg, t_prev)
            assert spare_slack_s(drv.job(), 0, cfg, drv.now) < wait_reserve_s(drv.job(), 0, cfg, drv.now)
            break
    assert od_at is not None
    assert 6.0 * H < od_at - T0 <= 7.5 * H, (od_at - T0) / H
    assert drv.job().phase in (JobPhase.PLACING, JobPhase.PENDING, JobPhase.STARTING)


def test_the_wake_up_is_no_later_than_the_projected_wait_crossing() -> None:
    """A waiting job's wake-up (feasibility.wake_up): the spare slack shrinks and the projected wait grows
    as it waits; the time reported is when they cross at the latest, so no Tick is skipped past it."""
    cfg = CoreConfig(price_confirm_s=0.0, progress_prior_h=12.0, backoff_max_s=1e9, backoff_base_s=1e9,
                     wait_probe_s=0.0, **ALONE)
    drv = _job(cfg, work_h=20, deadline_h=40)
    drv.now = T0 + H
    job = drv.job()
    _, at = wake_up(job, drv.state.pools, cfg, drv.now)
    assert at is not None
    spare = spare_slack_s(job, 0, cfg, at)
    assert spare is not None and spare >= wait_reserve_s(job, 0, cfg, at) - 1e-6  # not past the crossing
    assert at - drv.now > 5.0 * H  # and not needlessly early either: the crossing is about 6.5 h away
