"""GCP VM prices from Cloud Billing Catalog SKUs: pure parsing and composition (no I/O).

GCE bills a VM by component: vCPUs x the family's core SKU + GiB x its RAM SKU + GPUs x the GPU SKU.
Spot SKUs have usage type "Preemptible" (descriptions start with "Spot Preemptible "); on-demand
"OnDemand"; commitments and other usage types are ignored. A (region, machine type) whose components
are not all found gets no price for that market: never a partial (too low) price.

The SKU description names below are those of the public catalog (e.g. "A2 Instance Core running in
Americas", "Nvidia Tesla A100 GPU running in Americas"); a renamed SKU shows up as a missing quote and
a ``gcp_price_component_missing`` log line, not as a wrong price.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from typing import Any

from providers import catalog

CLOUD = "gcp"
COMPUTE_SERVICE = "services/6F81-5844-456A"

GPU_SKU_NAMES: dict[str, str] = {
    "nvidia-tesla-t4": "Nvidia Tesla T4 GPU",
    "nvidia-tesla-v100": "Nvidia Tesla V100 GPU",
    "nvidia-tesla-a100": "Nvidia Tesla A100 GPU",
    "nvidia-a100-80gb": "Nvidia Tesla A100 80GB GPU",
    "nvidia-l4": "Nvidia L4 GPU",
    "nvidia-h100-80gb": "Nvidia H100 80GB GPU",
}
"""Accelerator type -> the GPU's name in SKU descriptions ("<name> running in <geo>")."""
FAMILY_SKU_NAMES: dict[str, tuple[str, str]] = {
    "n1": ("N1 Predefined Instance Core", "N1 Predefined Instance Ram"),
    "a2": ("A2 Instance Core", "A2 Instance Ram"),
    "a3": ("A3 Instance Core", "A3 Instance Ram"),
    "g2": ("G2 Instance Core", "G2 Instance Ram"),
}
"""Machine family -> the names of its vCPU and RAM SKUs."""

UnitPrices = dict[tuple[str, str, str], float]  # (region, component, "spot"|"on_demand") -> $ per unit
PriceTable = dict[tuple[str, str], dict[str, float]]  # (region, machine type) -> {"spot": $/h, "on_demand": $/h}


def unit_prices(skus: Iterable[Any], regions: set[str]) -> UnitPrices:
    """Component unit prices from billing_v1 ``Sku`` messages, for these regions."""
    unit: UnitPrices = {}
    for s in skus:
        usage = s.category.usage_type
        if usage not in ("OnDemand", "Preemptible") or s.category.resource_family != "Compute":
            continue
        if not s.pricing_info or not s.pricing_info[0].pricing_expression.tiered_rates:
            continue
        comp = re.sub(r"^(Spot Preemptible|Preemptible) ", "", s.description).split(" running in ")[0]
        money = s.pricing_info[0].pricing_expression.tiered_rates[-1].unit_price
        usd = int(money.units) + money.nanos / 1e9
        market = "spot" if usage == "Preemptible" else "on_demand"
        for r in s.service_regions:
            if r in regions:
                unit[(r, comp, market)] = usd
    return unit


def compose(unit: UnitPrices, regions: set[str], machine_types: Iterable[str],
            accelerator: Callable[[str], tuple[str, int] | None],
            on_missing: Callable[[str, str, str], None] | None = None) -> PriceTable:
    """VM prices from component prices. ``accelerator(mt)``: attached GPUs (n1), None for built-in ones."""
    out: PriceTable = {}
    for region in sorted(regions):
        for mt in sorted(set(machine_types)):
            spec = catalog.spec(CLOUD, mt)
            if spec is None:
                continue
            acc = accelerator(mt)
            acc_type, gpus = acc if acc is not None else (spec.accelerator, spec.gpus)
            core, ram = FAMILY_SKU_NAMES.get(mt.split("-")[0], ("", ""))
            gpu = GPU_SKU_NAMES.get(acc_type, "")
            row = {}
            for market in ("spot", "on_demand"):
                c, r = unit.get((region, core, market)), unit.get((region, ram, market))
                g = unit.get((region, gpu, market)) if gpus else 0.0
                if c is None or r is None or g is None:
                    if on_missing is not None:
                        on_missing(region, mt, market)
                    continue
                row[market] = round(spec.vcpus * c + spec.mem_gib * r + gpus * g, 6)
            if row:
                out[(region, mt)] = row
    return out


def read_price_file(path: str) -> PriceTable:
    """``{region: {machine_type: {"spot": x, "on_demand": y}}}`` as a price table."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return {(region, mt): {k: float(v) for k, v in row.items()} for region, types in data.items()
            for mt, row in types.items()}
