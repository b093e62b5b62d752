"""Pricing arithmetic: Young/Daly, notice-window fit, preemption-rate estimate, penalty, expected cost."""

from __future__ import annotations

import math

import pytest

from orchestrator.core.model import CoreConfig, Job, PoolStats
from orchestrator.core.pricing import (
    checkpoint_interval_s,
    expected_cost_usd,
    preemption_rate_h,
    recent_penalty,
    record_exposure,
    transfer_cost_usd,
    young_daly_s,
)
from tests.core.harness import pool, spec
from wire import CheckpointPolicy, Market

CFG = CoreConfig()


def job(save_s: float = 20.0, interval: float | None = None) -> Job:
    sp = spec(checkpoint=CheckpointPolicy(url="u", save_s_estimate=save_s, interval_s=interval))
    return Job(job_id="j", spec=sp, phase_ts=0.0, submitted_ts=0.0, target_nodes=1)


def ps(cloud: str = "aws", market: Market = Market.SPOT, **kw: float) -> PoolStats:
    return PoolStats(pool=pool(cloud=cloud, market=market), gpu_type="A100", gpus_per_node=8, price_usd_h=10.0, **kw)


@pytest.mark.parametrize("c,m,expect", [(30.0, 3600.0 * 20, math.sqrt(2 * 30 * 72000)), (0.0, 100.0, 0.0)])
def test_young_daly(c: float, m: float, expect: float) -> None:
    assert young_daly_s(c, m) == pytest.approx(expect)


def test_interval_scales_with_nodes_and_fixed_interval_wins() -> None:
    one = checkpoint_interval_s(job(), ps(), 1, CFG, 0.0)
    four = checkpoint_interval_s(job(), ps(), 4, CFG, 0.0)
    assert four == pytest.approx(one / 2)  # 4x the failure rate -> half the interval
    assert checkpoint_interval_s(job(interval=777.0), ps(), 4, CFG, 0.0) == 777.0


@pytest.mark.parametrize("cloud,save_s,shorter", [("aws", 60.0, False), ("gcp", 60.0, True), ("azure", 20.0, False)])
def test_interval_shorter_when_emergency_save_cannot_fit_the_notice(cloud: str, save_s: float, shorter: bool) -> None:
    got = checkpoint_interval_s(job(save_s), ps(cloud), 1, CFG, 0.0)
    base = young_daly_s(save_s, 3600.0 / CFG.spot_prior_rate_h)
    assert got == pytest.approx(base * (CFG.unfit_interval_factor if shorter else 1.0))


def test_preemption_rate_prior_observation_and_decay() -> None:
    p = ps()
    assert preemption_rate_h(p, CFG, 0.0) == pytest.approx(CFG.spot_prior_rate_h)
    p2 = p.__class__(**{**{f: getattr(p, f) for f in p.__struct_fields__}, **record_exposure(p, CFG, 0.0, 0, True)})
    hot = preemption_rate_h(p2, CFG, 0.0)
    assert hot > CFG.spot_prior_rate_h
    assert preemption_rate_h(p2, CFG, 30 * 86400.0) < hot  # decays back toward the prior
    assert preemption_rate_h(ps(market=Market.ON_DEMAND), CFG, 0.0) == CFG.on_demand_rate_h


def test_recent_penalty_decays() -> None:
    p = ps(last_preempted_ts=0.0)
    assert recent_penalty(p, CFG, 0.0) == pytest.approx(1.0 + CFG.preempted_penalty)
    assert recent_penalty(p, CFG, CFG.preempted_penalty_half_life_s) == pytest.approx(1.0 + CFG.preempted_penalty / 2)
    assert expected_cost_usd(job(), p, 1, 0, CFG, 0.0) > expected_cost_usd(job(), ps(), 1, 0, CFG, 0.0)


def test_transfer_cost() -> None:
    dst = ps()
    assert transfer_cost_usd("aws/us-east-1/us-east-1b", dst, CFG) == 0.0
    cross_region = CFG.checkpoint_gb_estimate * CFG.cross_region_usd_per_gb
    assert transfer_cost_usd("aws/us-west-2/us-west-2a", dst, CFG) == cross_region
    assert transfer_cost_usd("gcp/us-central1/a", dst, CFG) == CFG.checkpoint_gb_estimate * CFG.cross_cloud_usd_per_gb
