"""Wire-level fake of GCE compute (instances, zone operations, aggregated list) and the billing catalog.

Driven by the real google-cloud-compute / google-cloud-billing REST clients. Enforces what the provider
relies on: instance names are unique per zone (409 alreadyExists), ``requestId`` replays return the
first operation, insert/delete operations start RUNNING and finish on ``wait``. Faults: ``stockout``
(zone -> how many inserts fail with ZONE_RESOURCE_POOL_EXHAUSTED in the operation), ``http_faults``
(queue of (status, reason) answered to the next insert). Labels filter: ``labels.K = "V"``.
"""

from __future__ import annotations

import itertools
import re
from datetime import UTC, datetime
from typing import Any

from tests.providers.fakes.http import FakeHttpServer

P = r"/compute/v1/projects/([^/]+)"


class FakeGcp:
    def __init__(self, *, page_size: int = 2) -> None:
        self.server = FakeHttpServer()
        self.instances: dict[tuple[str, str], dict[str, Any]] = {}  # (zone, name) -> instance json
        self.operations: dict[str, dict[str, Any]] = {}
        self.by_request_id: dict[str, str] = {}
        self.stockout: dict[str, int] = {}
        self.http_faults: list[tuple[int, str]] = []
        self.skus: list[dict[str, Any]] = []
        self.page_size = page_size
        self.insert_calls = 0
        self.refuse_filters = False  # answer 400 to any filter (as GCE does to syntax it does not accept)
        self._ids = itertools.count(1000)
        s = self.server
        s.route("POST", P + r"/zones/([^/]+)/instances", self._insert)
        s.route("GET", P + r"/zones/([^/]+)/instances/([^/]+)", self._get)
        s.route("DELETE", P + r"/zones/([^/]+)/instances/([^/]+)", self._delete)
        s.route("GET", P + r"/aggregated/instances", self._aggregated)
        s.route("POST", P + r"/zones/([^/]+)/operations/([^/]+)/wait", self._wait)
        s.route("GET", P + r"/zones/([^/]+)/operations/([^/]+)", self._op_get)
        s.route("GET", r"/v1/services/([^/]+)/skus", self._skus)

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> FakeGcp:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()

    # --- helpers -----------------------------------------------------------------------------------

    @staticmethod
    def _err(status: int, reason: str, message: str) -> tuple[int, Any]:
        return status, {"error": {"code": status, "message": message,
                                  "errors": [{"reason": reason, "message": message, "domain": "global"}]}}

    def _op(self, project: str, zone: str, kind: str, target: str,
            error: dict[str, Any] | None = None) -> dict[str, Any]:
        name = f"operation-{next(self._ids)}"
        op = {"kind": "compute#operation", "id": str(next(self._ids)), "name": name, "operationType": kind,
              "status": "RUNNING", "zone": f"{self.url}/compute/v1/projects/{project}/zones/{zone}",
              "targetLink": f"{self.url}/compute/v1/projects/{project}/zones/{zone}/instances/{target}",
              "selfLink": f"{self.url}/compute/v1/projects/{project}/zones/{zone}/operations/{name}",
              "_error": error, "_zone": zone, "_target": target, "_kind": kind}
        self.operations[name] = op
        return op

    @staticmethod
    def _public(op: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in op.items() if not k.startswith("_")}

    def _finish(self, op: dict[str, Any]) -> None:
        if op["status"] == "DONE":
            return
        op["status"] = "DONE"
        op["progress"] = 100
        key = (op["_zone"], op["_target"])
        if op["_error"]:
            op["error"] = op["_error"]
            op["httpErrorStatusCode"] = 503
            self.instances.pop(key, None)
        elif op["_kind"] == "insert" and key in self.instances:
            self.instances[key]["status"] = "RUNNING"
        elif op["_kind"] == "delete":
            self.instances.pop(key, None)

    # --- routes ------------------------------------------------------------------------------------

    def _insert(self, project: str, zone: str, *, query: dict, body: dict, headers: Any) -> Any:
        self.insert_calls += 1
        rid = (query.get("requestId") or [""])[0]
        if rid and rid in self.by_request_id:
            return 200, self._public(self.operations[self.by_request_id[rid]])
        if self.http_faults:
            status, reason = self.http_faults.pop(0)
            return self._err(status, reason, f"injected {reason}")
        name = body["name"]
        if (zone, name) in self.instances:
            return self._err(409, "alreadyExists",
                             f"The resource 'projects/{project}/zones/{zone}/instances/{name}' already exists")
        error = None
        if self.stockout.get(zone, 0) > 0:
            self.stockout[zone] -= 1
            error = {"errors": [{"code": "ZONE_RESOURCE_POOL_EXHAUSTED",
                                 "message": f"The zone '{zone}' does not have enough resources available"}]}
        inst = dict(body)
        inst.update({"id": str(next(self._ids)), "status": "PROVISIONING",
                     "zone": f"{self.url}/compute/v1/projects/{project}/zones/{zone}",
                     "creationTimestamp": datetime.now(UTC).isoformat(timespec="milliseconds"),
                     "selfLink": f"{self.url}/compute/v1/projects/{project}/zones/{zone}/instances/{name}"})
        for i, nic in enumerate(inst.get("networkInterfaces", [])):
            nic["networkIP"] = f"10.128.0.{len(self.instances) + 2}"
            nic["name"] = f"nic{i}"
        self.instances[(zone, name)] = inst
        op = self._op(project, zone, "insert", name, error)
        if rid:
            self.by_request_id[rid] = op["name"]
        return 200, self._public(op)

    def _get(self, project: str, zone: str, name: str, **_: Any) -> Any:
        inst = self.instances.get((zone, name))
        if inst is None:
            return self._err(404, "notFound",
                             f"The resource 'projects/{project}/zones/{zone}/instances/{name}' was not found")
        return 200, inst

    def _delete(self, project: str, zone: str, name: str, *, query: dict, **_: Any) -> Any:
        if (zone, name) not in self.instances:
            return self._err(404, "notFound", f"instance {name} was not found")
        self.instances[(zone, name)]["status"] = "STOPPING"
        return 200, self._public(self._op(project, zone, "delete", name))

    def _wait(self, project: str, zone: str, name: str, **_: Any) -> Any:
        op = self.operations.get(name)
        if op is None:
            return self._err(404, "notFound", f"operation {name} not found")
        self._finish(op)
        return 200, self._public(op)

    def _op_get(self, project: str, zone: str, name: str, **_: Any) -> Any:
        op = self.operations.get(name)
        return (200, self._public(op)) if op else self._err(404, "notFound", "no such operation")

    def _aggregated(self, project: str, *, query: dict, **_: Any) -> Any:
        flt = (query.get("filter") or [""])[0]
        want = re.fullmatch(r'\s*labels\.([a-z0-9_-]+)\s*=\s*"([^"]*)"\s*', flt) if flt else None
        if flt and (want is None or self.refuse_filters):
            return self._err(400, "invalid", f"unsupported filter {flt!r}")
        rows = sorted(((z, n), i) for (z, n), i in self.instances.items()
                      if want is None or i.get("labels", {}).get(want.group(1)) == want.group(2))
        start = int((query.get("pageToken") or ["0"])[0])
        page = rows[start:start + self.page_size]
        items: dict[str, Any] = {}
        for (zone, _), inst in page:
            items.setdefault(f"zones/{zone}", {"instances": []})["instances"].append(inst)
        out: dict[str, Any] = {"kind": "compute#instanceAggregatedList", "items": items}
        if start + self.page_size < len(rows):
            out["nextPageToken"] = str(start + self.page_size)
        return 200, out

    def _skus(self, service: str, *, query: dict, **_: Any) -> Any:
        start = int((query.get("pageToken") or ["0"])[0])
        page = self.skus[start:start + self.page_size]
        out: dict[str, Any] = {"skus": page}
        if start + self.page_size < len(self.skus):
            out["nextPageToken"] = str(start + self.page_size)
        return 200, out

    # --- inspection --------------------------------------------------------------------------------

    def live(self, cluster_label: str) -> list[dict[str, Any]]:
        with self.server.lock:
            return [i for i in self.instances.values() if i.get("labels", {}).get("orch-cluster") == cluster_label]


def sku(description: str, group: str, usage: str, usd: float, regions: list[str], unit: str = "h") -> dict[str, Any]:
    units = int(usd)
    return {
        "name": f"services/6F81-5844-456A/skus/{abs(hash((description, tuple(regions)))) % 10**12:012d}",
        "description": description,
        "category": {"serviceDisplayName": "Compute Engine", "resourceFamily": "Compute",
                     "resourceGroup": group, "usageType": usage},
        "serviceRegions": regions,
        "pricingInfo": [{"pricingExpression": {"usageUnit": unit, "tieredRates": [
            {"startUsageAmount": 0, "unitPrice": {"currencyCode": "USD", "units": str(units),
                                                  "nanos": round((usd - units) * 1e9)}}]}}],
    }
