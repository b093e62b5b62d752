"""GCP provider through the real google-cloud-compute / google-cloud-billing REST clients, against a
local wire-level fake (tests/providers/fakes/gcp.py). Instances are counted in the fake."""

from __future__ import annotations

import itertools
import json
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from orchestrator.settings import SettingsError
from providers.base import (
    TAG_CLUSTER,
    AuthError,
    CapacityError,
    InstanceState,
    QuotaError,
    TransientError,
)
from providers.gcp import Config, GcpProvider, label_value, vm_name
from providers.reaper import Reaper
from tests.providers.contract import check_cloud_provider_contract
from tests.providers.fakes.gcp import FakeGcp, sku
from tests.providers.helpers import pool, request
from wire import InstanceId, Market

ZONE = "us-central1-a"
REGION = "us-central1"


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeGcp]:
    f = FakeGcp().start()
    yield f
    f.stop()


@pytest.fixture
def cluster() -> str:
    return f"C-{uuid.uuid4().hex[:8]}.x"  # upper case and a dot: not a valid label value as is


def _provider(url: str, **kw: object) -> GcpProvider:
    return GcpProvider(Config.from_raw({
        "project": "proj-1", "zones": [ZONE, "us-central1-b"], "machine_types": ["a2-highgpu-1g", "n1-standard-8"],
        "compute_endpoint": url, "billing_endpoint": url, "anonymous": True, **kw}))


@pytest.fixture
def provider(fake: FakeGcp) -> GcpProvider:
    return _provider(fake.url)


def test_satisfies_the_cloud_provider_contract(provider: GcpProvider, fake: FakeGcp, cluster: str) -> None:
    fake.skus = _skus()  # no spot N1 core/RAM SKU: n1-standard-8 has no spot price
    configured = provider.config.pools()
    priced = [p for p in configured if not (p.instance_type == "n1-standard-8" and p.market is Market.SPOT)]
    check_cloud_provider_contract(provider, pool("gcp", REGION, ZONE, "a2-highgpu-1g"), cluster,
                                  unknown_id=f"{ZONE}/orch-gone-000", configured=configured, priced=priced,
                                  foreign=lambda tags: _foreign(fake, tags))


_FOREIGN = itertools.count(1)


def _foreign(fake: FakeGcp, tags: Mapping[str, str]) -> InstanceId:
    """A VM another workload created in the same project: a plain REST insert on the fake, not through
    orchd; its labels are the tags (values mangled as GCE requires), and no orch-tags metadata."""
    name = f"other-vm-{next(_FOREIGN)}"
    body = {"name": name, "machineType": f"zones/{ZONE}/machineTypes/a2-highgpu-1g",
            "labels": {k: label_value(v) for k, v in tags.items()}}
    base = f"{fake.url}/compute/v1/projects/proj-1/zones/{ZONE}"
    op = _http("POST", f"{base}/instances", body)
    _http("POST", f"{base}/operations/{op['name']}/wait")
    return InstanceId(f"{ZONE}/{name}")


def _http(method: str, url: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def test_config_problems_listed() -> None:
    with pytest.raises(SettingsError) as e:
        Config.from_raw({"zones": ["uscentral"], "termination_action": "KEEP", "accelerators": {"n1-standard-8": "t4"}})
    text = str(e.value)
    assert all(s in text for s in ("project", "uscentral", "KEEP", "t4"))


def test_spot_launch_body(provider: GcpProvider, fake: FakeGcp, cluster: str) -> None:
    req = request(pool("gcp", REGION, ZONE, "n1-standard-8"), 2, cluster=cluster)
    res = provider.launch(req)
    assert res.missing == 0 and len(res.instances) == 2
    live = fake.live(label_value(cluster))
    assert len(live) == 2
    for vm in live:
        assert vm["scheduling"]["provisioningModel"] == "SPOT"
        assert vm["scheduling"]["instanceTerminationAction"] == "DELETE"
        assert vm["scheduling"]["onHostMaintenance"] == "TERMINATE"
        assert vm["guestAccelerators"][0]["acceleratorType"].endswith("/nvidia-tesla-t4")
        assert vm["labels"][TAG_CLUSTER] == label_value(cluster)
        items = {i["key"]: i["value"] for i in vm["metadata"]["items"]}
        tags = json.loads(items["orch-tags"])
        assert tags[TAG_CLUSTER] == cluster  # exact value survives the label restrictions
        assert f"ORCH_AGENT_ENROL_TOKEN=enrol-{tags['orch-node']}" in items["startup-script"]
    assert {i.node_id for i in res.instances} == set(req.node_ids)
    assert all(i.state is InstanceState.RUNNING and i.pool.market is Market.SPOT for i in res.instances)
    names = {f"{ZONE}/{vm_name(req.idempotency_token, n)}" for n in req.node_ids}
    assert {i.instance_id for i in res.instances} == names


def test_on_demand_a2_has_builtin_gpu(provider: GcpProvider, fake: FakeGcp, cluster: str) -> None:
    res = provider.launch(request(pool("gcp", REGION, ZONE, "a2-highgpu-1g", Market.ON_DEMAND), 1, cluster=cluster))
    (vm,) = fake.live(label_value(cluster))
    assert vm["scheduling"].get("provisioningModel") == "STANDARD" and "guestAccelerators" not in vm
    assert res.instances[0].pool.market is Market.ON_DEMAND


def test_same_token_twice_yields_one_vm(fake: FakeGcp, cluster: str) -> None:
    req = request(pool("gcp", REGION, ZONE, "a2-highgpu-1g"), 2, cluster=cluster)
    a = _provider(fake.url).launch(req)
    b = _provider(fake.url).launch(req)  # a restarted orchd replays the launch
    assert {i.instance_id for i in a.instances} == {i.instance_id for i in b.instances}
    assert len(fake.live(label_value(cluster))) == 2


def test_same_token_concurrently_yields_one_vm(provider: GcpProvider, fake: FakeGcp, cluster: str) -> None:
    import threading

    req = request(pool("gcp", REGION, ZONE, "a2-highgpu-1g"), 2, cluster=cluster)
    results = []
    threads = [threading.Thread(target=lambda: results.append(provider.launch(req))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(r.missing == 0 for r in results)  # losers of the race get the winner's VM
    assert len(fake.live(label_value(cluster))) == 2


def test_stockout_partial_then_retry(provider: GcpProvider, fake: FakeGcp, cluster: str) -> None:
    req = request(pool("gcp", REGION, "us-central1-b", "a2-highgpu-1g"), 3, cluster=cluster)
    fake.stockout["us-central1-b"] = 1
    first = fake.insert_calls
    with pytest.raises(CapacityError) as e:  # the first node already fails: nothing launched -> raise
        provider.launch(req)
    assert e.value.retryable and "ZONE_RESOURCE_POOL_EXHAUSTED" in str(e.value)
    assert fake.insert_calls - first == 1
    assert fake.live(label_value(cluster)) == []
    fake.stockout["us-central1-b"] = 0
    ok = provider.launch(req)
    assert ok.missing == 0 and len(fake.live(label_value(cluster))) == 3


def test_partial_fulfilment(provider: GcpProvider, fake: FakeGcp, cluster: str) -> None:
    req = request(pool("gcp", REGION, ZONE, "a2-highgpu-1g"), 3, cluster=cluster)
    # the first node fits, then the zone runs dry
    orig = dict(fake.stockout)
    calls = {"n": 0}
    real = fake._insert

    def one_then_stockout(project: str, zone: str, **kw: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            fake.stockout[zone] = 5
        return real(project, zone, **kw)

    fake.server.routes[0] = (fake.server.routes[0][0], fake.server.routes[0][1], one_then_stockout)
    try:
        res = provider.launch(req)
    finally:
        fake.server.routes[0] = (fake.server.routes[0][0], fake.server.routes[0][1], real)
        fake.stockout.clear()
        fake.stockout.update(orig)
    assert len(res.instances) == 1 and res.missing == 2 and res.failure == CapacityError.reason
    assert len(fake.live(label_value(cluster))) == 1


@pytest.mark.parametrize(("status", "reason", "error"), [
    (403, "quotaExceeded", QuotaError),
    (403, "rateLimitExceeded", TransientError),
    (429, "rateLimitExceeded", TransientError),
    (503, "backendError", TransientError),
    (401, "authError", AuthError),
])
def test_http_errors_are_typed(provider: GcpProvider, fake: FakeGcp, cluster: str, status: int, reason: str,
                               error: type) -> None:
    fake.http_faults.append((status, reason))
    with pytest.raises(error):
        provider.launch(request(pool("gcp", REGION, ZONE, "a2-highgpu-1g"), 1, cluster=cluster))
    assert fake.live(label_value(cluster)) == []


def test_missing_credentials_is_auth_error(fake: FakeGcp, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    p = _provider(fake.url, anonymous=False)
    with pytest.raises(AuthError):
        p.list_instances("c")
    with pytest.raises(AuthError):
        p.prices()


def test_list_pages_describe_terminate(provider: GcpProvider, fake: FakeGcp, cluster: str) -> None:
    res = provider.launch(request(pool("gcp", REGION, ZONE, "a2-highgpu-1g"), 3, cluster=cluster))
    provider.launch(request(pool("gcp", REGION, "us-central1-b", "a2-highgpu-1g"), 2, cluster=cluster, job="j2"))
    provider.launch(request(pool("gcp", REGION, ZONE, "a2-highgpu-1g"), 1, cluster=cluster + "-other"))
    listed = provider.list_instances(cluster)  # 5 VMs over pages of 2, across two zones
    assert len(listed) == 5 and {i.pool.zone for i in listed} == {ZONE, "us-central1-b"}
    victim = res.instances[0].instance_id
    provider.terminate([victim, f"{ZONE}/orch-gone-000"], cluster)
    assert len(fake.live(label_value(cluster))) == 4
    survivor = res.instances[1].instance_id
    assert [i.instance_id for i in provider.describe([victim, survivor])] == [survivor]


def test_list_survives_a_refused_filter(provider: GcpProvider, fake: FakeGcp, cluster: str) -> None:
    res = provider.launch(request(pool("gcp", REGION, ZONE, "a2-highgpu-1g"), 2, cluster=cluster))
    fake.refuse_filters = True
    try:
        listed = provider.list_instances(cluster)
    finally:
        fake.refuse_filters = False
    assert {i.instance_id for i in listed} == {i.instance_id for i in res.instances}


def test_reaper_on_gcp(provider: GcpProvider, fake: FakeGcp, cluster: str) -> None:
    keep = provider.launch(request(pool("gcp", REGION, ZONE, "a2-highgpu-1g"), 1, cluster=cluster, job="keep"))
    provider.launch(request(pool("gcp", REGION, ZONE, "a2-highgpu-1g"), 2, cluster=cluster, job="leak"))
    known = {i.node_id: ("running", i.instance_id) for i in keep.instances}
    now = [keep.instances[0].launched_ts + 1]
    reaper = Reaper({"gcp": provider}, cluster_id=cluster, grace_s=300, clock=lambda: now[0])
    r1 = reaper.reconcile(known, state_ok=True)
    assert len(r1.waiting["gcp"]) == 2 and r1.terminated["gcp"] == ()
    now[0] += 301
    r2 = reaper.reconcile(known, state_ok=True)
    assert len(r2.terminated["gcp"]) == 2
    assert [vm["name"] for vm in fake.live(label_value(cluster))] == [keep.instances[0].instance_id.split("/")[1]]


# --- prices -------------------------------------------------------------------------------------------

def _skus() -> list[dict]:
    am = [REGION, "us-east1"]
    return [
        sku("Nvidia Tesla A100 GPU running in Americas", "GPU", "OnDemand", 2.933908, am),
        sku("Spot Preemptible Nvidia Tesla A100 GPU running in Americas", "GPU", "Preemptible", 1.1, am),
        sku("A2 Instance Core running in Americas", "CPU", "OnDemand", 0.031611, am),
        sku("Spot Preemptible A2 Instance Core running in Americas", "CPU", "Preemptible", 0.0095, am),
        sku("A2 Instance Ram running in Americas", "RAM", "OnDemand", 0.004237, am, "GiBy.h"),
        sku("Spot Preemptible A2 Instance Ram running in Americas", "RAM", "Preemptible", 0.0013, am, "GiBy.h"),
        sku("Commitment v1: A2 Cpu in Americas for 1 Year", "CPU", "Commit1Yr", 0.01, am),
        sku("Nvidia Tesla T4 GPU running in Americas", "GPU", "OnDemand", 0.35, am),
        sku("Spot Preemptible Nvidia Tesla T4 GPU running in Americas", "GPU", "Preemptible", 0.14, am),
        sku("N1 Predefined Instance Core running in Americas", "CPU", "OnDemand", 0.031611, am),
        sku("N1 Predefined Instance Ram running in Americas", "RAM", "OnDemand", 0.004237, am, "GiBy.h"),
        # no spot N1 core/RAM SKU here: no spot quote for n1-standard-8 (never a partial price)
    ]


def test_catalog_prices_paged_and_composed(provider: GcpProvider, fake: FakeGcp) -> None:
    fake.skus = _skus()
    before = len([r for r in fake.server.requests if r[1].endswith("/skus")])
    quotes = provider.prices()
    pages = len([r for r in fake.server.requests if r[1].endswith("/skus")]) - before
    assert pages == 6  # 11 SKUs, pages of 2: every page followed
    q = {(x.pool.zone, x.pool.instance_type, x.pool.market): x for x in quotes}
    a2 = q[(ZONE, "a2-highgpu-1g", Market.SPOT)]
    assert a2.price_usd_h == pytest.approx(12 * 0.0095 + 85 * 0.0013 + 1.1)
    assert a2.on_demand_usd_h == pytest.approx(12 * 0.031611 + 85 * 0.004237 + 2.933908)
    assert (a2.gpu_type, a2.gpus_per_node) == ("A100", 1)
    assert q[(ZONE, "a2-highgpu-1g", Market.ON_DEMAND)].price_usd_h == pytest.approx(a2.on_demand_usd_h)
    assert (ZONE, "n1-standard-8", Market.SPOT) not in q
    assert q[(ZONE, "n1-standard-8", Market.ON_DEMAND)].gpu_type == "T4"


def test_prices_for_pools_outside_the_config(provider: GcpProvider, fake: FakeGcp) -> None:
    fake.skus = _skus()
    (q,) = provider.prices([pool("gcp", REGION, ZONE, "a2-highgpu-2g")])  # not in machine_types
    assert q.price_usd_h == pytest.approx(24 * 0.0095 + 170 * 0.0013 + 2 * 1.1) and q.gpus_per_node == 2


def test_price_file(fake: FakeGcp, tmp_path: Path) -> None:
    f = tmp_path / "gcp-prices.json"
    f.write_text(json.dumps({REGION: {"a2-highgpu-1g": {"spot": 1.2, "on_demand": 3.67}}}))
    p = _provider(fake.url, price_file=str(f))
    pools = [pool("gcp", REGION, ZONE, "a2-highgpu-1g"), pool("gcp", REGION, ZONE, "a2-highgpu-1g", Market.ON_DEMAND)]
    q = {(x.pool.zone, x.pool.market): x.price_usd_h for x in p.prices(pools)}
    assert q == {(ZONE, Market.SPOT): 1.2, (ZONE, Market.ON_DEMAND): 3.67}
