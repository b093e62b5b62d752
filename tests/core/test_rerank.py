"""Migration evaluation re-ranks the pools only when the ranking can have changed (simulations finding 6:
ranking every pool on every Tick was half of orchd's replay time)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from orchestrator.core import CoreConfig, State
from orchestrator.core import policy as core_policy
from orchestrator.core.commands import Launch
from orchestrator.core.inputs import JobSubmitted, Tick
from orchestrator.core.placement import Ranked
from tests.core.harness import Driver, GenerationStarted, cmds, pool, price, spec
from wire import MarketPolicy

A = pool("p4d.24xlarge", "us-east-1a")
C = pool("p4d.24xlarge", "us-east-1b")
WINDOW = 1800.0


@pytest.fixture
def rank_calls(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    calls: list[float] = []
    real = core_policy.ranked

    def counting(*a: Any, **kw: Any) -> list[Ranked]:
        calls.append(a[5])  # now
        return real(*a, **kw)

    monkeypatch.setattr(core_policy, "ranked", counting)
    return calls


def running(config: CoreConfig | None = None) -> Driver:
    # Prices act at once here (price_confirm_s=0): these tests count rankings, not confirmations.
    cfg = msgspec.structs.replace(config or CoreConfig(), price_confirm_s=0.0)
    drv = Driver(State.empty(cfg), now=WINDOW * 10 + 5.0)  # away from a window boundary
    drv(price(A, 10.0))
    drv(price(C, 11.0))
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_min=1, nodes_max=1, total_steps=10**6,
                                                market=MarketPolicy.SPOT)))
    (nid,) = drv.launched(d)
    drv.register([nid])
    drv(GenerationStarted(id="g", node_id=nid, job_id="j1", generation=1, first_step=1, ts=drv.now), dt=1)
    return drv


def test_no_rerank_while_nothing_changes_then_on_each_kind_of_change(rank_calls: list[float]) -> None:
    drv = running()
    drv(Tick(), dt=60)  # first evaluation after the start of the generation: ranks
    assert len(rank_calls) == 1
    for _ in range(5):
        drv(Tick(), dt=60)
    assert len(rank_calls) == 1  # five evaluations, nothing changed: no ranking
    drv(price(C, 10.9))  # a price changed
    drv(Tick(), dt=60)
    assert len(rank_calls) == 2
    drv(Tick(), dt=60)
    assert len(rank_calls) == 2
    # a pool in launch backoff whose backoff expires between two evaluations
    st = drv.state
    ps = st.pools[C.name]
    drv.state = State(st.jobs, st.nodes, st.pools.set(C.name, msgspec.structs.replace(
        ps, backoff_until=drv.now + 30.0, changed_ts=0.0)), st.meta)
    drv(Tick(), dt=60)
    assert len(rank_calls) == 3
    # the window boundary: at least one ranking per price_rerank_max_s
    n = len(rank_calls)
    drv.now = (drv.now // WINDOW + 1) * WINDOW - 30.0
    drv(Tick())
    drv(Tick(), dt=60)
    assert len(rank_calls) == n + 1


def test_always_reranks_with_window_zero(rank_calls: list[float]) -> None:
    drv = running(CoreConfig(price_rerank_max_s=0.0))
    for _ in range(5):
        drv(Tick(), dt=60)
    assert len(rank_calls) == 5


def test_a_cheaper_pool_is_found_at_the_same_evaluation_as_without_the_cache() -> None:
    out = []
    for cfg in (CoreConfig(), CoreConfig(price_rerank_max_s=0.0)):
        drv = running(cfg)
        for _ in range(4):
            drv(Tick(), dt=60)
        drv(price(C, 3.0))  # much cheaper elsewhere: migrate
        moved = None
        for i in range(5):
            d = drv(Tick(), dt=60)
            if cmds(d, Launch):
                moved = (i, [la.pool for la in cmds(d, Launch)])
                break
        out.append(moved)
    assert out[0] is not None and out[0] == out[1] and out[0][1] == [C]
