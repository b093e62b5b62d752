"""Bundled instance-type catalog: GPU model and count, vCPUs, memory, on-demand list price.

Role: the static facts the providers need and the clouds' price APIs do not give directly: which GPU an
instance type carries (AWS/Azure price APIs know nothing of GPUs), its shape (GCP prices machines by
component: GPU + vCPU + RAM SKUs), and an on-demand reference price where no API is asked (AWS: the
Pricing API needs extra permissions and returns a multi-MB document per query).

Source: public on-demand Linux list prices from the clouds' pricing pages (AWS us-east-1, GCP
us-central1, Azure eastus) as of 2025, typed in by hand; prices differ by region by up to ~30%, and
they change (AWS cut P4/P5 prices in June 2025; the figure here is after the cut). Treat them as a
reference that a config ``on_demand_usd_h`` table overrides, not as a bill. Pure data, no I/O.

GPU names are canonical across clouds (``A100`` is the 40 GB part, ``A100-80GB`` the 80 GB one) so a
job asking for ``gpu_type = "A100"`` matches AWS p4d, GCP a2-highgpu and Azure ND96asr_v4 alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    cloud: str
    instance_type: str
    gpu_type: str
    gpus: int
    vcpus: int
    mem_gib: float
    on_demand_usd_h: float
    accelerator: str = ""
    """GCP accelerator type name (e.g. ``nvidia-tesla-a100``); built into a2/a3/g2 machine types."""


_S = InstanceSpec
_SPECS: Final[tuple[InstanceSpec, ...]] = (
    # --- AWS, us-east-1 ---------------------------------------------------------------------------
    _S("aws", "p3.2xlarge", "V100", 1, 8, 61, 3.06),
    _S("aws", "p3.8xlarge", "V100", 4, 32, 244, 12.24),
    _S("aws", "p3.16xlarge", "V100", 8, 64, 488, 24.48),
    _S("aws", "p4d.24xlarge", "A100", 8, 96, 1152, 21.96),
    _S("aws", "p4de.24xlarge", "A100-80GB", 8, 96, 1152, 27.45),
    _S("aws", "p5.48xlarge", "H100", 8, 192, 2048, 55.04),
    _S("aws", "g4dn.xlarge", "T4", 1, 4, 16, 0.526),
    _S("aws", "g4dn.12xlarge", "T4", 4, 48, 192, 3.912),
    _S("aws", "g5.xlarge", "A10G", 1, 4, 16, 1.006),
    _S("aws", "g5.2xlarge", "A10G", 1, 8, 32, 1.212),
    _S("aws", "g5.12xlarge", "A10G", 4, 48, 192, 5.672),
    _S("aws", "g5.48xlarge", "A10G", 8, 192, 768, 16.288),
    _S("aws", "g6.xlarge", "L4", 1, 4, 16, 0.805),
    _S("aws", "g6.12xlarge", "L4", 4, 48, 192, 4.602),
    _S("aws", "g6e.xlarge", "L40S", 1, 4, 32, 1.861),
    # --- GCP, us-central1 -------------------------------------------------------------------------
    _S("gcp", "a2-highgpu-1g", "A100", 1, 12, 85, 3.673, "nvidia-tesla-a100"),
    _S("gcp", "a2-highgpu-2g", "A100", 2, 24, 170, 7.347, "nvidia-tesla-a100"),
    _S("gcp", "a2-highgpu-4g", "A100", 4, 48, 340, 14.694, "nvidia-tesla-a100"),
    _S("gcp", "a2-highgpu-8g", "A100", 8, 96, 680, 29.387, "nvidia-tesla-a100"),
    _S("gcp", "a2-ultragpu-1g", "A100-80GB", 1, 12, 170, 5.069, "nvidia-a100-80gb"),
    _S("gcp", "a2-ultragpu-8g", "A100-80GB", 8, 96, 1360, 40.550, "nvidia-a100-80gb"),
    _S("gcp", "a3-highgpu-8g", "H100", 8, 208, 1872, 88.490, "nvidia-h100-80gb"),
    _S("gcp", "g2-standard-4", "L4", 1, 4, 16, 0.707, "nvidia-l4"),
    _S("gcp", "g2-standard-8", "L4", 1, 8, 32, 0.854, "nvidia-l4"),
    _S("gcp", "g2-standard-24", "L4", 2, 24, 96, 2.000, "nvidia-l4"),
    # N1 carries attached GPUs: the shape here is the VM alone; the provider's config names the GPU.
    _S("gcp", "n1-standard-8", "T4", 1, 8, 30, 0.730, "nvidia-tesla-t4"),
    # --- Azure, eastus ------------------------------------------------------------------------------
    _S("azure", "Standard_NC4as_T4_v3", "T4", 1, 4, 28, 0.526),
    _S("azure", "Standard_NC6s_v3", "V100", 1, 6, 112, 3.06),
    _S("azure", "Standard_NC24ads_A100_v4", "A100-80GB", 1, 24, 220, 3.673),
    _S("azure", "Standard_NC48ads_A100_v4", "A100-80GB", 2, 48, 440, 7.346),
    _S("azure", "Standard_NC96ads_A100_v4", "A100-80GB", 4, 96, 880, 14.692),
    _S("azure", "Standard_ND96asr_v4", "A100", 8, 96, 900, 27.197),
    _S("azure", "Standard_ND96isr_H100_v5", "H100", 8, 96, 1900, 98.32),
    _S("azure", "Standard_NV36ads_A10_v5", "A10", 1, 36, 440, 3.20),
)

CATALOG: Final[dict[tuple[str, str], InstanceSpec]] = {(s.cloud, s.instance_type): s for s in _SPECS}


def spec(cloud: str, instance_type: str) -> InstanceSpec | None:
    return CATALOG.get((cloud, instance_type))


def gpu_of(cloud: str, instance_type: str) -> tuple[str, int]:
    """(gpu_type, gpus per node); ("unknown", 0) for a type the catalog does not know."""
    s = CATALOG.get((cloud, instance_type))
    return (s.gpu_type, s.gpus) if s else ("unknown", 0)


def on_demand_usd_h(cloud: str, instance_type: str, overrides: dict[str, float] | None = None) -> float | None:
    """On-demand price: the config override if any, else the bundled list price, else None."""
    if overrides and instance_type in overrides:
        return overrides[instance_type]
    s = CATALOG.get((cloud, instance_type))
    return s.on_demand_usd_h if s else None
