"""System figures for heartbeats: CPU/memory through psutil, GPUs through NVML when there are any.

Role: sample what a heartbeat reports about the host. NVML (``pynvml``, from nvidia-ml-py) is used only
when importable and at least one GPU is present; otherwise ``gpus`` is empty and CPU/memory describe the
node. Sampling is cheap (no blocking interval): ``psutil.cpu_percent(None)`` measures since the last call.

Concurrency contract: one sampler per agent, called from the event loop every few seconds.
"""

from __future__ import annotations

from typing import Any

import psutil

from wire import GpuStats


class SystemSampler:
    def __init__(self) -> None:
        psutil.cpu_percent(None)  # prime: the first call has no interval to measure
        self._nvml: Any = None
        self._handles: list[Any] = []
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
            n = pynvml.nvmlDeviceGetCount()
            if n > 0:
                self._nvml = pynvml
                self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        except Exception:  # noqa: BLE001 - no NVML library, no driver, or no GPU: CPU-only node
            self._nvml = None

    @property
    def has_gpus(self) -> bool:
        return bool(self._handles)

    def cpu_mem(self) -> tuple[float, float]:
        return float(psutil.cpu_percent(None)), float(psutil.virtual_memory().percent)

    def gpus(self) -> tuple[GpuStats, ...]:
        if self._nvml is None:
            return ()
        nv = self._nvml
        out = []
        for i, h in enumerate(self._handles):
            try:
                util = nv.nvmlDeviceGetUtilizationRates(h)
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                try:
                    temp: float | None = float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
                except nv.NVMLError:
                    temp = None
                try:
                    power: float | None = nv.nvmlDeviceGetPowerUsage(h) / 1000.0
                except nv.NVMLError:
                    power = None
                out.append(GpuStats(index=i, util_pct=float(util.gpu), mem_used_mib=mem.used / 2**20,
                                    mem_total_mib=mem.total / 2**20, temp_c=temp, power_w=power))
            except nv.NVMLError:
                continue
        return tuple(out)
