"""Azure provider through the real azure-mgmt-compute client against a local ARM fake, and the Retail
Prices API fake through the provider's HTTP client. VMs are counted in the fake."""

from __future__ import annotations

import base64
import itertools
import json
import urllib.request
import uuid
from collections.abc import Iterator, Mapping

import pytest

from orchestrator.settings import SettingsError
from providers.azure import AzureProvider, Config, vm_name
from providers.base import AuthError, CapacityError, InstanceState, QuotaError, TransientError
from providers.reaper import Reaper
from tests.providers.contract import check_cloud_provider_contract
from tests.providers.fakes.azure import FakeAzure, price_row
from tests.providers.helpers import pool, request
from wire import InstanceId, Market

A100 = "Standard_NC24ads_A100_v4"
T4 = "Standard_NC4as_T4_v3"
SUBNET = "/subscriptions/sub-1/resourceGroups/net/providers/Microsoft.Network/virtualNetworks/v/subnets/s"


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeAzure]:
    f = FakeAzure().start()
    yield f
    f.stop()


@pytest.fixture
def cluster() -> str:
    return f"c-{uuid.uuid4().hex[:8]}"


def _provider(url: str, **kw: object) -> AzureProvider:
    return AzureProvider(Config.from_raw({
        "subscription_id": "sub-1", "resource_group": "rg-orch", "zones": ["eastus-1", "eastus-2", "westus2"],
        "vm_sizes": [A100, T4], "subnet_id": SUBNET, "ssh_public_key": "ssh-ed25519 AAAA test",
        "arm_endpoint": url, "prices_endpoint": url, "anonymous": True, "polling_interval_s": 0, **kw}))


@pytest.fixture
def provider(fake: FakeAzure) -> AzureProvider:
    return _provider(fake.url)


def test_satisfies_the_cloud_provider_contract(provider: AzureProvider, fake: FakeAzure, cluster: str) -> None:
    fake.price_rows = _price_rows()
    configured = provider.config.pools()
    priced = [p for p in configured if p.region == "eastus"] + [pool("azure", "westus2", "westus2", T4)]
    check_cloud_provider_contract(provider, pool("azure", "eastus", "eastus-1", A100), cluster,
                                  unknown_id="orch-never-existed", configured=configured, priced=priced,
                                  foreign=lambda tags: _foreign(fake, tags))


_FOREIGN = itertools.count(1)


def _foreign(fake: FakeAzure, tags: Mapping[str, str]) -> InstanceId:
    """A VM another workload created in the same resource group: a plain ARM PUT on the fake, not
    through orchd, carrying exactly ``tags``."""
    name = f"other-vm-{next(_FOREIGN)}"
    body = {"location": "eastus", "tags": dict(tags), "zones": ["1"],
            "properties": {"hardwareProfile": {"vmSize": A100}, "priority": "Regular"}}
    url = (f"{fake.url}/subscriptions/sub-1/resourceGroups/rg-orch/providers/Microsoft.Compute/virtualMachines/"
           f"{name}?api-version=2024-07-01")
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="PUT",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10):
        pass
    return InstanceId(name)


def test_config_problems_listed() -> None:
    with pytest.raises(SettingsError) as e:
        Config.from_raw({"zones": ["East US"], "eviction_policy": "Stop", "image": {"sku": "x"}})
    text = str(e.value)
    assert all(s in text for s in ("subscription_id", "resource_group", "East US", "Stop", "image"))


def test_spot_launch_body(provider: AzureProvider, fake: FakeAzure, cluster: str) -> None:
    req = request(pool("azure", "eastus", "eastus-1", A100), 2, cluster=cluster)
    res = provider.launch(req)
    assert res.missing == 0 and len(res.instances) == 2
    vms = fake.live(cluster)
    assert len(vms) == 2
    for vm in vms:
        p = vm["properties"]
        assert p["priority"] == "Spot" and p["evictionPolicy"] == "Delete" and p["billingProfile"]["maxPrice"] == -1
        assert vm["zones"] == ["1"] and vm["location"] == "eastus"
        nic = p["networkProfile"]["networkInterfaceConfigurations"][0]
        assert nic["properties"]["deleteOption"] == "Delete"
        assert nic["properties"]["ipConfigurations"][0]["properties"]["subnet"]["id"] == SUBNET
        assert p["storageProfile"]["osDisk"]["deleteOption"] == "Delete"
        script = base64.b64decode(p["userData"]).decode()
        assert f"ORCH_AGENT_ENROL_TOKEN=enrol-{vm['tags']['orch-node']}" in script
    assert all(i.state is InstanceState.RUNNING and i.pool.zone == "eastus-1" and i.pool.market is Market.SPOT
               for i in res.instances)
    assert {i.node_id for i in res.instances} == set(req.node_ids)


def test_regional_on_demand(provider: AzureProvider, fake: FakeAzure, cluster: str) -> None:
    res = provider.launch(request(pool("azure", "westus2", "westus2", T4, Market.ON_DEMAND), 1, cluster=cluster))
    (vm,) = fake.live(cluster)
    assert vm["properties"]["priority"] == "Regular" and "zones" not in vm and "evictionPolicy" not in vm["properties"]
    assert res.instances[0].pool.zone == "westus2" and res.instances[0].pool.market is Market.ON_DEMAND


def test_same_token_twice_yields_one_vm(fake: FakeAzure, cluster: str) -> None:
    req = request(pool("azure", "eastus", "eastus-2", A100), 2, cluster=cluster)
    a = _provider(fake.url).launch(req)
    puts = fake.puts
    b = _provider(fake.url).launch(req)
    assert fake.puts == puts  # found by name: no second PUT
    assert {i.instance_id for i in a.instances} == {i.instance_id for i in b.instances}
    assert len(fake.live(cluster)) == 2


def test_same_token_concurrently_yields_one_vm(provider: AzureProvider, fake: FakeAzure, cluster: str) -> None:
    import threading

    req = request(pool("azure", "eastus", "eastus-1", T4), 2, cluster=cluster)
    results = []
    threads = [threading.Thread(target=lambda: results.append(provider.launch(req))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(r.missing == 0 for r in results)
    assert len(fake.live(cluster)) == 2


def test_async_allocation_failure_is_capacity_and_leaves_nothing(provider: AzureProvider, fake: FakeAzure,
                                                                 cluster: str) -> None:
    req = request(pool("azure", "eastus", "eastus-1", A100), 3, cluster=cluster)
    fake.async_failures[:] = [None, "AllocationFailed"]
    res = provider.launch(req)
    assert len(res.instances) == 1 and res.missing == 2 and res.failure == CapacityError.reason
    assert "AllocationFailed" in res.message
    assert len(fake.live(cluster)) == 1  # the Failed VM was deleted
    again = provider.launch(req)
    assert again.missing == 0 and len(fake.live(cluster)) == 3


@pytest.mark.parametrize(("status", "code", "error"), [
    (409, "SkuNotAvailable", CapacityError),
    (409, "QuotaExceeded", QuotaError),
    (429, "TooManyRequests", TransientError),
    (500, "InternalServerError", TransientError),
    (403, "AuthorizationFailed", AuthError),
])
def test_sync_errors_are_typed(fake: FakeAzure, cluster: str, status: int, code: str, error: type) -> None:
    provider = _provider(fake.url, retry_total=0)
    fake.sync_failures.append((status, code))
    with pytest.raises(error) as e:
        provider.launch(request(pool("azure", "eastus", "eastus-1", A100), 1, cluster=cluster))
    assert code in str(e.value)
    assert fake.live(cluster) == []


def test_sdk_retries_one_throttle(fake: FakeAzure, cluster: str) -> None:
    provider = _provider(fake.url, retry_total=1)
    fake.sync_failures.append((429, "TooManyRequests"))
    res = provider.launch(request(pool("azure", "eastus", "eastus-1", A100), 1, cluster=cluster))
    assert res.missing == 0 and len(fake.live(cluster)) == 1


def test_list_pages_describe_terminate(provider: AzureProvider, fake: FakeAzure, cluster: str) -> None:
    res = provider.launch(request(pool("azure", "eastus", "eastus-1", T4), 3, cluster=cluster))
    provider.launch(request(pool("azure", "eastus", "eastus-1", T4), 1, cluster=cluster + "-x"))
    listed = provider.list_instances(cluster)  # every VM of the group, over pages of 2, filtered by tag
    assert {i.instance_id for i in listed} == {i.instance_id for i in res.instances}
    victim = res.instances[0].instance_id
    provider.terminate([victim, "orch-never-existed"], cluster)
    assert len(fake.live(cluster)) == 2
    survivor = res.instances[1].instance_id
    assert [i.instance_id for i in provider.describe([victim, survivor])] == [survivor]


def test_reaper_refuses_empty_state_then_reaps(provider: AzureProvider, fake: FakeAzure, cluster: str) -> None:
    job = provider.launch(request(pool("azure", "eastus", "eastus-2", T4), 2, cluster=cluster))
    t0 = job.instances[0].launched_ts
    reaper = Reaper({"azure": provider}, cluster_id=cluster, grace_s=60, clock=lambda: t0 + 3600)
    assert reaper.reconcile({}, state_ok=True).refused == {"azure": "state_empty_with_2_instances"}
    assert len(fake.live(cluster)) == 2
    known = {job.instances[0].node_id: ("completed", job.instances[0].instance_id),
             job.instances[1].node_id: ("running", "some-other-vm")}  # a duplicate of a live node
    r = reaper.reconcile(known, state_ok=True)
    assert sorted(o.reason for o in r.orphans) == ["duplicate", "finished_job"]
    assert fake.live(cluster) == []


def _price_rows() -> list[dict]:
    return [
        price_row("eastus", A100, "NC24ads A100 v4", 3.673),
        price_row("eastus", A100, "NC24ads A100 v4 Spot", 0.7346),
        price_row("eastus", A100, "NC24ads A100 v4 Low Priority", 0.7346),
        price_row("eastus", A100, "NC24ads A100 v4", 6.9, product="Virtual Machines NCADS A100 v4 Series Windows"),
        price_row("eastus", T4, "NC4as T4 v3", 0.526),
        price_row("eastus", T4, "NC4as T4 v3 Spot", 0.1578),
        price_row("westus2", T4, "NC4as T4 v3 Spot", 0.2),
        price_row("eastus", "Standard_D2s_v5", "D2s v5 Spot", 0.01),
    ]


def test_retail_prices_paged(provider: AzureProvider, fake: FakeAzure) -> None:
    fake.price_rows = _price_rows()
    before = len([r for r in fake.server.requests if r[1] == "/api/retail/prices"])
    quotes = provider.prices()
    pages = len([r for r in fake.server.requests if r[1] == "/api/retail/prices"]) - before
    assert pages == 3 + 1  # eastus 3 pages, westus2 1
    q = {(x.pool.zone, x.pool.instance_type, x.pool.market): x for x in quotes}
    a = q[("eastus-1", A100, Market.SPOT)]
    assert (a.price_usd_h, a.on_demand_usd_h, a.gpu_type, a.gpus_per_node) == (0.7346, 3.673, "A100-80GB", 1)
    assert q[("eastus-2", A100, Market.SPOT)].price_usd_h == 0.7346  # region-level price, every zone
    assert q[("eastus-1", T4, Market.ON_DEMAND)].price_usd_h == 0.526
    assert q[("westus2", T4, Market.SPOT)].price_usd_h == 0.2
    assert q[("westus2", T4, Market.SPOT)].on_demand_usd_h == 0.526  # catalog fallback: no on-demand row there
    assert ("westus2", A100, Market.SPOT) not in q


def test_retail_prices_errors(fake: FakeAzure) -> None:
    p = _provider(fake.url, prices_endpoint=fake.url + "/nowhere")
    with pytest.raises(Exception) as e:
        p.prices([pool("azure", "eastus", "eastus-1", A100)])
    assert not isinstance(e.value, TransientError)  # a 404 is a config error, not worth retrying
    dead = _provider(fake.url, prices_endpoint="http://127.0.0.1:9")
    with pytest.raises(TransientError):
        dead.prices([pool("azure", "eastus", "eastus-1", A100)])


def test_vm_name_is_stable_and_valid() -> None:
    n = vm_name("tok", "Job_1/Node.7")
    assert n == vm_name("tok", "Job_1/Node.7") != vm_name("tok2", "Job_1/Node.7")
    assert len(n) <= 64 and n.replace("-", "").isalnum() and n.islower()
