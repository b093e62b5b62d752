"""The ranks' side of the replicas: copy the shard to two holders every k steps, get it back at a resume.

Role: used by trainer.lib.Session when the launcher set ORCH_REPLICA_HOLDER, ORCH_REPLICA_KEY and
ORCH_REPLICA_EVERY (the agent does for a job with ``[checkpoint] replica_every``). At start every rank
learns every rank's holder (one ``all_gather_object``); rank r's buddy is the holder of the next node
(rank ``r + LOCAL_WORLD_SIZE``, around the ring). After every k-th step the training thread copies the
state into reused host buffers (``snapshot.Stager``) and a background thread serializes it and puts it
into this node's holder and the buddy's. The next replica waits for the previous one (never two in
flight, and every rank replicates the same steps): its wait is the only time replicas take from the step.

Resume (ORCH_REPLICA_STEP = S, orchd's choice): each rank gets its shard of step S from its own holder,
else from any other rank's holder, checksum verified; the ranks agree (one all-reduce) that every one
has it, then each restores in place. When any rank could not, every rank exits EXIT_REPLICA_UNUSABLE
with the reason, and orchd chooses again (an older complete replica or the durable checkpoint).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import crc32c
import torch
import torch.distributed as dist

from trainer import contract
from trainer.dist import DistInfo
from trainer.replicas import protocol as p
from trainer.replicas import snapshot
from trainer.replicas.client import HolderClient


class ReplicaUnusable(Exception):
    """The replica step orchd chose cannot be restored on some rank (the reason is the message)."""


@dataclass
class ReplicaStats:
    sent: int = 0
    failed: int = 0
    bytes: int = 0
    wait_s: float = 0.0  # training thread blocked on the previous replica
    capture_s: float = 0.0  # training thread copying the state
    last_step: int = 0
    errors: list[str] = field(default_factory=list)


class Replicator:
    def __init__(self, info: DistInfo, holder: str, key: bytes, every: int, job: str, generation: int) -> None:
        self.info, self.key, self.every, self.job, self.generation = info, key, every, job, generation
        self.holder = holder
        local_ws = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        self.holders = [holder]
        if info.world_size > 1:
            out: list[Any] = [None] * info.world_size
            dist.all_gather_object(out, holder, group=info.ckpt_group)
            self.holders = [str(x) for x in out]
        buddy_rank = (info.rank + local_ws) % info.world_size
        buddy = self.holders[buddy_rank]
        self.targets = [holder] + ([buddy] if buddy != holder else [])
        self.stager = snapshot.Stager()
        self.pool = cf.ThreadPoolExecutor(1, thread_name_prefix="replica")
        self.pending: cf.Future[None] | None = None
        self.clients: dict[str, HolderClient] = {}
        self.stats = ReplicaStats()

    @classmethod
    def from_env(cls, info: DistInfo) -> Replicator | None:
        holder, key, every = (os.environ.get(p.ENV_HOLDER, ""), os.environ.get(p.ENV_KEY, ""),
                              int(os.environ.get(p.ENV_EVERY, "0") or 0))
        if not holder or not key or every <= 0:
            return None
        return cls(info, holder, bytes.fromhex(key), every, os.environ.get(contract.ENV_JOB_ID, "job"),
                   int(os.environ.get(contract.ENV_GENERATION, "0") or 0))

    def _client(self, addr: str) -> HolderClient:
        c = self.clients.get(addr)
        if c is None:
            c = self.clients[addr] = HolderClient(addr, self.job, self.generation, self.key)
        return c

    # --- copies ------------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def after_step(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                   extra: Callable[[], dict[str, Any]]) -> None:
        """After step ``step`` (its optimizer step done): start the replica of this step when it is due."""
        if not self.due(step):
            return
        t0 = time.monotonic()
        if self.pending is not None:
            self.pending.result()  # the previous replica first: the same steps on every rank, one in flight
        t1 = time.monotonic()
        captured = self.stager.capture(model, optimizer, {**extra(), "step": step,
                                                           "world_size": self.info.world_size,
                                                           "rank": self.info.rank})
        t2 = time.monotonic()
        self.stats.wait_s += t1 - t0
        self.stats.capture_s += t2 - t1
        self.pending = self.pool.submit(self._send, step, captured)

    def _send(self, step: int, captured: dict[str, Any]) -> None:
        body = snapshot.encode(captured)
        crc = crc32c.crc32c(body)
        for addr in self.targets:
            try:
                self._client(addr).put(self.info.rank, step, self.info.world_size, body, crc)
                self.stats.bytes += len(body)
            except (OSError, p.ProtocolError) as e:  # a buddy gone mid-copy: this replica is absent there
                self.stats.failed += 1
                self.stats.errors = (self.stats.errors + [f"{addr}: {type(e).__name__}: {e}"])[-5:]
                bad = self.clients.pop(addr, None)
                if bad is not None:
                    bad.close()
        self.stats.sent += 1
        self.stats.last_step = step

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for c in self.clients.values():
            c.close()

    # --- resume ------------------------------------------------------------------------------------

    def _fetch(self, step: int) -> tuple[bytes | None, str]:
        """This rank's replica of ``step``: its own holder first, then the others'."""
        why = []
        order = [self.holder] + [h for h in dict.fromkeys(self.holders) if h != self.holder]
        for addr in order:
            try:
                with HolderClient(addr, self.job, self.generation, self.key) as c:
                    got = c.get(self.info.rank, step)
            except (OSError, p.ProtocolError) as e:
                why.append(f"{addr}: {type(e).__name__}: {e}"[:160])
                continue
            if got is None:
                why.append(f"{addr}: absent")
            elif got[1] != self.info.world_size:
                why.append(f"{addr}: world size {got[1]}")
            else:
                return got[0], addr
        return None, "; ".join(why)

    def restore(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """Collective: every rank restores its shard of ``step`` or every rank raises ReplicaUnusable."""
        t0 = time.monotonic()
        body, source = self._fetch(step)
        extra: dict[str, Any] | None = None
        if body is not None:
            try:
                extra = snapshot.restore(body, model, optimizer)
                if int(extra["step"]) != step or int(extra["rank"]) != self.info.rank:
                    raise ValueError(f"it names step {extra['step']} rank {extra['rank']}")
            except Exception as e:  # another model, another layout, undecodable: unusable, never half-used
                extra, source = None, f"{source}: {type(e).__name__}: {e}"
        failed = torch.tensor([0.0 if extra is not None else 1.0], dtype=torch.float64)
        if self.info.world_size > 1:
            dist.all_reduce(failed, group=self.info.ckpt_group)
        if extra is None:
            raise ReplicaUnusable(f"rank {self.info.rank} step {step}: {source}"[:280])
        if failed.item() > 0:
            raise ReplicaUnusable(f"step {step}: another rank's replica is unusable")
        assert body is not None  # extra came from it
        local = source == self.holder
        print(f"replica_resumed step={step} rank={self.info.rank} source={'local' if local else source} "
              f"bytes={len(body)} load_s={time.monotonic() - t0:.3f}", flush=True)
        sys.stdout.flush()
        return extra
