"""AWS provider through real boto3 against moto's server; botocore Stubber where moto falls short.

Instances, tags and user data are checked by listing moto with a separate boto3 client (the fake
cloud's view), never from the provider's own return values alone.
"""

from __future__ import annotations

import base64
import threading
import uuid
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

import boto3
import pytest
from botocore.exceptions import EndpointConnectionError, NoCredentialsError
from botocore.parsers import ResponseParserError
from botocore.stub import ANY, Stubber
from moto.server import ThreadedMotoServer

from orchestrator.settings import SettingsError
from providers.aws import AwsProvider, Config, client_token, map_error
from providers.base import (
    TAG_CLUSTER,
    TAG_NODE,
    TAG_TOKEN,
    AuthError,
    CapacityError,
    ForeignInstanceError,
    InstanceState,
    ProviderError,
    QuotaError,
    TransientError,
)
from providers.reaper import Reaper
from tests.providers.contract import check_cloud_provider_contract
from tests.providers.helpers import AwsErrorInjector, pool, request
from wire import InstanceId, Market

REGION = "us-east-1"


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.delenv("AWS_PROFILE", raising=False)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        try:
            yield f"http://{host}:{port}"
        finally:
            server.stop()


@pytest.fixture
def cluster() -> str:
    return f"c-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def provider(moto_url: str) -> AwsProvider:
    """One provider for the module (clients load the EC2 model once); tests isolate by cluster id."""
    return AwsProvider(_config(moto_url))


_VIEW_CLIENTS: dict[str, object] = {}


def _ec2(url: str) -> Any:
    """A separate plain boto3 client: the fake cloud's own view, not the provider's."""
    if url not in _VIEW_CLIENTS:
        _VIEW_CLIENTS[url] = boto3.client("ec2", region_name=REGION, endpoint_url=url)
    return _VIEW_CLIENTS[url]


def _config(url: str, **kw: object) -> Config:
    raw = {
        "regions": [REGION],
        "zones": ["us-east-1a", "us-east-1b"],
        "instance_types": ["g5.xlarge", "p3.2xlarge"],
        "images": {REGION: "ami-12345678"},
        "endpoint_url": url,
        "max_attempts": 1,
        **kw,
    }
    return Config.from_raw(raw)


def _cloud_view(url: str, cluster: str) -> list[dict]:
    """Every non-terminated instance of this cluster, as moto sees it."""
    ec2 = _ec2(url)
    out = []
    for r in ec2.describe_instances(Filters=[{"Name": f"tag:{TAG_CLUSTER}", "Values": [cluster]}])["Reservations"]:
        out += [i for i in r["Instances"] if i["State"]["Name"] != "terminated"]
    return out


def test_satisfies_the_cloud_provider_contract(moto_url: str, cluster: str) -> None:
    p = AwsProvider(_config(moto_url, placement_scores=False))  # moto has no placement scores
    on_demand = [x for x in p.config.pools() if x.market is Market.ON_DEMAND]  # priced from the bundled catalog
    check_cloud_provider_contract(p, pool("aws", REGION, "us-east-1a", "g5.xlarge"), cluster,
                                  unknown_id="i-0000000000000dead", configured=p.config.pools(), priced=on_demand,
                                  foreign=lambda tags: _foreign(moto_url, tags))


def _foreign(url: str, tags: Mapping[str, str]) -> InstanceId:
    """An instance another workload launched in the same account: straight on moto, not through orchd."""
    kw: dict[str, Any] = {}
    if tags:
        kw["TagSpecifications"] = [{"ResourceType": "instance",
                                    "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}]
    resp = _ec2(url).run_instances(ImageId="ami-12345678", InstanceType="g5.xlarge", MinCount=1, MaxCount=1,
                                   Placement={"AvailabilityZone": "us-east-1a"}, **kw)
    return InstanceId(resp["Instances"][0]["InstanceId"])


def test_config_lists_every_bad_key() -> None:
    with pytest.raises(SettingsError) as e:
        Config.from_raw({"regions": ["us-east-1"], "zones": ["eu-west-1a"], "markets": ["cheap"], "bogus": 1})
    text = str(e.value)
    assert "bogus" in text
    e2 = pytest.raises(SettingsError, Config.from_raw, {"zones": ["eu-west-1a", "us-east-1a"], "markets": ["cheap"],
                                                        "instance_types": ["g5.xlarge"]})
    assert all(s in str(e2.value) for s in ("eu-west-1a", "cheap", "no AMI for region 'us-east-1'"))


def test_spot_launch_tags_user_data_and_imds(provider: AwsProvider, moto_url: str, cluster: str) -> None:
    req = request(pool("aws", REGION, "us-east-1a", "g5.xlarge"), 2, cluster=cluster)
    res = provider.launch(req)
    assert res.missing == 0 and len(res.instances) == 2
    seen = _cloud_view(moto_url, cluster)
    assert len(seen) == 2
    ec2 = _ec2(moto_url)
    for inst in seen:
        tags = {t["Key"]: t["Value"] for t in inst["Tags"]}
        assert tags[TAG_CLUSTER] == cluster and tags[TAG_TOKEN] == req.idempotency_token
        assert inst["InstanceLifecycle"] == "spot"
        assert inst["Placement"]["AvailabilityZone"] == "us-east-1a"
        assert inst["MetadataOptions"]["HttpTokens"] == "required"
        ud = ec2.describe_instance_attribute(InstanceId=inst["InstanceId"], Attribute="userData")
        script = base64.b64decode(ud["UserData"]["Value"]).decode()
        node = tags[TAG_NODE]
        assert f"ORCH_AGENT_NODE_ID={node}" in script
        assert f"ORCH_AGENT_ENROL_TOKEN=enrol-{node}" in script  # the node's own one-time token
        assert "systemctl restart orch-agent.service" in script
    got = {i.node_id: i for i in res.instances}
    assert set(got) == set(req.node_ids)
    assert all(i.pool.market is Market.SPOT and i.pool.zone == "us-east-1a" for i in res.instances)


def test_on_demand_launch(provider: AwsProvider, moto_url: str, cluster: str) -> None:
    on_demand = pool("aws", REGION, "us-east-1b", "p3.2xlarge", Market.ON_DEMAND)
    res = provider.launch(request(on_demand, 1, cluster=cluster))
    (inst,) = _cloud_view(moto_url, cluster)
    assert "InstanceLifecycle" not in inst
    assert res.instances[0].pool.market is Market.ON_DEMAND


def test_moto_ignores_client_token(moto_url: str) -> None:
    """Why the provider checks the token tag itself: moto creates two instances for one ClientToken."""
    ec2 = _ec2(moto_url)
    tag = uuid.uuid4().hex
    for _ in range(2):
        ec2.run_instances(ImageId="ami-12345678", MinCount=1, MaxCount=1, ClientToken="same-token",
                          TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": "t", "Value": tag}]}])
    found = ec2.describe_instances(Filters=[{"Name": "tag:t", "Values": [tag]}])["Reservations"]
    n = sum(len(r["Instances"]) for r in found)
    assert n == 2


def test_same_token_twice_yields_one_instance_per_node(moto_url: str, cluster: str) -> None:
    req = request(pool("aws", REGION, "us-east-1a", "g5.xlarge"), 3, cluster=cluster)
    first = AwsProvider(_config(moto_url)).launch(req)
    # orchd crashed before recording the result; a new process retries with the same token
    second = AwsProvider(_config(moto_url)).launch(req)
    assert {i.instance_id for i in first.instances} == {i.instance_id for i in second.instances}
    assert len(_cloud_view(moto_url, cluster)) == 3


def test_same_token_concurrently_yields_one_instance(provider: AwsProvider, moto_url: str, cluster: str) -> None:
    req = request(pool("aws", REGION, "us-east-1a", "g5.xlarge"), 2, cluster=cluster)
    threads = [threading.Thread(target=provider.launch, args=(req,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(_cloud_view(moto_url, cluster)) == 2


def test_partial_fulfilment_then_retry_fills_only_the_gap(provider: AwsProvider, moto_url: str, cluster: str) -> None:
    req = request(pool("aws", REGION, "us-east-1a", "g5.xlarge"), 3, cluster=cluster)
    hook = AwsErrorInjector("InsufficientInstanceCapacity", status=500, after=1)
    events = provider.client(REGION).meta.events
    events.register("before-call.ec2.RunInstances", hook)
    try:
        res = provider.launch(req)
    finally:
        events.unregister("before-call.ec2.RunInstances", hook)
    assert len(res.instances) == 1 and res.missing == 2
    assert res.failure == CapacityError.reason
    assert hook.calls == 2  # stopped at the first capacity error instead of hammering the pool
    assert len(_cloud_view(moto_url, cluster)) == 1
    again = provider.launch(req)  # capacity is back; the same token launches only the missing nodes
    assert again.missing == 0 and len(again.instances) == 3
    assert len(_cloud_view(moto_url, cluster)) == 3


@pytest.mark.parametrize(
    ("code", "status", "error", "retryable"),
    [
        ("InsufficientInstanceCapacity", 500, CapacityError, True),
        ("RequestLimitExceeded", 503, TransientError, True),
        ("VcpuLimitExceeded", 400, QuotaError, False),
        ("UnauthorizedOperation", 403, AuthError, False),
        ("IdempotentParameterMismatch", 400, TransientError, True),
        ("InvalidParameterValue", 400, ProviderError, False),
    ],
)
def test_launch_errors_are_typed(provider: AwsProvider, moto_url: str, cluster: str, code: str, status: int,
                                 error: type, retryable: bool) -> None:
    hook = AwsErrorInjector(code, status=status)
    events = provider.client(REGION).meta.events
    events.register("before-call.ec2.RunInstances", hook)
    try:
        with pytest.raises(error) as e:
            provider.launch(request(pool("aws", REGION, "us-east-1a", "g5.xlarge"), 2, cluster=cluster))
    finally:
        events.unregister("before-call.ec2.RunInstances", hook)
    assert type(e.value) is error and e.value.retryable is retryable
    assert code in str(e.value)
    assert _cloud_view(moto_url, cluster) == []


def test_throttled_list_is_transient(provider: AwsProvider, cluster: str) -> None:
    hook = AwsErrorInjector("Throttling", status=400)
    events = provider.client(REGION).meta.events
    events.register("before-call.ec2.DescribeInstances", hook)
    try:
        with pytest.raises(TransientError):
            provider.list_instances(cluster)
    finally:
        events.unregister("before-call.ec2.DescribeInstances", hook)


def test_no_credentials_is_auth_error(moto_url: str) -> None:
    assert isinstance(map_error(NoCredentialsError()), AuthError)
    assert isinstance(map_error(EndpointConnectionError(endpoint_url="http://x")), TransientError)
    assert isinstance(map_error(ResponseParserError("invalid XML")), TransientError)
    p = AwsProvider(_config(moto_url, profile="orch-no-such-profile"))
    with pytest.raises(AuthError, match="ProfileNotFound"):
        p.list_instances("c")


def test_list_describe_terminate(provider: AwsProvider, moto_url: str, cluster: str) -> None:
    res = provider.launch(request(pool("aws", REGION, "us-east-1b", "g5.xlarge"), 2, cluster=cluster))
    other = provider.launch(request(pool("aws", REGION, "us-east-1b", "g5.xlarge"), 1, cluster=cluster + "-other"))
    listed = provider.list_instances(cluster)
    assert {i.instance_id for i in listed} == {i.instance_id for i in res.instances}
    victim = res.instances[0].instance_id
    provider.terminate([victim, "i-0000000000000dead"], cluster)  # unknown ids are not an error
    assert {i["InstanceId"] for i in _cloud_view(moto_url, cluster)} == {res.instances[1].instance_id}
    (d,) = provider.describe([victim])
    assert d.state is InstanceState.TERMINATED
    assert provider.describe(["i-0000000000000dead"]) == []
    assert len(_cloud_view(moto_url, cluster + "-other")) == 1 == len(other.instances)
    with pytest.raises(ForeignInstanceError):  # another cluster's instance: refused, and still running
        provider.terminate([other.instances[0].instance_id], cluster)
    assert len(_cloud_view(moto_url, cluster + "-other")) == 1


def test_reaper_against_moto(provider: AwsProvider, moto_url: str, cluster: str) -> None:
    live = provider.launch(request(pool("aws", REGION, "us-east-1a", "g5.xlarge"), 2, cluster=cluster, job="live"))
    done = provider.launch(request(pool("aws", REGION, "us-east-1a", "g5.xlarge"), 1, cluster=cluster, job="done"))
    stray = provider.launch(request(pool("aws", REGION, "us-east-1a", "g5.xlarge"), 1, cluster=cluster, job="stray"))
    known = {i.node_id: ("running", i.instance_id) for i in live.instances}
    known |= {i.node_id: ("completed", i.instance_id) for i in done.instances}
    now = [datetime.now(UTC).timestamp() - 3600]  # before moto's launch times: all are fresh
    reaper = Reaper({"aws": provider}, cluster_id=cluster, grace_s=600, clock=lambda: now[0])
    assert reaper.reconcile({}, state_ok=True).refused == {"aws": "state_empty_with_4_instances"}
    assert reaper.reconcile(known, state_ok=False).refused == {"aws": "state_unreadable"}
    assert len(_cloud_view(moto_url, cluster)) == 4
    now[0] += 3600 + 700  # launched 700 s ago: past the grace period
    dry = reaper.reconcile(known, state_ok=True, dry_run=True)
    assert set(dry.terminated["aws"]) == {done.instances[0].instance_id, stray.instances[0].instance_id}
    assert len(_cloud_view(moto_url, cluster)) == 4  # dry run touched nothing
    report = reaper.reconcile(known, state_ok=True)
    assert set(report.adopted["aws"]) == {i.instance_id for i in live.instances}
    assert {i["InstanceId"] for i in _cloud_view(moto_url, cluster)} == {i.instance_id for i in live.instances}


# --- prices: botocore Stubber (moto returns one constant price with no paging) --------------------


_STUBBED: list[AwsProvider] = []


def _stubbed_provider() -> tuple[AwsProvider, Stubber]:
    """A provider whose client is only ever used under a Stubber (no endpoint is contacted)."""
    if _STUBBED:
        _STUBBED[0]._zone_ids.clear()  # each test stubs describe_availability_zones itself
        return _STUBBED[0], Stubber(_STUBBED[0].client(REGION))
    p = AwsProvider(Config.from_raw({"regions": [REGION], "zones": ["us-east-1a", "us-east-1b", "us-east-1c"],
                                     "instance_types": ["g5.xlarge", "p3.2xlarge"], "images": {REGION: "ami-1"},
                                     "on_demand_usd_h": {"p3.2xlarge": 3.5}}),
                    clock=lambda: datetime(2026, 11, 21, 12, tzinfo=UTC).timestamp())
    _STUBBED.append(p)
    return p, Stubber(p.client(REGION))


def _row(zone: str, itype: str, price: str, hour: int) -> dict:
    return {"AvailabilityZone": zone, "InstanceType": itype, "ProductDescription": "Linux/UNIX",
            "SpotPrice": price, "Timestamp": datetime(2026, 11, 21, hour, tzinfo=UTC)}


def test_spot_prices_follow_pages_and_keep_newest() -> None:
    p, stub = _stubbed_provider()
    params = {"InstanceTypes": ["g5.xlarge", "p3.2xlarge"],
              "ProductDescriptions": ["Linux/UNIX", "Linux/UNIX (Amazon VPC)"], "StartTime": ANY}
    stub.add_response("describe_spot_price_history", {
        "SpotPriceHistory": [_row("us-east-1a", "g5.xlarge", "0.40", 11), _row("us-east-1a", "p3.2xlarge", "0.95", 9)],
        "NextToken": "page2"}, params)
    stub.add_response("describe_spot_price_history", {
        "SpotPriceHistory": [_row("us-east-1a", "g5.xlarge", "0.30", 8),  # older: ignored
                             _row("us-east-1b", "g5.xlarge", "0.35", 10),
                             _row("us-east-1a", "p3.2xlarge", "1.05", 10)],  # newer than page 1's
        "NextToken": ""}, {**params, "NextToken": "page2"})
    stub.add_response("describe_availability_zones", {"AvailabilityZones": [
        {"ZoneName": "us-east-1a", "ZoneId": "use1-az6"}, {"ZoneName": "us-east-1b", "ZoneId": "use1-az1"}]})
    stub.add_response("get_spot_placement_scores", {"SpotPlacementScores": [
        {"Region": REGION, "AvailabilityZoneId": "use1-az6", "Score": 9},
        {"Region": REGION, "AvailabilityZoneId": "use1-az1", "Score": 3}]},
        {"InstanceTypes": ["g5.xlarge"], "TargetCapacity": 1, "TargetCapacityUnitType": "units",
         "SingleAvailabilityZone": True, "RegionNames": [REGION]})
    stub.add_response("get_spot_placement_scores", {"SpotPlacementScores": []},
                      {"InstanceTypes": ["p3.2xlarge"], "TargetCapacity": 1, "TargetCapacityUnitType": "units",
                       "SingleAvailabilityZone": True, "RegionNames": [REGION]})
    with stub:
        quotes = p.prices()
    stub.assert_no_pending_responses()
    q = {(x.pool.zone, x.pool.instance_type, x.pool.market): x for x in quotes}
    g5a = q[("us-east-1a", "g5.xlarge", Market.SPOT)]
    assert (g5a.price_usd_h, g5a.capacity_hint, g5a.gpu_type, g5a.gpus_per_node) == (0.40, 0.9, "A10G", 1)
    assert g5a.on_demand_usd_h == pytest.approx(1.006)
    assert q[("us-east-1b", "g5.xlarge", Market.SPOT)].capacity_hint == 0.3
    assert q[("us-east-1a", "p3.2xlarge", Market.SPOT)].price_usd_h == 1.05
    assert q[("us-east-1a", "p3.2xlarge", Market.SPOT)].capacity_hint is None
    assert ("us-east-1c", "g5.xlarge", Market.SPOT) not in q  # no spot row: no quote, never a zero price
    od = q[("us-east-1c", "p3.2xlarge", Market.ON_DEMAND)]
    assert od.price_usd_h == 3.5 == od.on_demand_usd_h  # config override beats the bundled table


def test_placement_scores_refused_leaves_hint_empty() -> None:
    p, stub = _stubbed_provider()
    stub.add_response("describe_spot_price_history", {"SpotPriceHistory": [_row("us-east-1a", "g5.xlarge", "0.4", 11)]})
    stub.add_response("describe_availability_zones", {"AvailabilityZones": []})
    stub.add_client_error("get_spot_placement_scores", "UnauthorizedOperation", http_status_code=403)
    with stub:
        quotes = p.prices([pool("aws", REGION, "us-east-1a", "g5.xlarge")])
    assert [(x.price_usd_h, x.capacity_hint) for x in quotes] == [(0.4, None)]


def test_price_history_throttled_is_transient() -> None:
    p, stub = _stubbed_provider()
    stub.add_client_error("describe_spot_price_history", "RequestLimitExceeded", http_status_code=503)
    with stub, pytest.raises(TransientError):
        p.prices([pool("aws", REGION, "us-east-1a", "g5.xlarge")])


def test_client_token_fits_ec2_limit() -> None:
    t = client_token("x" * 200, "node-" * 40)
    assert len(t) <= 64 and t.isascii() and t != client_token("x" * 200, "other")
