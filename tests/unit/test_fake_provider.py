"""The fake cloud enforces what real clouds enforce: idempotency tokens, capacity, typed errors."""

import pytest

from wire import FailureReason, Market, PoolKey
from providers.base import CapacityError, CloudProvider, LaunchRequest, TransientError
from simulations.fakecloud import FakeCloud

POOL = PoolKey(cloud="fake", region="r1", zone="r1a", instance_type="g.1", market=Market.SPOT)


def req(token: str, *nodes: str) -> LaunchRequest:
    return LaunchRequest(pool=POOL, node_ids=tuple(nodes), idempotency_token=token, cluster_id="c1", job_id="j1")


def test_is_a_cloud_provider() -> None:
    assert isinstance(FakeCloud(), CloudProvider)


def test_same_token_twice_creates_one_set_of_instances() -> None:
    cloud = FakeCloud()
    first = cloud.launch(req("tok-1", "n1", "n2"))
    again = cloud.launch(req("tok-1", "n1", "n2"))
    assert [i.instance_id for i in first.instances] == [i.instance_id for i in again.instances]
    assert len(cloud.list_instances("c1")) == 2


def test_partial_fulfilment_reports_the_shortfall() -> None:
    cloud = FakeCloud()
    cloud.capacity[POOL] = 1
    result = cloud.launch(req("t", "n1", "n2", "n3"))
    assert len(result.instances) == 1 and result.missing == 2 and result.failure is FailureReason.CAPACITY
    with pytest.raises(CapacityError):
        cloud.launch(req("t2", "n4"))


def test_injected_errors_are_typed_and_consumed() -> None:
    cloud = FakeCloud()
    cloud.fail_next(POOL, TransientError, times=1)
    with pytest.raises(TransientError) as err:
        cloud.launch(req("t", "n1"))
    assert err.value.retryable
    assert len(cloud.launch(req("t", "n1")).instances) == 1


def test_preempt_and_terminate_remove_from_listing() -> None:
    cloud = FakeCloud()
    a, b = cloud.launch(req("t", "n1", "n2")).instances
    cloud.preempt(a.instance_id)
    cloud.terminate([b.instance_id, "unknown-id"])
    assert cloud.list_instances("c1") == []
    assert {i.state for i in cloud.describe([a.instance_id, b.instance_id])} == {"terminated"}


def test_listing_is_scoped_to_the_cluster_id() -> None:
    cloud = FakeCloud()
    cloud.launch(req("t", "n1"))
    assert cloud.list_instances("other-cluster") == []
