"""Azure provider (azure-mgmt-compute): Spot VMs, tags, Retail Prices API.

Role: the `CloudProvider` for Azure. One VM per node: ``priority="Spot"`` with an eviction policy and
``billing_profile.max_price`` (-1: pay up to the on-demand price, never evicted for price), tags for the
orch tags, the bootstrap as ``user_data``. No separate NIC resource: the VM's network profile declares
a NIC configuration on the configured subnet (``network_api_version`` 2020-11-01) that Compute creates
and deletes with the VM (``delete_option="Delete"``, as for the OS disk), so azure-mgmt-network is not
needed and nothing leaks when a VM is deleted.

Idempotency: the VM name is derived from (launch token, node id); ARM's PUT is create-or-update by
name, and the provider GETs first and returns an existing VM of that name without a second PUT.

Pools: ``zones`` are ``<region>-<n>`` (zonal, e.g. ``eastus-1``) or ``<region>`` (regional). Instance
ids are VM names in the configured resource group.

Prices: the Retail Prices API (no auth), paged through ``NextPageLink``; spot rows have ``skuName``
ending in " Spot"; Windows and Low Priority rows are ignored. Prices are per region (all zones alike).

Concurrency contract: synchronous, blocking, thread-safe (the mgmt client is thread-safe; it is created
once under a lock). Credentials: azure-identity's ``DefaultAzureCredential`` (env service principal,
workload identity, managed identity, Azure CLI); ``anonymous = true`` only for local fakes.
"""

from __future__ import annotations

import base64
import hashlib
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from providers import catalog
from providers.base import (
    TAG_CLUSTER,
    TAG_NODE,
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

log = structlog.get_logger("orch.providers.azure")

CLOUD = "azure"
RETAIL_PRICES_URL = "https://prices.azure.com"


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """``[providers.azure]``. Pools are zones x vm_sizes x markets."""

    subscription_id: str = ""
    resource_group: str = ""
    zones: tuple[str, ...] = ()
    """``eastus-1`` (zone 1 of eastus) or ``eastus`` (regional, no zone)."""
    vm_sizes: tuple[str, ...] = ()
    markets: tuple[str, ...] = ("spot", "on_demand")
    subnet_id: str = ""
    """ARM id of the subnet the VMs' NICs go in (one per region: a mapping is a later extension)."""
    public_ip: bool = False
    """Give each VM a public IP (otherwise the subnet needs a NAT gateway for the agent install)."""
    image: Mapping[str, str] = field(default_factory=lambda: {
        "publisher": "microsoft-dsvm", "offer": "ubuntu-hpc", "sku": "2204", "version": "latest"})
    """An image reference (publisher/offer/sku/version) or {"id": "<ARM image id>"}."""
    admin_username: str = "orch"
    ssh_public_key: str = ""
    """Required by Azure for Linux VMs (password login stays disabled)."""
    os_disk_gb: int = 200
    eviction_policy: str = "Delete"
    """Delete (nothing left behind) or Deallocate (the disk stays; the reaper deletes it)."""
    max_price_usd_h: float = -1.0
    """-1: up to the on-demand price (evicted only for capacity)."""
    identity_id: str = ""
    """User-assigned managed identity ARM id for the node (checkpoint storage access). Empty: none."""
    arm_endpoint: str = ""
    """Override the ARM endpoint (tests point it at the fake)."""
    prices_endpoint: str = RETAIL_PRICES_URL
    anonymous: bool = False
    """No authentication: ONLY for local fakes."""
    polling_interval_s: float = 5.0
    retry_total: int = 3
    """azure-core retries (429, 5xx, connection errors) per call before a TransientError reaches the executor."""
    price_timeout_s: float = 30.0
    on_demand_usd_h: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any], path: str = "providers.azure") -> Config:
        return load_checked(cls, raw, path)

    def check(self, path: str) -> list[str]:
        out = []
        for key in ("subscription_id", "resource_group"):
            if not getattr(self, key):
                out.append(f"{path}.{key}: required")
        if self.eviction_policy not in ("Delete", "Deallocate"):
            out.append(f"{path}.eviction_policy: {self.eviction_policy!r} is not one of Delete, Deallocate")
        for m in self.markets:
            if m not in ("spot", "on_demand"):
                out.append(f"{path}.markets: {m!r} is not one of spot, on_demand")
        for z in self.zones:
            if not re.fullmatch(r"[a-z0-9]+(-[1-9])?", z):
                out.append(f"{path}.zones: {z!r} is not 'region' or 'region-N' (eastus, eastus-1)")
        if self.zones and self.vm_sizes:
            for key in ("subnet_id", "ssh_public_key"):
                if not getattr(self, key):
                    out.append(f"{path}.{key}: required to launch VMs")
        if not ("id" in self.image or {"publisher", "offer", "sku"} <= set(self.image)):
            out.append(f"{path}.image: needs 'id' or publisher/offer/sku")
        return out

    def pools(self) -> list[PoolKey]:
        return [PoolKey(cloud=CLOUD, region=split_zone(z)[0], zone=z, instance_type=t, market=Market(m))
                for z in self.zones for t in self.vm_sizes for m in self.markets]


def split_zone(zone: str) -> tuple[str, str | None]:
    """``eastus-1`` -> ("eastus", "1"); ``eastus`` -> ("eastus", None)."""
    region, _, n = zone.partition("-")
    return region, (n or None)


def vm_name(launch_token: str, node_id: str) -> str:
    """Deterministic VM name (<= 64 chars, also a valid Linux host name) for (token, node)."""
    slug = re.sub(r"[^a-z0-9-]", "-", node_id.lower()).strip("-")[:40] or "node"
    h = hashlib.sha256(f"{launch_token}\0{node_id}".encode()).hexdigest()[:12]
    return f"orch-{slug}-{h}"


# --- error mapping ---------------------------------------------------------------------------------

_CAPACITY = {"SkuNotAvailable", "AllocationFailed", "ZonalAllocationFailed", "OverconstrainedAllocationRequest",
             "OverconstrainedZonalAllocationRequest", "SpotMaxPriceTooLow", "AllocationFailedVMSeriesNotAvailable"}
_QUOTA = {"QuotaExceeded", "OperationNotAllowedQuotaExceeded", "LowPriorityCoresQuotaExceeded"}
_AUTH = {"AuthorizationFailed", "AuthenticationFailed", "InvalidAuthenticationToken", "LinkedAuthorizationFailed",
         "InvalidAuthenticationTokenTenant", "ExpiredAuthenticationToken"}
_TRANSIENT = {"TooManyRequests", "InternalServerError", "ServiceUnavailable", "RetryableError", "GatewayTimeout",
              "InternalExecutionError", "OperationPreempted"}


def map_error(e: Exception, pool: PoolKey | None = None) -> ProviderError:
    from azure.core import exceptions as ax

    if isinstance(e, ProviderError):
        return e
    code = ""
    err = getattr(e, "error", None)
    if err is not None and getattr(err, "code", None):
        code = str(err.code)
    status = int(getattr(e, "status_code", 0) or 0)
    msg = f"{code or type(e).__name__}: {getattr(err, 'message', None) or e}"
    if code in _CAPACITY:
        return CapacityError(msg, pool=pool)
    if code in _QUOTA or (code == "OperationNotAllowed" and "quota" in msg.lower()):
        return QuotaError(msg, pool=pool)
    if isinstance(e, ax.ClientAuthenticationError) or code in _AUTH or status in (401, 403):
        return AuthError(msg, pool=pool)
    if code in _TRANSIENT or status == 429 or status >= 500:
        return TransientError(msg, pool=pool)
    if isinstance(e, ax.ResourceNotFoundError) or status == 404:
        return NotFound(msg, pool=pool)
    if isinstance(e, ax.ServiceRequestError | ax.ServiceResponseError):
        return TransientError(msg, pool=pool)
    try:
        from azure.identity import CredentialUnavailableError

        if isinstance(e, CredentialUnavailableError):
            return AuthError(msg, pool=pool)
    except ImportError:  # pragma: no cover
        pass
    return ProviderError(msg, pool=pool)


# --- provider --------------------------------------------------------------------------------------


class AzureProvider:
    cloud = CLOUD

    def __init__(self, config: Config, *, credential: Any = None, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._credential = credential
        self._clock = clock
        self._lock = threading.Lock()
        self._client: Any = None
        self._http: Any = None

    @classmethod
    def from_settings(cls, raw: Mapping[str, Any]) -> AzureProvider:
        return cls(Config.from_raw(raw))

    def _vms(self) -> Any:
        with self._lock:
            if self._client is None:
                from azure.mgmt.compute import ComputeManagementClient

                kw: dict[str, Any] = {"polling_interval": self.config.polling_interval_s,
                                      "retry_total": self.config.retry_total}
                if self.config.arm_endpoint:
                    kw["base_url"] = self.config.arm_endpoint
                credential = self._credential
                if self.config.anonymous:
                    from azure.core.pipeline.policies import SansIOHTTPPolicy

                    kw["authentication_policy"] = SansIOHTTPPolicy()  # no bearer token over plain http
                    credential = credential or object()
                elif credential is None:
                    from azure.identity import DefaultAzureCredential

                    credential = DefaultAzureCredential()
                self._client = ComputeManagementClient(credential, self.config.subscription_id, **kw)
            return self._client.virtual_machines

    # --- launch ------------------------------------------------------------------------------------

    def launch(self, request: LaunchRequest) -> LaunchResult:
        pool = request.pool
        if pool.cloud != CLOUD:
            raise ProviderError(f"not an Azure pool: {pool.name}", pool=pool)
        return launch_each(request, lambda node_id: self._launch_one(request, node_id))

    def _launch_one(self, request: LaunchRequest, node_id: NodeId) -> Instance:
        pool, rg = request.pool, self.config.resource_group
        name = vm_name(request.idempotency_token, node_id)
        existing = self._get(name, pool)
        if existing is not None and existing.state is not InstanceState.STOPPING:
            log.info("launch_replayed", pool=pool.name, node=node_id, instance=name)
            return existing
        try:
            vm = self._vms().begin_create_or_update(rg, name, self._vm_body(request, node_id, name)).result()
        except Exception as e:
            err = map_error(e, pool)
            if isinstance(err, CapacityError):
                self._delete_failed(name)  # an async allocation failure leaves a Failed VM behind
            raise err from e
        inst = self._to_instance(vm)
        log.info("instance_launched", pool=pool.name, node=node_id, instance=inst.instance_id)
        return inst

    def _delete_failed(self, name: str) -> None:
        try:
            self._vms().begin_delete(self.config.resource_group, name).result()
        except Exception as e:  # best effort; the reaper lists and deletes leftovers
            log.warning("failed_vm_delete_failed", instance=name, error=str(map_error(e)))

    def _vm_body(self, request: LaunchRequest, node_id: NodeId, name: str) -> Any:
        from azure.mgmt.compute import models

        # The flattened keywords (hardware_profile=, priority=, delete_option=) are what every supported SDK
        # takes: msrest models before 39, a compatibility layer since. 39's typed overloads list only
        # ``properties=``, so the models are used untyped here rather than in the 39-only nested form.
        m: Any = models

        pool, cfg = request.pool, self.config
        region, zone = split_zone(pool.zone)
        spot = pool.market is Market.SPOT
        image = (m.ImageReference(id=cfg.image["id"]) if "id" in cfg.image else
                 m.ImageReference(publisher=cfg.image["publisher"], offer=cfg.image["offer"], sku=cfg.image["sku"],
                                  version=cfg.image.get("version", "latest")))
        ipconf: dict[str, Any] = {"name": "ipconfig1", "primary": True, "subnet": m.SubResource(id=cfg.subnet_id)}
        if cfg.public_ip:
            ipconf["public_ip_address_configuration"] = m.VirtualMachinePublicIPAddressConfiguration(
                name=f"{name}-pip", delete_option="Delete", sku=m.PublicIPAddressSku(name="Standard"))
        user_data = None
        if request.bootstrap is not None:
            user_data = base64.b64encode(render_user_data(node_id, request.bootstrap, cloud=CLOUD).encode()).decode()
        vm = m.VirtualMachine(
            location=region,
            tags=request.instance_tags(node_id),
            hardware_profile=m.HardwareProfile(vm_size=pool.instance_type),
            storage_profile=m.StorageProfile(
                image_reference=image,
                os_disk=m.OSDisk(create_option="FromImage", delete_option="Delete", disk_size_gb=cfg.os_disk_gb,
                                 managed_disk=m.ManagedDiskParameters(storage_account_type="Premium_LRS")),
            ),
            os_profile=m.OSProfile(
                computer_name=name,
                admin_username=cfg.admin_username,
                linux_configuration=m.LinuxConfiguration(
                    disable_password_authentication=True,
                    ssh=m.SshConfiguration(public_keys=[m.SshPublicKey(
                        path=f"/home/{cfg.admin_username}/.ssh/authorized_keys", key_data=cfg.ssh_public_key)]),
                ),
            ),
            network_profile=m.NetworkProfile(
                network_api_version="2020-11-01",
                network_interface_configurations=[m.VirtualMachineNetworkInterfaceConfiguration(
                    name=f"{name}-nic", primary=True, delete_option="Delete",
                    ip_configurations=[m.VirtualMachineNetworkInterfaceIPConfiguration(**ipconf)],
                )],
            ),
            user_data=user_data,
            priority="Spot" if spot else "Regular",
        )
        if spot:
            vm.eviction_policy = cfg.eviction_policy
            vm.billing_profile = m.BillingProfile(max_price=cfg.max_price_usd_h)
        if zone:
            vm.zones = [zone]
        if cfg.identity_id:
            vm.identity = m.VirtualMachineIdentity(
                type="UserAssigned", user_assigned_identities={cfg.identity_id: m.UserAssignedIdentitiesValue()})
        return vm

    def _get(self, name: str, pool: PoolKey | None = None) -> Instance | None:
        from azure.core.exceptions import ResourceNotFoundError

        try:
            return self._to_instance(self._vms().get(self.config.resource_group, name))
        except ResourceNotFoundError:
            return None
        except Exception as e:
            raise map_error(e, pool) from e

    # --- terminate / list / describe ----------------------------------------------------------------

    def terminate(self, instance_ids: Sequence[InstanceId], cluster_id: str) -> None:
        """Get each VM first, delete only what carries this cluster's tag; refuse (and raise) the rest."""
        from azure.core.exceptions import ResourceNotFoundError

        ours, refused = check_owned(CLOUD, cluster_id, self.describe(instance_ids), log.warning)
        pollers = []
        for name in ours:
            try:
                pollers.append(self._vms().begin_delete(self.config.resource_group, name))
            except ResourceNotFoundError:
                continue
            except Exception as e:
                raise map_error(e) from e
        for p in pollers:  # deletes run in parallel on Azure's side
            try:
                p.result()
            except ResourceNotFoundError:
                continue
            except Exception as e:
                raise map_error(e) from e
        if pollers:
            log.info("instances_terminated", instances=ours)
        raise_refused(CLOUD, cluster_id, refused)

    def list_instances(self, cluster_id: str) -> list[Instance]:
        try:
            vms = list(self._vms().list(self.config.resource_group))
        except Exception as e:
            raise map_error(e) from e
        return [i for i in map(self._to_instance, vms) if i.tags.get(TAG_CLUSTER) == cluster_id]

    def describe(self, instance_ids: Sequence[InstanceId]) -> list[Instance]:
        return [i for i in (self._get(n) for n in instance_ids) if i is not None]

    def _to_instance(self, vm: Any) -> Instance:
        tags = dict(vm.tags or {})
        zone = f"{vm.location}-{vm.zones[0]}" if vm.zones else vm.location
        state = {
            "Creating": InstanceState.PENDING,
            "Updating": InstanceState.PENDING,
            "Succeeded": InstanceState.RUNNING,
        }.get(_plain(vm.provisioning_state), InstanceState.STOPPING)  # Deleting / Failed: exists, not alive
        created = vm.time_created
        return Instance(
            instance_id=InstanceId(vm.name),
            node_id=NodeId(tags[TAG_NODE]) if TAG_NODE in tags else None,
            pool=PoolKey(cloud=CLOUD, region=vm.location, zone=zone,
                         instance_type=_plain(vm.hardware_profile.vm_size) if vm.hardware_profile else "",
                         market=Market.SPOT if (vm.priority or "").lower() == "spot" else Market.ON_DEMAND),
            state=state,
            tags=tags,
            launched_ts=created.timestamp() if created is not None else None,
        )

    # --- prices ------------------------------------------------------------------------------------

    def prices(self, pools: Sequence[PoolKey] | None = None) -> list[PriceQuote]:
        wanted = [p for p in (pools if pools is not None else self.config.pools()) if p.cloud == CLOUD]
        now = self._clock()
        out = []
        by_region: dict[str, set[str]] = {}
        for p in wanted:
            by_region.setdefault(p.region, set()).add(p.instance_type)
        table: dict[tuple[str, str, Market], float] = {}
        for region, sizes in sorted(by_region.items()):
            table |= self.retail_prices(region, sorted(sizes))
        for p in wanted:
            gpu, n = catalog.gpu_of(CLOUD, p.instance_type)
            listed_od = table.get((p.region, p.instance_type, Market.ON_DEMAND))
            od = self.config.on_demand_usd_h.get(p.instance_type, listed_od)
            if od is None:
                od = catalog.on_demand_usd_h(CLOUD, p.instance_type)
            price = table.get((p.region, p.instance_type, Market.SPOT)) if p.market is Market.SPOT else od
            if price is None:
                continue
            out.append(PriceQuote(pool=p, gpu_type=gpu, gpus_per_node=n, price_usd_h=price, on_demand_usd_h=od, ts=now))
        return out

    def retail_prices(self, region: str, vm_sizes: Sequence[str]) -> dict[tuple[str, str, Market], float]:
        """(region, vm size, market) -> Linux $/h from the Retail Prices API, following NextPageLink."""
        import requests

        skus = " or ".join(f"armSkuName eq '{s}'" for s in vm_sizes)
        flt = (f"serviceName eq 'Virtual Machines' and priceType eq 'Consumption' and armRegionName eq '{region}'"
               f" and ({skus})")
        url: str | None = f"{self.config.prices_endpoint.rstrip('/')}/api/retail/prices"
        params: dict[str, str] | None = {"$filter": flt}
        out: dict[tuple[str, str, Market], float] = {}
        with self._lock:
            if self._http is None:
                self._http = requests.Session()
            http = self._http
        pages = 0
        while url:
            try:
                r = http.get(url, params=params, timeout=self.config.price_timeout_s)
            except requests.RequestException as e:
                raise TransientError(f"retail prices: {type(e).__name__}: {e}") from e
            if r.status_code == 429 or r.status_code >= 500:
                raise TransientError(f"retail prices: HTTP {r.status_code}")
            if r.status_code != 200:
                raise ProviderError(f"retail prices: HTTP {r.status_code}: {r.text[:200]}")
            data = r.json()
            for row in data.get("Items", []):
                sku_name = str(row.get("skuName", ""))
                if ("Windows" in str(row.get("productName", "")) or "Low Priority" in sku_name
                        or row.get("unitOfMeasure") != "1 Hour" or row.get("type") != "Consumption"):
                    continue
                market = Market.SPOT if sku_name.endswith(" Spot") else Market.ON_DEMAND
                key = (str(row.get("armRegionName")), str(row.get("armSkuName")), market)
                out[key] = float(row["retailPrice"])
            url, params = data.get("NextPageLink"), None  # the link carries the filter and the skip
            pages += 1
            if pages > 200:
                raise ProviderError("retail prices: more than 200 pages; filter too broad")
        return out


def _plain(v: Any) -> str:
    """An SDK value as its wire string (SDK enums are str subclasses whose str() is 'Type.NAME')."""
    if v is None:
        return ""
    return str(getattr(v, "value", v))


def from_settings(table: Mapping[str, Any]) -> AzureProvider:
    """Module entry point used by the registries: validate ``[providers.azure]`` and build the provider."""
    return AzureProvider.from_settings(table)
