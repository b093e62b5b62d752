"""The fake cloud enforces what real clouds enforce: idempotency tokens, capacity, typed errors."""

from pathlib import Path

import msgspec
import pytest

from providers.base import CapacityError, LaunchRequest, TransientError
from simulations.fakecloud import FakeCloud, FileFakeCloud, from_settings, read_fake_file
from tests.providers.contract import check_cloud_provider_contract
from wire import FailureReason, Market, PoolKey
from wire.config import SettingsError

POOL = PoolKey(cloud="fake", region="r1", zone="r1a", instance_type="g.1", market=Market.SPOT)


def req(token: str, *nodes: str) -> LaunchRequest:
    return LaunchRequest(pool=POOL, node_ids=tuple(nodes), idempotency_token=token, cluster_id="c1", job_id="j1")


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_satisfies_the_cloud_provider_contract(kind: str, tmp_path: Path) -> None:
    cloud = FakeCloud() if kind == "memory" else FileFakeCloud(tmp_path / "fake.json")
    on_demand = msgspec.structs.replace(POOL, market=Market.ON_DEMAND)
    cloud.set_price(POOL, 1.0, on_demand_usd_h=3.0)
    cloud.set_price(on_demand, 3.0)
    check_cloud_provider_contract(cloud, POOL, "c-contract", unknown_id="fake-999999",
                                  configured=[POOL, on_demand], priced=[POOL, on_demand],
                                  foreign=lambda tags: cloud.add_instance(POOL, tags).instance_id)
    if kind == "file":  # what the file recorded is what the cloud says
        assert read_fake_file(tmp_path / "fake.json") == cloud.all_instances()


def test_from_settings_checks_every_key(tmp_path: Path) -> None:
    row = {"pool": msgspec.to_builtins(POOL), "price_usd_h": 1, "on_demand_usd_h": 3.0}
    cloud = from_settings({"prices": [row], "gpus_per_node": 8, "state_file": str(tmp_path / "f.json")})
    assert isinstance(cloud, FileFakeCloud)
    (q,) = cloud.prices()
    assert (q.pool, q.price_usd_h, q.on_demand_usd_h, q.gpus_per_node) == (POOL, 1.0, 3.0, 8)
    with pytest.raises(SettingsError) as err:
        from_settings({"colour": "red", "gpus_per_node": "8",
                       "prices": [{"pool": {"cloud": "fake"}, "price_usd_h": "x"}]})
    assert [p.split(":")[0] for p in err.value.problems] == [
        "providers.fake.colour", "providers.fake.prices[0].pool", "providers.fake.prices[0].price_usd_h",
        "providers.fake.gpus_per_node"]


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
    cloud.terminate([b.instance_id, "unknown-id"], "c1")
    assert cloud.list_instances("c1") == []
    assert {i.state for i in cloud.describe([a.instance_id, b.instance_id])} == {"terminated"}


def test_listing_is_scoped_to_the_cluster_id() -> None:
    cloud = FakeCloud()
    cloud.launch(req("t", "n1"))
    assert cloud.list_instances("other-cluster") == []
