"""Process groups with short timeouts, the device mesh, and FSDP2 / DDP wrapping.

Role: the distributed plumbing of the trainer. Works from the torch standard variables (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) that the agent, torchrun or any launcher sets; a missing
RANK means a single process (world size 1, a loopback store on a free port).

Collectives run with ORCH_COLLECTIVE_TIMEOUT_S, so a vanished peer surfaces as an exception (mapped to
EXIT_PEER_LOST by the caller) instead of a hang. On GPU the default group is "cpu:gloo,cuda:nccl" (DCP
async save needs a CPU backend). Checkpoint collectives use two gloo groups of their own (timeout
max(ORCH_COLLECTIVE_TIMEOUT_S, 300 s)): one for background (async) saves, one for blocking saves, so
a thread-based save still running in the background never interleaves with training collectives or with
an emergency save on the same communicator.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer import contract


@dataclass(frozen=True, slots=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh
    ckpt_group: dist.ProcessGroup  # gloo: async (background) saves and loading
    save_group: dist.ProcessGroup  # gloo: blocking saves and commits (never shared with a background save)

    @property
    def is_gpu(self) -> bool:
        return self.device.type == "cuda"


CKPT_COLLECTIVE_TIMEOUT_S = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collective_timeout_s() -> float:
    return float(os.environ.get(contract.ENV_COLLECTIVE_TIMEOUT_S) or contract.DEFAULT_COLLECTIVE_TIMEOUT_S)


def init(device: str = "auto") -> DistInfo:
    """Initialise the default process group (idempotent) and return this process's place in it."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        backend = "cpu:gloo,cuda:nccl"
    else:
        dev = torch.device("cpu")
        backend = "gloo"
    timeout = dt.timedelta(seconds=collective_timeout_s())
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=ws, timeout=timeout)
    mesh = init_device_mesh(dev.type, (ws,))
    # Saves wait for the slowest rank's writes: a longer timeout than the training collectives', so a
    # slow shared filesystem is not mistaken for a dead peer (the agent can still kill the generation).
    ckpt_timeout = dt.timedelta(seconds=max(collective_timeout_s(), CKPT_COLLECTIVE_TIMEOUT_S))
    ckpt_group = dist.new_group(backend="gloo", timeout=ckpt_timeout)
    save_group = dist.new_group(backend="gloo", timeout=ckpt_timeout)
    return DistInfo(rank, ws, local_rank, dev, mesh, ckpt_group, save_group)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap_fsdp(model: nn.Module, info: DistInfo, *, bf16: bool, cpu_offload: bool = False,
              blocks: str | list[nn.Module] = "blocks") -> nn.Module:
    """FSDP2: ``fully_shard`` every transformer block (the children of attribute ``blocks``, or the given
    modules), then the root. bf16 params with fp32 gradient
    reduction on GPU (reduce_dtype set explicitly: its default changes in torch 2.15); fp32 on CPU."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict = {"mesh": info.mesh}
    if bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in getattr(model, blocks) if isinstance(blocks, str) else blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def wrap_ddp(model: nn.Module, info: DistInfo) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[info.local_rank] if info.is_gpu else None)


def is_peer_lost(exc: BaseException) -> bool:
    """A collective failed because a peer vanished or timed out (gloo/NCCL wording varies by version)."""
    if isinstance(exc, (getattr(dist, "DistBackendError", ()), getattr(dist, "DistNetworkError", ()))):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(s in text for s in _PEER_LOST_WORDS)


def peer_lost_line(exc: BaseException) -> str:
    """One line for an expected failure: ``peer_lost: <type>: <the error's first line>`` (gloo/NCCL
    messages carry a C++ backtrace after it, which says nothing about which peer left or why)."""
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    return f"peer_lost: {type(exc).__name__}: {first}"[:300]


_PEER_LOST_WORDS = ("connection closed by peer", "timed out", "timeout", "connection reset", "broken pipe", "socket",
                    "gloo", "nccl")
