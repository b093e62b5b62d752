"""The reaper's pure plan (matrix), and the Reaper shell counted on the in-memory fake cloud."""

from __future__ import annotations

import anyio
import pytest

from providers.base import TAG_CLUSTER, TAG_NODE, Instance, InstanceState, TransientError
from providers.reaper import KnownNode, Reaper, ReapReport, plan
from simulations.fakecloud import FakeCloud
from tests.providers.helpers import request
from wire import InstanceId, Market, NodeId, PoolKey

pytestmark = pytest.mark.anyio  # the async tests; the sync ones ignore it

P = PoolKey(cloud="fake", region="r", zone="r-a", instance_type="t", market=Market.SPOT)


def inst(iid: str, node: str | None, *, state: InstanceState = InstanceState.RUNNING, cluster: str = "c",
         launched: float | None = None) -> Instance:
    tags = {TAG_CLUSTER: cluster} | ({TAG_NODE: node} if node else {})
    return Instance(instance_id=InstanceId(iid), node_id=NodeId(node) if node else None, pool=P, state=state,
                    tags=tags, launched_ts=launched)


@pytest.mark.parametrize(("instance", "known", "outcome", "reason"), [
    (inst("i1", "n1"), {"n1": ("running", "i1")}, "adopt", None),
    (inst("i1", "n1"), {"n1": ("running", None)}, "adopt", None),  # launch recorded, instance id not yet
    (inst("i1", "n1"), {"n1": ("paused", "i1")}, "adopt", None),
    (inst("i1", "n1", state=InstanceState.STOPPING), {"n1": ("running", "i1")}, "adopt", None),
    (inst("i1", "n1"), {"n2": ("running", "i2")}, "orphan", "unknown_node"),
    (inst("i1", "n1"), {"n1": ("completed", "i1")}, "orphan", "finished_job"),
    (inst("i1", "n1"), {"n1": ("cancelled", "i1")}, "orphan", "finished_job"),
    (inst("i1", "n1"), {"n1": ("running", "i9")}, "orphan", "duplicate"),
    (inst("i1", None), {"n1": ("running", "i1")}, "orphan", "no_node_tag"),
    (inst("i1", "n1", state=InstanceState.TERMINATED), {"n2": ("running", "i2")}, "ignore", None),
    (inst("i1", "n1", cluster="other"), {"n2": ("running", "i2")}, "ignore", None),
])
def test_plan_matrix(instance: Instance, known: dict, outcome: str, reason: str | None) -> None:
    p = plan([instance], known, {}, now=1000.0, grace_s=0.0, state_ok=True, cluster_id="c")
    assert p.refused_reason is None
    got = ("adopt" if p.adopt else "orphan" if p.terminate else "ignore")
    assert got == outcome
    if reason:
        assert p.terminate[0].reason == reason


def test_grace_period_runs_from_first_seen() -> None:
    i = inst("i1", "ghost")
    p1 = plan([i], {"n": ("running", "x")}, {}, now=100.0, grace_s=60.0, state_ok=True)
    assert [o.instance.instance_id for o in p1.waiting] == ["i1"] and not p1.terminate
    p2 = plan([i], {"n": ("running", "x")}, p1.first_seen, now=159.0, grace_s=60.0, state_ok=True)
    assert p2.waiting and not p2.terminate
    p3 = plan([i], {"n": ("running", "x")}, p2.first_seen, now=160.0, grace_s=60.0, state_ok=True)
    assert [o.instance.instance_id for o in p3.terminate] == ["i1"]
    # adopted later (the launch result arrived): forgotten, the clock restarts if it ever orphans again
    p4 = plan([i], {"ghost": ("running", "i1")}, p3.first_seen, now=161.0, grace_s=60.0, state_ok=True)
    assert p4.adopt and p4.first_seen == {}


def test_old_launch_time_skips_the_wait() -> None:
    p = plan([inst("i1", "ghost", launched=0.0)], {"n": ("running", "x")}, {}, now=1000.0, grace_s=600.0, state_ok=True)
    assert [o.instance.instance_id for o in p.terminate] == ["i1"]
    p = plan([inst("i1", "ghost", launched=900.0)], {"n": ("running", "x")}, {}, now=1000.0, grace_s=600.0,
             state_ok=True)
    assert p.waiting and p.first_seen == {"i1": 900.0}


def test_refusals() -> None:
    insts = [inst("i1", "n1"), inst("i2", "n2")]
    assert plan(insts, {}, {}, 0.0, 0.0, state_ok=True).refused_reason == "state_empty_with_2_instances"
    assert plan(insts, {"n1": ("running", "i1")}, {}, 0.0, 0.0, state_ok=False).refused_reason == "state_unreadable"
    assert plan([], {}, {}, 0.0, 0.0, state_ok=True).refused_reason is None  # nothing to do is not a refusal
    forced = plan(insts, {}, {}, 0.0, 0.0, state_ok=True, allow_empty_state=True)
    assert forced.refused_reason is None and len(forced.terminate) == 2
    assert KnownNode("running", "i1") == KnownNode(*("running", "i1"))


def _fleet(cloud: FakeCloud, cluster: str) -> dict[str, tuple[str, str]]:
    pool = PoolKey(cloud="fake", region="r", zone="r-a", instance_type="t", market=Market.SPOT)
    live = cloud.launch(request(pool, 2, cluster=cluster, job="live"))
    done = cloud.launch(request(pool, 1, cluster=cluster, job="done"))
    cloud.launch(request(pool, 1, cluster=cluster, job="lost"))
    cloud.launch(request(pool, 1, cluster="someone-else", job="theirs"))
    known = {i.node_id: ("running", i.instance_id) for i in live.instances}
    return known | {i.node_id: ("completed", i.instance_id) for i in done.instances}


def test_reaper_dry_run_then_real_counted_on_the_cloud() -> None:
    now = [1000.0]
    cloud = FakeCloud("fake", clock=lambda: now[0])
    known = _fleet(cloud, "c")
    reaper = Reaper({"fake": cloud}, cluster_id="c", grace_s=300, clock=lambda: now[0])
    r0 = reaper.reconcile(known, state_ok=True)
    assert len(r0.waiting["fake"]) == 2 and r0.terminated["fake"] == ()
    now[0] += 300
    dry = reaper.reconcile(known, state_ok=True, dry_run=True)
    assert len(dry.terminated["fake"]) == 2 and dry.to_dict()["dry_run"] is True
    assert len(cloud.list_instances("c")) == 4 and cloud.terminate_calls == 0
    real = reaper.reconcile(known, state_ok=True)
    assert sorted(o.reason for o in real.orphans) == ["finished_job", "unknown_node"]
    assert len(cloud.list_instances("c")) == 2 and len(real.adopted["fake"]) == 2
    assert len(cloud.list_instances("someone-else")) == 1  # never touches another deployment


def test_reaper_refuses_and_survives_list_errors() -> None:
    cloud = FakeCloud("fake", clock=lambda: 0.0)
    _fleet(cloud, "c")

    class Broken(FakeCloud):
        def list_instances(self, cluster_id: str) -> list[Instance]:
            raise TransientError("Throttling: injected")

    reaper = Reaper({"fake": cloud, "broken": Broken("broken")}, cluster_id="c", grace_s=0, clock=lambda: 10_000.0)
    r = reaper.reconcile({}, state_ok=True)
    assert r.refused == {"fake": "state_empty_with_4_instances"} and "Throttling" in r.errors["broken"]
    assert len(cloud.list_instances("c")) == 4


async def test_run_periodic_treats_read_errors_as_unreadable() -> None:
    cloud = FakeCloud("fake", clock=lambda: 0.0)
    known = _fleet(cloud, "c")
    reaper = Reaper({"fake": cloud}, cluster_id="c", grace_s=0, clock=lambda: 10_000.0)
    reports: list[ReapReport] = []
    calls = {"n": 0}

    async def read_state() -> tuple[dict[str, tuple[str, str]], bool]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("KV bucket unavailable")
        return known, True

    async def on_report(r: ReapReport) -> None:
        reports.append(r)

    async with anyio.create_task_group() as tg:
        await tg.start(lambda task_status: reaper.run_periodic(read_state, interval_s=0.01, on_report=on_report,
                                                               task_status=task_status))
        with anyio.fail_after(30):
            while len(reports) < 2:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert reports[0].refused == {"fake": "state_unreadable"}
    assert len(reports[1].terminated["fake"]) == 2 and len(cloud.list_instances("c")) == 2
