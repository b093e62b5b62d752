"""AWS EC2 provider (boto3): spot and on-demand instances, live spot prices, placement scores.

Role: the `CloudProvider` for AWS. One instance per node through ``run_instances`` (spot via
``InstanceMarketOptions``), because every node gets its own user data (its enrolment token) and its
own ``orch-node`` tag, which one ``create_fleet`` request cannot express; diversification over pools is
the decision core's job (it picks the pool, and falls back to another pool or to on-demand).

Idempotency: every node's call carries an EC2 ``ClientToken`` derived from (launch token, node id), and
before launching the provider lists instances tagged with the launch token and launches only the nodes
that have none. The second guard is what makes a retried launch yield one instance on a cloud (or a
fake: moto ignores ClientToken) that does not enforce tokens; a per-token lock closes the race between
two threads of one process.

Prices: ``describe_spot_price_history`` (paged, newest price per (zone, type)), on-demand from the
bundled catalog or the config's ``on_demand_usd_h`` table, capacity hints from
``get_spot_placement_scores`` (score 1-10 -> 0.1-1.0; optional, skipped when refused).

Concurrency contract: all methods are synchronous, blocking and thread-safe (boto3 clients are
thread-safe; client creation and caches are under a lock). Credentials come from boto3's standard chain
(env, shared profile, SSO, instance/task role, web identity); ``profile`` picks a named profile.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import structlog

from providers import catalog
from providers.base import (
    TAG_CLUSTER,
    TAG_NODE,
    TAG_TOKEN,
    AuthError,
    CapacityError,
    Instance,
    InstanceState,
    LaunchRequest,
    LaunchResult,
    NotFound,
    PriceQuote,
    ProviderError,
    QuotaError,
    TransientError,
    check_owned,
    launch_each,
    raise_refused,
)
from providers.bootstrap import render_user_data
from wire import InstanceId, Market, NodeId, PoolKey
from wire.config import load_checked

log = structlog.get_logger("orch.providers.aws")

CLOUD = "aws"
_LIVE_STATES = ["pending", "running", "stopping", "stopped", "shutting-down"]
_LINUX = ("Linux/UNIX", "Linux/UNIX (Amazon VPC)")  # the second on accounts that predate default VPCs


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """``[providers.aws]``. Pools are zones x instance_types x markets."""

    regions: tuple[str, ...] = ("us-east-1",)
    zones: tuple[str, ...] = ()
    """Availability zone names (``us-east-1a``); each must start with one of ``regions``."""
    instance_types: tuple[str, ...] = ()
    markets: tuple[str, ...] = ("spot", "on_demand")
    images: Mapping[str, str] = field(default_factory=dict)
    """region -> AMI id (a GPU image with Python 3.11+; the bootstrap installs the agent)."""
    subnets: Mapping[str, str] = field(default_factory=dict)
    """zone -> subnet id. A zone without one launches into the default VPC's subnet of that zone."""
    security_group_ids: tuple[str, ...] = ()
    iam_instance_profile: str = ""
    """Instance profile name (the node's role: checkpoint bucket access). Empty: none."""
    key_name: str = ""
    root_volume_gib: int = 200
    root_device_name: str = "/dev/sda1"
    """The AMI's root device (Ubuntu/DLAMI: /dev/sda1; Amazon Linux: /dev/xvda). A wrong name adds a second volume."""
    spot_max_price_usd_h: float = 0.0
    """0: AWS default (capped at the on-demand price)."""
    endpoint_url: str = ""
    """Override the EC2 endpoint (tests point it at moto)."""
    profile: str = ""
    """Named profile from ~/.aws; empty uses the default chain."""
    max_attempts: int = 3
    """botocore retries (standard mode) per call, before a TransientError reaches the executor."""
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0
    price_lookback_s: float = 21600.0
    placement_scores: bool = True
    on_demand_usd_h: Mapping[str, float] = field(default_factory=dict)
    """instance type -> on-demand $/h, overriding the bundled catalog."""

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any], path: str = "providers.aws") -> Config:
        return load_checked(cls, raw, path)

    def check(self, path: str) -> list[str]:
        out = []
        for z in self.zones:
            if self.region_of(z) is None:
                out.append(f"{path}.zones: {z!r} is in none of regions {list(self.regions)}")
        for m in self.markets:
            if m not in ("spot", "on_demand"):
                out.append(f"{path}.markets: {m!r} is not one of spot, on_demand")
        if self.max_attempts < 1:
            out.append(f"{path}.max_attempts: must be >= 1")
        if self.zones and self.instance_types:
            for r in sorted({r for z in self.zones if (r := self.region_of(z)) is not None}):
                if r not in self.images:
                    out.append(f"{path}.images: no AMI for region {r!r} (a zone of it is configured)")
        return out

    def region_of(self, zone: str) -> str | None:
        best = [r for r in self.regions if zone.startswith(r)]
        return max(best, key=len) if best else None

    def pools(self) -> list[PoolKey]:
        return [
            PoolKey(cloud=CLOUD, region=self.region_of(z) or "", zone=z, instance_type=t, market=Market(m))
            for z in self.zones
            for t in self.instance_types
            for m in self.markets
        ]


# --- error mapping ---------------------------------------------------------------------------------

_CAPACITY = {
    "InsufficientInstanceCapacity", "InsufficientHostCapacity", "InsufficientReservedInstanceCapacity",
    "InsufficientCapacity", "InsufficientCapacityOnHost", "SpotMaxPriceTooLow", "UnfulfillableCapacity",
    "Unsupported", "InsufficientFreeAddressesInSubnet",
}
_QUOTA = {"InstanceLimitExceeded", "VcpuLimitExceeded", "MaxSpotInstanceCountExceeded", "SpotInstanceLimitExceeded",
          "ResourceLimitExceeded", "MaxSpotFleetRequestCountExceeded"}
_AUTH = {"AuthFailure", "UnauthorizedOperation", "InvalidClientTokenId", "SignatureDoesNotMatch", "ExpiredToken",
         "RequestExpired", "OptInRequired", "Blocked", "PendingVerification", "AccessDenied", "AccessDeniedException"}
_TRANSIENT = {"RequestLimitExceeded", "Throttling", "ThrottlingException", "InternalError", "InternalFailure",
              "ServiceUnavailable", "Unavailable", "RequestTimeout", "RequestTimeoutException"}
_NOT_FOUND = {"InvalidInstanceID.NotFound", "InvalidAMIID.NotFound", "InvalidSubnetID.NotFound"}
# Same ClientToken, different parameters (a retry re-rendered the user data with a new enrolment token):
# EC2 has the first call's instance; describe is eventually consistent, so look again shortly.
_ALREADY_LAUNCHED = {"IdempotentParameterMismatch"}


def map_error(e: Exception, pool: PoolKey | None = None) -> ProviderError:
    """A botocore exception as a typed provider error (with its retry classification)."""
    from botocore import exceptions as bx
    from botocore.parsers import ResponseParserError  # not in botocore.exceptions

    if isinstance(e, ProviderError):
        return e
    if isinstance(e, bx.ClientError):
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        msg = f"{code}: {err.get('Message', '')}"
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        if code in _CAPACITY:
            return CapacityError(msg, pool=pool)
        if code in _QUOTA:
            return QuotaError(msg, pool=pool)
        if code in _AUTH or status in (401, 403):
            return AuthError(msg, pool=pool)
        if code in _TRANSIENT or code in _ALREADY_LAUNCHED or status == 429 or status >= 500:
            return TransientError(msg, pool=pool)
        if code in _NOT_FOUND:
            return NotFound(msg, pool=pool)
        return ProviderError(msg, pool=pool)
    if isinstance(e, bx.NoCredentialsError | bx.PartialCredentialsError | bx.NoAuthTokenError
                  | bx.TokenRetrievalError | bx.UnauthorizedSSOTokenError | bx.ProfileNotFound):
        return AuthError(f"{type(e).__name__}: {e}", pool=pool)
    if isinstance(e, bx.ConnectionError | bx.HTTPClientError | ResponseParserError):
        return TransientError(f"{type(e).__name__}: {e}", pool=pool)
    return ProviderError(f"{type(e).__name__}: {e}", pool=pool)


def client_token(launch_token: str, node_id: str) -> str:
    """EC2 ClientToken (<= 64 ASCII chars) for one node of one launch."""
    return "orch-" + hashlib.sha256(f"{launch_token}\0{node_id}".encode()).hexdigest()[:48]


# --- provider --------------------------------------------------------------------------------------


class AwsProvider:
    cloud = CLOUD

    def __init__(self, config: Config, *, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._session: Any = None
        self._clients: dict[str, Any] = {}
        self._zone_ids: dict[str, dict[str, str]] = {}  # region -> zone id -> zone name
        # Striped per-token locks (bounded memory): two threads launching the same token serialize.
        self._token_locks = tuple(threading.Lock() for _ in range(64))

    @classmethod
    def from_settings(cls, raw: Mapping[str, Any]) -> AwsProvider:
        return cls(Config.from_raw(raw))

    # --- clients -----------------------------------------------------------------------------------

    def client(self, region: str) -> Any:
        """The EC2 client of a region (created once; boto3 clients are thread-safe, sessions are not)."""
        with self._lock:
            c = self._clients.get(region)
            if c is None:
                import boto3
                from botocore.config import Config as BotoConfig

                if self._session is None:
                    self._session = boto3.session.Session(profile_name=self.config.profile or None)
                c = self._session.client(
                    "ec2",
                    region_name=region,
                    endpoint_url=self.config.endpoint_url or None,
                    config=BotoConfig(
                        retries={"mode": "standard", "max_attempts": self.config.max_attempts},
                        connect_timeout=self.config.connect_timeout_s,
                        read_timeout=self.config.read_timeout_s,
                        user_agent_extra="orchd",
                    ),
                )
                self._clients[region] = c
            return c

    def _call(self, region: str, op: str, pool: PoolKey | None = None, **kw: Any) -> Any:
        try:
            return getattr(self.client(region), op)(**kw)
        except Exception as e:  # every SDK failure leaves as a typed error
            raise map_error(e, pool) from e

    def _pages(self, region: str, op: str, key: str, **kw: Any) -> Iterator[dict[str, Any]]:
        try:
            for page in self.client(region).get_paginator(op).paginate(**kw):
                yield from page.get(key, [])
        except Exception as e:
            raise map_error(e) from e

    # --- launch ------------------------------------------------------------------------------------

    def launch(self, request: LaunchRequest) -> LaunchResult:
        pool = request.pool
        if pool.cloud != CLOUD:
            raise ProviderError(f"not an AWS pool: {pool.name}", pool=pool)
        region = pool.region
        stripe = int(hashlib.sha256(request.idempotency_token.encode()).hexdigest()[:8], 16) % len(self._token_locks)
        with self._token_locks[stripe]:
            existing = {i.node_id: i for i in self._by_token(region, request) if i.node_id is not None}
            result = launch_each(request, lambda node_id: self._run_one(request, node_id), existing)
            if result.failure is not None:
                log.info("launch_partial", pool=pool.name, launched=len(result.instances), missing=result.missing,
                         reason=result.failure)
            return result

    def _run_one(self, request: LaunchRequest, node_id: NodeId) -> Instance:
        pool = request.pool
        cfg = self.config
        tags = [{"Key": k, "Value": v} for k, v in request.instance_tags(node_id).items()]
        kw: dict[str, Any] = {
            "ImageId": cfg.images.get(pool.region, ""),
            "InstanceType": pool.instance_type,
            "MinCount": 1,
            "MaxCount": 1,
            "ClientToken": client_token(request.idempotency_token, node_id),
            "TagSpecifications": [
                {"ResourceType": "instance", "Tags": tags},
                {"ResourceType": "volume", "Tags": tags},
            ],
            # IMDSv2 only, one hop: containers on the node cannot read the metadata (and the user data).
            "MetadataOptions": {"HttpTokens": "required", "HttpPutResponseHopLimit": 1, "HttpEndpoint": "enabled",
                                "InstanceMetadataTags": "enabled"},
            "BlockDeviceMappings": [{"DeviceName": cfg.root_device_name,
                                     "Ebs": {"VolumeSize": cfg.root_volume_gib, "VolumeType": "gp3",
                                             "DeleteOnTermination": True}}],
            "InstanceInitiatedShutdownBehavior": "terminate",
        }
        subnet = cfg.subnets.get(pool.zone)
        if subnet:
            kw["SubnetId"] = subnet
        else:
            kw["Placement"] = {"AvailabilityZone": pool.zone}
        if cfg.security_group_ids:
            kw["SecurityGroupIds"] = list(cfg.security_group_ids)
        if cfg.iam_instance_profile:
            kw["IamInstanceProfile"] = {"Name": cfg.iam_instance_profile}
        if cfg.key_name:
            kw["KeyName"] = cfg.key_name
        if request.bootstrap is not None:
            kw["UserData"] = render_user_data(node_id, request.bootstrap, cloud=CLOUD)
        if pool.market is Market.SPOT:
            spot: dict[str, Any] = {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}
            if cfg.spot_max_price_usd_h > 0:
                spot["MaxPrice"] = f"{cfg.spot_max_price_usd_h:.4f}"
            kw["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": spot}
        resp = self._call(pool.region, "run_instances", pool, **kw)
        inst = self._to_instance(resp["Instances"][0], pool.region)
        log.info("instance_launched", pool=pool.name, node=node_id, instance=inst.instance_id)
        return inst

    def _by_token(self, region: str, request: LaunchRequest) -> list[Instance]:
        filters = [
            {"Name": f"tag:{TAG_TOKEN}", "Values": [request.idempotency_token]},
            {"Name": f"tag:{TAG_CLUSTER}", "Values": [request.cluster_id]},
            {"Name": "instance-state-name", "Values": ["pending", "running"]},
        ]
        return [self._to_instance(i, region) for i in self._describe(region, filters)]

    # --- terminate / list / describe ----------------------------------------------------------------

    def terminate(self, instance_ids: Sequence[InstanceId], cluster_id: str) -> None:
        """Describe first, terminate only what carries this cluster's tag; refuse (and raise) the rest."""
        if not instance_ids:
            return
        refused: list[InstanceId] = []
        for region in self.config.regions:
            # Filter first: terminate_instances fails the whole call on one unknown id.
            by_id = [{"Name": "instance-id", "Values": list(instance_ids)}]
            described = [self._to_instance(i, region) for i in self._describe(region, by_id)]
            found, not_ours = check_owned(CLOUD, cluster_id, described, log.warning)
            refused += not_ours
            if found:
                self._call(region, "terminate_instances", InstanceIds=found)
                log.info("instances_terminated", region=region, instances=found)
        raise_refused(CLOUD, cluster_id, refused)

    def list_instances(self, cluster_id: str) -> list[Instance]:
        out = []
        for region in self.config.regions:
            filters = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [cluster_id]},
                       {"Name": "instance-state-name", "Values": _LIVE_STATES}]
            out += [self._to_instance(i, region) for i in self._describe(region, filters)]
        return out

    def describe(self, instance_ids: Sequence[InstanceId]) -> list[Instance]:
        if not instance_ids:
            return []
        out = []
        for region in self.config.regions:
            out += [self._to_instance(i, region)
                    for i in self._describe(region, [{"Name": "instance-id", "Values": list(instance_ids)}])]
        return out

    def _describe(self, region: str, filters: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for reservation in self._pages(region, "describe_instances", "Reservations", Filters=filters):
            out += reservation.get("Instances", [])
        return out

    def _to_instance(self, d: Mapping[str, Any], region: str) -> Instance:
        tags = {t["Key"]: t["Value"] for t in d.get("Tags", [])}
        state = {
            "pending": InstanceState.PENDING,
            "running": InstanceState.RUNNING,
            "terminated": InstanceState.TERMINATED,
        }.get(d.get("State", {}).get("Name", ""), InstanceState.STOPPING)
        launch_time = d.get("LaunchTime")
        return Instance(
            instance_id=InstanceId(d["InstanceId"]),
            node_id=NodeId(tags[TAG_NODE]) if TAG_NODE in tags else None,
            pool=PoolKey(
                cloud=CLOUD,
                region=region,
                zone=d.get("Placement", {}).get("AvailabilityZone", ""),
                instance_type=d.get("InstanceType", ""),
                market=Market.SPOT if d.get("InstanceLifecycle") == "spot" else Market.ON_DEMAND,
            ),
            state=state,
            tags=tags,
            launched_ts=launch_time.timestamp() if isinstance(launch_time, datetime) else None,
            private_ip=d.get("PrivateIpAddress"),
        )

    # --- prices ------------------------------------------------------------------------------------

    def prices(self, pools: Sequence[PoolKey] | None = None) -> list[PriceQuote]:
        wanted = list(pools) if pools is not None else self.config.pools()
        now = self._clock()
        out: list[PriceQuote] = []
        by_region: dict[str, list[PoolKey]] = {}
        for p in wanted:
            if p.cloud == CLOUD:
                by_region.setdefault(p.region, []).append(p)
        for region, rpools in sorted(by_region.items()):
            spot_types = sorted({p.instance_type for p in rpools if p.market is Market.SPOT})
            spot = self.spot_prices(region, spot_types, now) if spot_types else {}
            scores = self.placement_scores(region, spot_types) if spot_types and self.config.placement_scores else {}
            for p in rpools:
                gpu, n = catalog.gpu_of(CLOUD, p.instance_type)
                od = catalog.on_demand_usd_h(CLOUD, p.instance_type, dict(self.config.on_demand_usd_h))
                if p.market is Market.SPOT:
                    price = spot.get((p.zone, p.instance_type))
                    if price is None:
                        continue  # no spot offer in this zone for this type: no quote, not a zero price
                    out.append(PriceQuote(pool=p, gpu_type=gpu, gpus_per_node=n, price_usd_h=price, on_demand_usd_h=od,
                                          capacity_hint=scores.get((p.zone, p.instance_type)), ts=now))
                elif od is not None:
                    out.append(PriceQuote(pool=p, gpu_type=gpu, gpus_per_node=n, price_usd_h=od,
                                          on_demand_usd_h=od, ts=now))
        return out

    def spot_prices(self, region: str, instance_types: Sequence[str], now: float) -> dict[tuple[str, str], float]:
        """Newest Linux spot price per (zone, instance type), across every page of the history."""
        start = datetime.fromtimestamp(now, tz=UTC) - timedelta(seconds=self.config.price_lookback_s)
        newest: dict[tuple[str, str], tuple[datetime, float]] = {}
        for row in self._pages(region, "describe_spot_price_history", "SpotPriceHistory",
                               InstanceTypes=list(instance_types), ProductDescriptions=list(_LINUX),
                               StartTime=start):
            key = (row["AvailabilityZone"], row["InstanceType"])
            ts = row["Timestamp"]
            if key not in newest or ts > newest[key][0]:
                newest[key] = (ts, float(row["SpotPrice"]))
        return {k: v for k, (_, v) in newest.items()}

    def placement_scores(self, region: str, instance_types: Sequence[str]) -> dict[tuple[str, str], float]:
        """Spot placement score per (zone, type) as 0.1..1.0; {} where the API is refused or missing."""
        out: dict[tuple[str, str], float] = {}
        try:
            names = self._zone_names(region)
            for t in instance_types:
                for row in self._pages(region, "get_spot_placement_scores", "SpotPlacementScores",
                                       InstanceTypes=[t], TargetCapacity=1, TargetCapacityUnitType="units",
                                       SingleAvailabilityZone=True, RegionNames=[region]):
                    zone = names.get(row.get("AvailabilityZoneId", ""))
                    if zone and "Score" in row:
                        out[(zone, t)] = int(row["Score"]) / 10.0
        except ProviderError as e:
            log.info("placement_scores_unavailable", region=region, error=str(e))
            return {}
        return out

    def _zone_names(self, region: str) -> dict[str, str]:
        with self._lock:
            cached = self._zone_ids.get(region)
        if cached is not None:
            return cached
        resp = self._call(region, "describe_availability_zones")
        names = {z["ZoneId"]: z["ZoneName"] for z in resp.get("AvailabilityZones", [])}
        with self._lock:
            self._zone_ids[region] = names
        return names


def from_settings(table: Mapping[str, Any]) -> AwsProvider:
    """Module entry point used by the registries: validate ``[providers.aws]`` and build the provider."""
    return AwsProvider.from_settings(table)
