"""Heartbeats: the node's state and progress plus system figures, on ``orch.node.<node>.hb``.

Role: ``Heartbeats`` publishes one ``Heartbeat`` every ``heartbeat_s`` on core NATS while connected
(the latest value matters, not history: nothing is buffered during an outage). ``SystemSampler``
samples what a heartbeat reports about the host. NVML (``pynvml``, from nvidia-ml-py) is used only
when importable and at least one GPU is present; otherwise ``gpus`` is empty and CPU/memory describe the
node (orchd then exports no GPU series for it: a missing reading is never reported as a value).
Sampling is cheap (no blocking interval): ``psutil.cpu_percent(None)`` measures since the last call.

The NVML binding is the hardware edge: ``SystemSampler(nvml=...)`` takes any object with pynvml's
functions (``nvmlInit``, ``nvmlDeviceGetCount``, ``nvmlDeviceGetHandleByIndex``,
``nvmlDeviceGetUtilizationRates``, ``nvmlDeviceGetMemoryInfo``, ``nvmlDeviceGetTemperature``,
``nvmlDeviceGetPowerUsage``, ``NVML_TEMPERATURE_GPU``, ``NVMLError``), as tests pass a stub.

Concurrency contract: one sampler per agent, called from the event loop every few seconds;
``Heartbeats.run`` is one task in the agent's task group.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio
import nats
import psutil
import structlog

from agent.generations import GenerationRunner
from wire import GpuStats, Heartbeat, JobId, NodeId, encode, subject_heartbeat

log = structlog.get_logger("agent")


class SystemSampler:
    def __init__(self, nvml: Any = None) -> None:
        """``nvml``: the NVML binding to read (default: ``pynvml`` when importable)."""
        psutil.cpu_percent(None)  # prime: the first call has no interval to measure
        self._nvml: Any = None
        self._handles: list[Any] = []
        try:
            nv = nvml if nvml is not None else _import_pynvml()
            nv.nvmlInit()
            n = nv.nvmlDeviceGetCount()
            if n > 0:
                self._nvml = nv
                self._handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        except Exception:  # any failure: no NVML library, no driver, or no GPU: a CPU-only node
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


def _import_pynvml() -> Any:
    import pynvml

    return pynvml


class Heartbeats:
    def __init__(self, node_id: NodeId, generations: GenerationRunner, fencing_token: Callable[[], int],
                 sampler: SystemSampler | None = None) -> None:
        self.node_id = node_id
        self.generations = generations
        self.fencing_token = fencing_token
        self.sampler = sampler or SystemSampler()
        self.seq = 0

    def next(self) -> Heartbeat:
        self.seq += 1
        g = self.generations.group
        cpu, mem = self.sampler.cpu_mem()
        return Heartbeat(
            node_id=self.node_id, seq=self.seq, ts=time.time(), state=self.generations.state,
            job_id=JobId(g.job_id) if g else None, generation=g.generation if g else 0,
            step=g.last_step if g else 0, loss=g.last_loss if g else None,
            tokens_per_s=g.tokens_per_s if g else None, step_time_s=g.step_time_s if g else None,
            cpu_pct=cpu, mem_pct=mem, gpus=self.sampler.gpus(), fencing_token=self.fencing_token())

    async def run(self, nc: nats.NATS, period_s: float) -> None:
        while True:
            if nc.is_connected:
                try:
                    await nc.publish(subject_heartbeat(self.node_id), encode(self.next()))
                except Exception as e:  # any failure: the next one goes out in a period
                    log.debug("heartbeat_failed", error=repr(e))
            await anyio.sleep(period_s)
