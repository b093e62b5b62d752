"""Wire-level fake of Azure Resource Manager (virtual machines) and the Retail Prices API.

Driven by the real azure-mgmt-compute client (``base_url`` pointed here, no-op auth policy,
``polling_interval=0``). VM PUT is create-or-update keyed by name (so a replay is one VM); a new VM
answers 201 ``Creating`` with an ``Azure-AsyncOperation`` header, and the operation reports Succeeded -
or, with ``async_failures`` queued, Failed with that error code (AllocationFailed arrives like this on
real Azure). ``sync_failures`` queue (status, code) answers to the next PUT (409 SkuNotAvailable, 429).
VM lists page by ``page_size``. Retail prices serve ``price_rows`` filtered by region and SKU names,
paged through ``NextPageLink``.
"""

from __future__ import annotations

import itertools
import re
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from tests.providers.fakes.http import FakeHttpServer

VM = r"/subscriptions/([^/]+)/resourceGroups/([^/]+)/providers/Microsoft\.Compute/virtualMachines"


class FakeAzure:
    def __init__(self, *, page_size: int = 2) -> None:
        self.server = FakeHttpServer()
        self.vms: dict[tuple[str, str], dict[str, Any]] = {}  # (rg, name) -> vm json
        self.ops: dict[str, dict[str, Any]] = {}
        self.sync_failures: list[tuple[int, str]] = []
        self.async_failures: list[str | None] = []  # None: that operation succeeds
        self.price_rows: list[dict[str, Any]] = []
        self.page_size = page_size
        self.puts = 0
        self._ids = itertools.count(1)
        s = self.server
        s.route("PUT", VM + r"/([^/]+)", self._put)
        s.route("GET", VM + r"/([^/]+)", self._get)
        s.route("DELETE", VM + r"/([^/]+)", self._delete)
        s.route("GET", VM, self._list)
        s.route("GET", r"/subscriptions/([^/]+)/providers/Microsoft\.Compute/locations/([^/]+)/operations/([^/]+)",
                self._op)
        s.route("GET", r"/api/retail/prices", self._prices)

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> FakeAzure:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()

    @staticmethod
    def _err(status: int, code: str, message: str = "") -> tuple[int, Any]:
        return status, {"error": {"code": code, "message": message or f"injected {code}"}}

    def _put(self, sub: str, rg: str, name: str, *, body: dict, **_: Any) -> Any:
        self.puts += 1
        if self.sync_failures:
            status, code = self.sync_failures.pop(0)
            return self._err(status, code)
        existing = self.vms.get((rg, name))
        vm = dict(body)
        props = dict(vm.get("properties", {}))
        vm.update({"id": f"/subscriptions/{sub}/resourceGroups/{rg}/providers/Microsoft.Compute/virtualMachines/{name}",
                   "name": name, "type": "Microsoft.Compute/virtualMachines"})
        if existing is not None:  # update in place: still one VM
            props.update({"provisioningState": "Succeeded", "vmId": existing["properties"]["vmId"],
                          "timeCreated": existing["properties"]["timeCreated"]})
            vm["properties"] = props
            self.vms[(rg, name)] = vm
            return 200, vm
        props.update({"provisioningState": "Creating", "vmId": f"vm-{next(self._ids):04d}",
                      "timeCreated": datetime.now(UTC).isoformat()})
        vm["properties"] = props
        self.vms[(rg, name)] = vm
        op_id = f"op-{next(self._ids)}"
        self.ops[op_id] = {"rg": rg, "name": name, "fail": self.async_failures.pop(0) if self.async_failures else None}
        loc = vm.get("location", "eastus")
        header = (f"{{base}}/subscriptions/{sub}/providers/Microsoft.Compute/locations/{loc}/operations/{op_id}"
                  "?api-version=2024-07-01")
        return 201, vm, {"Azure-AsyncOperation": header}

    def _op(self, sub: str, loc: str, op_id: str, **_: Any) -> Any:
        op = self.ops[op_id]
        vm = self.vms.get((op["rg"], op["name"]))
        if op["fail"]:
            if vm is not None:
                vm["properties"]["provisioningState"] = "Failed"
            return 200, {"name": op_id, "status": "Failed",
                         "error": {"code": op["fail"], "message": f"Allocation failed ({op['fail']})"}}
        if vm is not None:
            vm["properties"]["provisioningState"] = "Succeeded"
        return 200, {"name": op_id, "status": "Succeeded"}

    def _get(self, sub: str, rg: str, name: str, **_: Any) -> Any:
        vm = self.vms.get((rg, name))
        if vm is None:
            return self._err(404, "ResourceNotFound",
                             f"The Resource 'Microsoft.Compute/virtualMachines/{name}' was not found.")
        return 200, vm

    def _delete(self, sub: str, rg: str, name: str, **_: Any) -> Any:
        if self.vms.pop((rg, name), None) is None:
            return 204, None
        return 200, None

    def _list(self, sub: str, rg: str, *, query: dict, **_: Any) -> Any:
        rows = [v for (g, _), v in sorted(self.vms.items()) if g == rg]
        start = int((query.get("$skiptoken") or ["0"])[0])
        out: dict[str, Any] = {"value": rows[start:start + self.page_size]}
        if start + self.page_size < len(rows):
            out["nextLink"] = (f"{self.url}/subscriptions/{sub}/resourceGroups/{rg}/providers/Microsoft.Compute/"
                               f"virtualMachines?api-version=2024-07-01&$skiptoken={start + self.page_size}")
        return 200, out

    def _prices(self, *, query: dict, **_: Any) -> Any:
        flt = (query.get("$filter") or [""])[0]
        regions = set(re.findall(r"armRegionName eq '([^']+)'", flt))
        skus = set(re.findall(r"armSkuName eq '([^']+)'", flt))
        rows = [r for r in self.price_rows if (not regions or r["armRegionName"] in regions)
                and (not skus or r["armSkuName"] in skus)]
        skip = int((query.get("$skip") or ["0"])[0])
        out: dict[str, Any] = {"BillingCurrency": "USD", "Items": rows[skip:skip + self.page_size],
                               "Count": len(rows[skip:skip + self.page_size])}
        if skip + self.page_size < len(rows):
            out["NextPageLink"] = f"{self.url}/api/retail/prices?$filter={quote(flt)}&$skip={skip + self.page_size}"
        else:
            out["NextPageLink"] = None
        return 200, out

    def live(self, cluster: str) -> list[dict[str, Any]]:
        with self.server.lock:
            return [v for v in self.vms.values() if v.get("tags", {}).get("orch-cluster") == cluster]


def price_row(region: str, sku: str, sku_name: str, price: float,
              product: str = "Virtual Machines NCADS A100 v4 Series") -> dict[str, Any]:
    return {"currencyCode": "USD", "retailPrice": price, "unitPrice": price, "armRegionName": region,
            "location": "US East", "effectiveStartDate": "2025-01-01T00:00:00Z", "meterName": sku_name,
            "productName": product, "skuName": sku_name, "serviceName": "Virtual Machines",
            "armSkuName": sku, "unitOfMeasure": "1 Hour", "type": "Consumption", "isPrimaryMeterRegion": True}
