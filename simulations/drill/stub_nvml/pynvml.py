"""A stub of the ``pynvml`` module (nvidia-ml-py) for the drill's agents on CPU hosts: the hardware edge.

The drill puts this directory first on the agents' ``PYTHONPATH`` (``[providers.local] agent_env``), so
``agent.heartbeat.SystemSampler`` imports it instead of the real binding and reads one "GPU" whose
readings are fixed: utilisation 50 %, 60 degrees C, 1 of 16 GiB used, 100 W. They are not measurements;
they exercise the path NVML reading -> heartbeat -> orchd's gauges -> Prometheus -> dashboard, and the
drill's JSON says so (``gpu_readings``). Only the functions ``SystemSampler`` calls are here.
"""

from __future__ import annotations

from types import SimpleNamespace

NVML_TEMPERATURE_GPU = 0
UTILIZATION_PCT = 50
TEMPERATURE_C = 60
MEMORY_TOTAL = 16 * 2**30
MEMORY_USED = 2**30
POWER_MW = 100_000


class NVMLError(Exception):
    """pynvml's base error (never raised by the stub, caught by the sampler)."""


def nvmlInit() -> None:  # noqa: N802 - pynvml's names
    return None


def nvmlDeviceGetCount() -> int:  # noqa: N802
    return 1


def nvmlDeviceGetHandleByIndex(index: int) -> int:  # noqa: N802
    if index != 0:
        raise NVMLError(f"no GPU {index}")
    return index


def nvmlDeviceGetUtilizationRates(handle: int) -> SimpleNamespace:  # noqa: N802
    return SimpleNamespace(gpu=UTILIZATION_PCT, memory=UTILIZATION_PCT)


def nvmlDeviceGetMemoryInfo(handle: int) -> SimpleNamespace:  # noqa: N802
    return SimpleNamespace(total=MEMORY_TOTAL, used=MEMORY_USED, free=MEMORY_TOTAL - MEMORY_USED)


def nvmlDeviceGetTemperature(handle: int, sensor: int) -> int:  # noqa: N802
    return TEMPERATURE_C


def nvmlDeviceGetPowerUsage(handle: int) -> int:  # noqa: N802
    return POWER_MW
