"""GCP Compute Engine provider (google-cloud-compute): Spot VMs, GPUs, labels, catalog prices.

Role: the `CloudProvider` for GCP. One VM per node: ``Scheduling(provisioning_model="SPOT",
instance_termination_action=...)`` for spot, GPUs as guest accelerators (built into a2/a3/g2 machine
types; from config for n1), labels for the orch tags, and the bootstrap as the ``startup-script``.

Idempotency: the VM name is derived from (launch token, node id), and GCE refuses a second VM of the
same name in a zone (409 alreadyExists: the provider then returns the existing VM). No lookup is needed.
``requestId`` is deliberately not sent: GCE answers a reused requestId with the first operation's
outcome for up to an hour, so a launch that failed for capacity could not be retried under its token.

Instance ids are ``<zone>/<name>`` (GCE addresses VMs by zone and name). Label values are restricted
(lowercase, ``[a-z0-9_-]``, 63 chars), so the exact tag values also go in the ``orch-tags`` metadata
item and are read back from there.

Operations: ``insert_unary`` + our own ``ZoneOperationsClient.wait`` (``insert().result()`` would poll
through a client built without our endpoint override - the real Google endpoint).

Errors: ``providers.gcp_errors`` maps API call and operation errors to the typed provider errors.

Prices: Cloud Billing Catalog SKUs of Compute Engine (``services/6F81-5844-456A``), paged; a VM's price is
GPU + vCPU + RAM SKUs of its family (spot = usage type "Preemptible"); or a JSON ``price_file``.

Concurrency contract: synchronous, blocking, thread-safe (the GAPIC clients are thread-safe; they are
created once under a lock). Credentials: google.auth's default chain (GOOGLE_APPLICATION_CREDENTIALS,
gcloud ADC, workload identity, the metadata server); ``anonymous = true`` only for local fakes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import structlog

from providers import catalog, gcp_prices
from providers.base import (
    TAG_CLUSTER,
    TAG_NODE,
    Instance,
    InstanceState,
    LaunchRequest,
    LaunchResult,
    NotFound,
    PriceQuote,
    ProviderError,
    TransientError,
    check_owned,
    launch_each,
    raise_refused,
)
from providers.bootstrap import render_user_data
from providers.gcp_errors import map_error, operation_error, reasons
from wire import InstanceId, Market, NodeId, PoolKey
from wire.config import load_checked

log = structlog.get_logger("orch.providers.gcp")

CLOUD = "gcp"

@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """``[providers.gcp]``. Pools are zones x machine_types x markets."""

    project: str = ""
    zones: tuple[str, ...] = ()
    machine_types: tuple[str, ...] = ()
    markets: tuple[str, ...] = ("spot", "on_demand")
    accelerators: Mapping[str, str] = field(default_factory=dict)
    """machine type -> "accelerator-type:count" for types without built-in GPUs
    (n1-standard-8 = "nvidia-tesla-t4:1")."""
    image: str = "projects/deeplearning-platform-release/global/images/family/common-cu124-debian-11-py310"
    disk_gb: int = 200
    disk_type: str = "pd-balanced"
    """Boot disk type (pd-balanced, pd-ssd; some newer families need hyperdisk-balanced)."""
    network: str = "global/networks/default"
    subnetwork: str = ""
    external_ip: bool = True
    """Nodes need egress to install the agent: an external IP, or Cloud NAT on the subnetwork."""
    service_account: str = ""
    """The node's service account email (checkpoint bucket access). Empty: none."""
    termination_action: str = "DELETE"
    """Spot VMs only: DELETE (nothing left behind) or STOP (the disk stays; the reaper deletes it)."""
    compute_endpoint: str = ""
    """Override the Compute API endpoint (tests point it at the fake)."""
    billing_endpoint: str = ""
    anonymous: bool = False
    """Use anonymous credentials: ONLY for local fakes."""
    price_file: str = ""
    """JSON {region: {machine_type: {"spot": $/h, "on_demand": $/h}}}; replaces the Billing Catalog."""
    on_demand_usd_h: Mapping[str, float] = field(default_factory=dict)
    operation_timeout_s: float = 300.0

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any], path: str = "providers.gcp") -> Config:
        return load_checked(cls, raw, path)

    def check(self, path: str) -> list[str]:
        out = []
        if not self.project:
            out.append(f"{path}.project: required")
        if self.termination_action not in ("DELETE", "STOP"):
            out.append(f"{path}.termination_action: {self.termination_action!r} is not one of DELETE, STOP")
        for m in self.markets:
            if m not in ("spot", "on_demand"):
                out.append(f"{path}.markets: {m!r} is not one of spot, on_demand")
        for z in self.zones:
            if not re.fullmatch(r"[a-z]+-[a-z]+\d+-[a-z]", z):
                out.append(f"{path}.zones: {z!r} is not a zone name like us-central1-a")
        for t, acc in self.accelerators.items():
            if not re.fullmatch(r"[a-z0-9-]+:\d+", acc):
                out.append(f"{path}.accelerators.{t}: {acc!r} is not 'type:count'")
        return out

    def pools(self) -> list[PoolKey]:
        return [PoolKey(cloud=CLOUD, region=region_of(z), zone=z, instance_type=t, market=Market(m))
                for z in self.zones for t in self.machine_types for m in self.markets]

    def accelerator(self, machine_type: str) -> tuple[str, int] | None:
        """(accelerator type, count) to attach; None for built-in GPUs (a2/a3/g2) or no GPU."""
        acc = self.accelerators.get(machine_type)
        if not acc:
            spec = catalog.spec(CLOUD, machine_type)
            if machine_type.startswith("n1-") and spec is not None and spec.accelerator:
                return spec.accelerator, spec.gpus  # n1 has no built-in GPU: attach the catalog's default
            return None
        name, n = acc.split(":")
        return name, int(n)


def region_of(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def label_value(v: str) -> str:
    """A GCE label value: lowercase, [a-z0-9_-], at most 63 characters."""
    return re.sub(r"[^a-z0-9_-]", "-", v.lower())[:63]


def vm_name(launch_token: str, node_id: str) -> str:
    """Deterministic VM name for (token, node): the idempotency key GCE enforces (unique per zone)."""
    slug = re.sub(r"[^a-z0-9-]", "-", node_id.lower()).strip("-")[:40] or "node"
    h = hashlib.sha256(f"{launch_token}\0{node_id}".encode()).hexdigest()[:12]
    return f"orch-{slug}-{h}"


# --- provider --------------------------------------------------------------------------------------


class GcpProvider:
    cloud = CLOUD

    def __init__(self, config: Config, *, credentials: Any = None, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._clock = clock
        self._credentials = credentials
        self._lock = threading.Lock()
        self._instances_client: Any = None
        self._ops_client: Any = None
        self._catalog_client: Any = None

    @classmethod
    def from_settings(cls, raw: Mapping[str, Any]) -> GcpProvider:
        return cls(Config.from_raw(raw))

    # --- clients -----------------------------------------------------------------------------------

    def _client_kwargs(self, endpoint: str) -> dict[str, Any]:
        from google.api_core.client_options import ClientOptions

        kw: dict[str, Any] = {"transport": "rest"}
        creds = self._credentials
        if creds is None and self.config.anonymous:
            from google.auth.credentials import AnonymousCredentials

            anonymous: Callable[[], object] = AnonymousCredentials  # untyped in google-auth
            creds = anonymous()
        if creds is not None:
            kw["credentials"] = creds
        if endpoint:
            kw["client_options"] = ClientOptions(api_endpoint=endpoint)
        return kw

    def _clients(self) -> tuple[Any, Any]:
        with self._lock:
            if self._instances_client is None:
                from google.cloud import compute_v1

                try:  # credentials are resolved here (ADC): a missing one is an AuthError, not a crash
                    kw = self._client_kwargs(self.config.compute_endpoint)
                    self._instances_client = compute_v1.InstancesClient(**kw)
                    self._ops_client = compute_v1.ZoneOperationsClient(**kw)
                except Exception as e:
                    raise map_error(e) from e
            return self._instances_client, self._ops_client

    def _catalog(self) -> Any:
        with self._lock:
            if self._catalog_client is None:
                from google.cloud import billing_v1

                try:
                    self._catalog_client = billing_v1.CloudCatalogClient(
                        **self._client_kwargs(self.config.billing_endpoint))
                except Exception as e:
                    raise map_error(e) from e
            return self._catalog_client

    # --- launch ------------------------------------------------------------------------------------

    def launch(self, request: LaunchRequest) -> LaunchResult:
        pool = request.pool
        if pool.cloud != CLOUD:
            raise ProviderError(f"not a GCP pool: {pool.name}", pool=pool)
        return launch_each(request, lambda node_id: self._launch_one(request, node_id))

    def _launch_one(self, request: LaunchRequest, node_id: NodeId) -> Instance:
        from google.api_core import exceptions as gx

        pool = request.pool
        instances, _ = self._clients()
        name = vm_name(request.idempotency_token, node_id)
        body = self._instance_body(request, node_id, name)
        try:
            # No requestId: GCE answers a reused requestId with the first operation's outcome, so a launch
            # that failed for capacity could never be retried under its token. The name is the key.
            op = instances.insert_unary(project=self.config.project, zone=pool.zone, instance_resource=body)
        except gx.Conflict as e:
            if "alreadyExists" not in reasons(e) and "already exists" not in str(e):
                raise map_error(e, pool) from e
            log.info("launch_replayed", pool=pool.name, node=node_id, instance=name)
            return self._get(pool.zone, name, pool)
        except Exception as e:
            raise map_error(e, pool) from e
        self._wait(op, pool)
        inst = self._get(pool.zone, name, pool)
        log.info("instance_launched", pool=pool.name, node=node_id, instance=inst.instance_id)
        return inst

    def _instance_body(self, request: LaunchRequest, node_id: NodeId, name: str) -> Any:
        from google.cloud import compute_v1 as c

        pool, cfg = request.pool, self.config
        tags = request.instance_tags(node_id)
        spot = pool.market is Market.SPOT
        scheduling = c.Scheduling(
            provisioning_model="SPOT" if spot else "STANDARD",
            on_host_maintenance="TERMINATE",  # GPUs cannot live-migrate
            automatic_restart=not spot,
        )
        if spot:
            scheduling.instance_termination_action = cfg.termination_action
        nic = c.NetworkInterface(network=cfg.network)
        if cfg.subnetwork:
            nic.subnetwork = cfg.subnetwork
        if cfg.external_ip:
            nic.access_configs = [c.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")]
        items = [c.Items(key="orch-tags", value=json.dumps(tags, sort_keys=True))]
        if request.bootstrap is not None:
            items.append(c.Items(key="startup-script", value=render_user_data(node_id, request.bootstrap, cloud=CLOUD)))
        body = c.Instance(
            name=name,
            machine_type=f"zones/{pool.zone}/machineTypes/{pool.instance_type}",
            labels={k: label_value(v) for k, v in tags.items()},
            scheduling=scheduling,
            disks=[c.AttachedDisk(boot=True, auto_delete=True, initialize_params=c.AttachedDiskInitializeParams(
                source_image=cfg.image, disk_size_gb=cfg.disk_gb,
                disk_type=f"zones/{pool.zone}/diskTypes/{cfg.disk_type}"))],
            network_interfaces=[nic],
            metadata=c.Metadata(items=items),
        )
        acc = cfg.accelerator(pool.instance_type)
        if acc is not None:
            body.guest_accelerators = [c.AcceleratorConfig(
                accelerator_type=f"zones/{pool.zone}/acceleratorTypes/{acc[0]}", accelerator_count=acc[1])]
        if cfg.service_account:
            body.service_accounts = [c.ServiceAccount(email=cfg.service_account,
                                                      scopes=["https://www.googleapis.com/auth/cloud-platform"])]
        return body

    def _wait(self, op: Any, pool: PoolKey) -> None:
        _, ops = self._clients()
        deadline = time.monotonic() + self.config.operation_timeout_s
        while op.status != op.Status.DONE:
            if time.monotonic() > deadline:
                raise TransientError(f"operation {op.name} not done after {self.config.operation_timeout_s}s",
                                     pool=pool)
            try:
                op = ops.wait(project=self.config.project, zone=pool.zone, operation=op.name)
            except Exception as e:
                raise map_error(e, pool) from e
        err = operation_error(op, pool)
        if err is not None:
            raise err

    def _get(self, zone: str, name: str, pool: PoolKey | None = None) -> Instance:
        instances, _ = self._clients()
        try:
            d = instances.get(project=self.config.project, zone=zone, instance=name)
        except Exception as e:
            raise map_error(e, pool) from e
        return self._to_instance(d)

    # --- terminate / list / describe ----------------------------------------------------------------

    def terminate(self, instance_ids: Sequence[InstanceId], cluster_id: str) -> None:
        """Get each instance first, delete only what carries this cluster's tag; refuse (and raise) the rest."""
        from google.api_core import exceptions as gx

        instances, _ = self._clients()
        # Exact tags from metadata (a label value may be mangled), as list_instances compares them.
        ours, refused = check_owned(CLOUD, cluster_id, self.describe(instance_ids), log.warning)
        pending = []
        for iid in ours:
            zone, _, name = iid.partition("/")
            try:
                op = instances.delete_unary(project=self.config.project, zone=zone, instance=name)
            except gx.NotFound:
                continue
            except Exception as e:
                raise map_error(e) from e
            pending.append((op, zone))
        for op, zone in pending:  # deletes run in parallel on GCE's side; wait for all
            where = PoolKey(cloud=CLOUD, region=region_of(zone), zone=zone, instance_type="", market=Market.SPOT)
            self._wait(op, where)
        if pending:
            log.info("instances_terminated", instances=ours)
        raise_refused(CLOUD, cluster_id, refused)

    def list_instances(self, cluster_id: str) -> list[Instance]:
        instances, _ = self._clients()
        flt = f'labels.{TAG_CLUSTER} = "{label_value(cluster_id)}"'
        from google.api_core import exceptions as gx

        try:
            try:
                pages = list(instances.aggregated_list(request={"project": self.config.project, "filter": flt}))
            except gx.BadRequest as e:
                # A filter the API refuses must not hide the fleet: list everything, filter here.
                log.warning("label_filter_refused", filter=flt, error=str(e))
                pages = list(instances.aggregated_list(request={"project": self.config.project}))
        except Exception as e:
            raise map_error(e) from e
        out = []
        for _zone, scoped in pages:
            for d in scoped.instances:
                inst = self._to_instance(d)  # exact tags from metadata: the label value may be mangled
                if inst.tags.get(TAG_CLUSTER) == cluster_id and inst.state is not InstanceState.TERMINATED:
                    out.append(inst)
        return out

    def describe(self, instance_ids: Sequence[InstanceId]) -> list[Instance]:
        out = []
        for iid in instance_ids:
            zone, _, name = iid.partition("/")
            try:
                out.append(self._get(zone, name))
            except NotFound:
                continue
        return out

    def _to_instance(self, d: Any) -> Instance:
        zone = d.zone.rsplit("/", 1)[-1]
        tags: dict[str, str] = dict(d.labels)
        for item in d.metadata.items if d.metadata else []:
            if item.key == "orch-tags":
                with contextlib.suppress(ValueError):  # a hand-edited item: the labels still hold the tags
                    tags.update(json.loads(item.value))
        state = {
            "PROVISIONING": InstanceState.PENDING,
            "STAGING": InstanceState.PENDING,
            "RUNNING": InstanceState.RUNNING,
            "REPAIRING": InstanceState.RUNNING,
        }.get(d.status, InstanceState.STOPPING)  # STOPPING/SUSPENDED/TERMINATED(=stopped): exists, not alive
        spot = d.scheduling.provisioning_model == "SPOT" or d.scheduling.preemptible
        ts = None
        if d.creation_timestamp:
            try:
                ts = datetime.fromisoformat(d.creation_timestamp.replace("Z", "+00:00")).timestamp()
            except ValueError:
                ts = None
        ip = d.network_interfaces[0].network_i_p if d.network_interfaces else None
        return Instance(
            instance_id=InstanceId(f"{zone}/{d.name}"),
            node_id=NodeId(tags[TAG_NODE]) if TAG_NODE in tags else None,
            pool=PoolKey(cloud=CLOUD, region=region_of(zone), zone=zone,
                         instance_type=d.machine_type.rsplit("/", 1)[-1],
                         market=Market.SPOT if spot else Market.ON_DEMAND),
            state=state,
            tags=tags,
            launched_ts=ts,
            private_ip=ip or None,
        )

    # --- prices ------------------------------------------------------------------------------------

    def prices(self, pools: Sequence[PoolKey] | None = None) -> list[PriceQuote]:
        wanted = [p for p in (pools if pools is not None else self.config.pools()) if p.cloud == CLOUD]
        now = self._clock()
        if self.config.price_file:
            table = gcp_prices.read_price_file(self.config.price_file)
        else:
            table = self._catalog_prices({p.region for p in wanted}, {p.instance_type for p in wanted})
        out = []
        for p in wanted:
            gpu, n = catalog.gpu_of(CLOUD, p.instance_type)
            acc = self.config.accelerator(p.instance_type)
            if acc is not None:
                gpu, n = _gpu_name(acc[0]), acc[1]
            row = table.get((p.region, p.instance_type), {})
            od = self.config.on_demand_usd_h.get(p.instance_type, row.get("on_demand"))
            if od is None:
                od = catalog.on_demand_usd_h(CLOUD, p.instance_type)
            price = row.get("spot") if p.market is Market.SPOT else od
            if price is None:
                continue
            out.append(PriceQuote(pool=p, gpu_type=gpu, gpus_per_node=n, price_usd_h=price, on_demand_usd_h=od, ts=now))
        return out

    def _catalog_prices(self, regions: set[str], machine_types: set[str]) -> gcp_prices.PriceTable:
        """(region, machine type) -> {"spot": $/h, "on_demand": $/h} from GPU + core + RAM SKUs (paged)."""
        try:
            unit = gcp_prices.unit_prices(self._catalog().list_skus(parent=gcp_prices.COMPUTE_SERVICE), regions)
        except Exception as e:
            raise map_error(e) from e

        def missing(region: str, mt: str, market: str) -> None:
            log.info("gcp_price_component_missing", region=region, machine_type=mt, market=market)

        return gcp_prices.compose(unit, regions, machine_types, self.config.accelerator, missing)


def _gpu_name(accelerator: str) -> str:
    for s in catalog.CATALOG.values():
        if s.cloud == CLOUD and s.accelerator == accelerator:
            return s.gpu_type
    return accelerator


def from_settings(table: Mapping[str, Any]) -> GcpProvider:
    """Module entry point used by the registries: validate ``[providers.gcp]`` and build the provider."""
    return GcpProvider.from_settings(table)
