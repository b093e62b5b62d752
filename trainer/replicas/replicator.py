"""The ranks' side of the replicas: copy the shard to two holders every k steps, get it back at a resume.

Role: used by trainer.lib.Session when the launcher set ORCH_REPLICA_HOLDER, ORCH_REPLICA_KEY and
ORCH_REPLICA_EVERY (the agent does for a job with ``[checkpoint] replica_every``). At start every rank
learns every rank's holder (one ``all_gather_object``); rank r's buddy is the holder of the node orchd
named (ORCH_REPLICA_BUDDY: another zone when the job spans zones), else of the next node around the ring,
the rank of the same local index there.

The copy, off the training's critical path: when a replica is due (k steps after the previous one) the
training thread copies the state into the reused staging buffer (``snapshot.Stager.capture``: one
``copy_`` per tensor, a few hundred microseconds for a small model) and a background thread pickles the
small rest, checksums the buffer and sends it to this node's holder and the buddy's (CRC32C and the
sockets run in C without the GIL). The training thread never waits for a copy: the per-step agreement
(trainer.emergency.agree, which every rank runs anyway) carries whether any rank's previous copy is still
in flight; if so, every rank skips this step's copy alike (``skipped``) and takes the next step's. So the
steps replicated are the same on every rank, k adapts to the copy time, and the loss bound is over the
steps actually replicated: ``lag`` - the step in flight minus the newest step every rank had finished
copying before it began - is k + 1 when each copy ends within a step; each StepReport carries it
(``replica_lag``) and orchd takes the largest a generation saw into its work at risk
(orchestrator/core/replicas.py ``max_lost_steps``). The same agreement certifies a step to the holders
(every rank's copy is over), which then drop what is older: at most two versions per rank there.

Resume (ORCH_REPLICA_STEP = S, orchd's choice): the ranks read the holders' inventories and agree on the
world size whose replicas of S are complete (this one's when it can, else the largest other one). At the
same world size each rank gets its shard of step S from its own holder, else from any other rank's
holder, checksum verified; at another size (the survivors of a lost node) each rank reads every old
shard, one at a time, and takes its slice of each (trainer.replicas.reshard). The ranks agree (one
all-reduce) that every one has restored. When any rank could not, every rank exits EXIT_REPLICA_UNUSABLE
with the reason, and orchd chooses again (an older complete replica or the durable checkpoint).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import crc32c
import torch
import torch.distributed as dist

from trainer import contract
from trainer.dist import DistInfo
from trainer.replicas import protocol as p
from trainer.replicas import reshard, snapshot
from trainer.replicas.client import HolderClient


class ReplicaUnusable(Exception):
    """The replica step orchd chose cannot be restored on some rank (the reason is the message)."""


@dataclass
class ReplicaStats:
    sent: int = 0  # replicas started
    skipped: int = 0  # due, but some rank's previous copy was still in flight: every rank skipped it
    failed: int = 0  # copies to a holder that failed (that holder lacks the replica)
    bytes: int = 0
    capture_s: float = 0.0  # training thread copying the state into the staging buffer
    send_s: float = 0.0  # background thread: pickle, checksum, sends
    max_lag: int = 0  # the most steps a loss would have sent back (the step in flight included)
    last_step: int = 0
    certified: int = 0
    errors: list[str] = field(default_factory=list)


def buddy_rank(rank: int, world_size: int, local_world_size: int, buddy_node: int | None) -> int:
    """The rank whose holder keeps ``rank``'s second copy: the same local rank on ``buddy_node`` (orchd's
    choice), else on the next node around the ring."""
    nodes = max(world_size // max(local_world_size, 1), 1)
    node, local = divmod(rank, max(local_world_size, 1))
    if buddy_node is None or not 0 <= buddy_node < nodes or buddy_node == node:
        buddy_node = (node + 1) % nodes
    return (buddy_node * local_world_size + local) % world_size


class Replicator:
    def __init__(self, info: DistInfo, holder: str, key: bytes, every: int, job: str, generation: int,
                 buddy_node: int | None = None) -> None:
        self.info, self.key, self.every, self.job, self.generation = info, key, every, job, generation
        self.holder = holder
        local_ws = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        self.holders = [holder]
        if info.world_size > 1:
            out: list[Any] = [None] * info.world_size
            dist.all_gather_object(out, holder, group=info.ckpt_group)
            self.holders = [str(x) for x in out]
        buddy = self.holders[buddy_rank(info.rank, info.world_size, local_ws, buddy_node)]
        self.targets = [holder] + ([buddy] if buddy != holder else [])
        self.stager = snapshot.Stager()
        self.pool = cf.ThreadPoolExecutor(1, thread_name_prefix="replica")
        self.pending: cf.Future[None] | None = None
        self.clients: dict[str, HolderClient] = {}
        self.stats = ReplicaStats()
        self.started = 0  # the newest step whose replica was started (or the step the generation resumed after)
        self.certified = 0  # the newest such step every rank had finished copying, at the last agreement

    @classmethod
    def from_env(cls, info: DistInfo) -> Replicator | None:
        holder, key, every = (os.environ.get(p.ENV_HOLDER, ""), os.environ.get(p.ENV_KEY, ""),
                              int(os.environ.get(p.ENV_EVERY, "0") or 0))
        if not holder or not key or every <= 0:
            return None
        buddy = os.environ.get(p.ENV_BUDDY, "")
        return cls(info, holder, bytes.fromhex(key), every, os.environ.get(contract.ENV_JOB_ID, "job"),
                   int(os.environ.get(contract.ENV_GENERATION, "0") or 0),
                   int(buddy) if buddy.strip().isdigit() else None)

    def _client(self, addr: str) -> HolderClient:
        c = self.clients.get(addr)
        if c is None:
            c = self.clients[addr] = HolderClient(addr, self.job, self.generation, self.key)
        return c

    # --- copies ------------------------------------------------------------------------------------

    def begin(self, resumed_after: int) -> None:
        """The generation resumed after ``resumed_after`` (0: a fresh start): that state is recoverable from
        where it came from, so it is the first certified step and the lag counts from it."""
        self.started = self.certified = resumed_after

    def busy(self) -> bool:
        """This rank's previous copy is still in flight (the per-step agreement sums it over the ranks)."""
        return self.pending is not None and not self.pending.done()

    def lag(self, step: int) -> int:
        """Steps a loss during ``step`` would send back: ``step`` minus the newest step certified before it."""
        return step - self.certified

    def after_step(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                   extra: Callable[[], dict[str, Any]], *, all_done: bool, last: bool = False) -> None:
        """After step ``step`` (its optimizer step done). ``all_done``: the step's agreement said no rank's
        copy was in flight (agreed, so every rank decides alike). Certifies the previous replica, then starts
        this step's when it is due (skips it when a copy was in flight); ``last``: certify only."""
        self.stats.max_lag = max(self.stats.max_lag, self.lag(step))
        if all_done and self.started > self.certified:
            self.certified = self.stats.certified = self.started
            certify = self.certified
        else:
            certify = 0
        due = not last and step - self.started >= self.every
        if due and not all_done:
            self.stats.skipped += 1
            due = False
        if due:
            t0 = time.monotonic()
            snap = self.stager.capture(step, model, optimizer, {**extra(), "step": step,
                                                                "world_size": self.info.world_size,
                                                                "rank": self.info.rank})
            self.stats.capture_s += time.monotonic() - t0
            self.started = step
            self.pending = self.pool.submit(self._send, snap, certify)
        elif certify:
            self.pending = self.pool.submit(self._commit, certify)

    def _each_target(self, what: Callable[[HolderClient], int]) -> None:
        for addr in self.targets:
            try:
                self.stats.bytes += what(self._client(addr))
            except (OSError, p.ProtocolError) as e:  # a buddy gone mid-copy: this replica is absent there
                self.stats.failed += 1
                self.stats.errors = (self.stats.errors + [f"{addr}: {type(e).__name__}: {e}"])[-5:]
                bad = self.clients.pop(addr, None)
                if bad is not None:
                    bad.close()

    def _send(self, snap: snapshot.Snapshot, certified: int) -> None:
        t0 = time.monotonic()
        parts = snap.parts()
        crc = 0
        for part in parts:
            crc = crc32c.crc32c(part, crc)
        n = sum(len(x) for x in parts)

        def put(c: HolderClient) -> int:
            c.put(self.info.rank, snap.step, self.info.world_size, parts, crc, certified=certified)
            return n

        self._each_target(put)
        self.stats.sent += 1
        self.stats.last_step = snap.step
        self.stats.send_s += time.monotonic() - t0

    def _commit(self, step: int) -> None:
        def commit(c: HolderClient) -> int:
            c.commit(step, self.info.world_size)
            return 0  # no replica bytes sent

        self._each_target(commit)

    def summary(self) -> str:
        """One log line: what the replicas did in this generation (the benchmark and the tests read it)."""
        s = asdict(self.stats)
        s.pop("errors")
        return "replica_stats " + " ".join(f"{k}={round(v, 4) if isinstance(v, float) else v}" for k, v in s.items()) \
            + f" every={self.every} region_bytes={self.stager.nbytes} rank={self.info.rank}"

    def close(self, wait_s: float = 0.0) -> None:
        """Stop; ``wait_s``: first let the copy or commit in flight finish for up to that long (after the last
        step, so that the holders keep one version of each rank, not two)."""
        if wait_s > 0 and self.pending is not None:
            with contextlib.suppress(cf.TimeoutError):
                self.pending.result(timeout=wait_s)
        self.pool.shutdown(wait=False, cancel_futures=True)
        for c in self.clients.values():
            c.close()

    # --- resume ------------------------------------------------------------------------------------

    def _world_of(self, step: int) -> tuple[int, str]:
        """The world size whose replicas of ``step`` are complete on the reachable holders: this world's when
        complete, else the largest other complete one (restored by resharding); 0 and why when none."""
        ranks: dict[int, set[int]] = {}
        why = []
        for addr in dict.fromkeys(self.holders):
            try:
                with HolderClient(addr, self.job, self.generation, self.key) as c:
                    inv = c.inventory()
            except (OSError, p.ProtocolError) as e:
                why.append(f"{addr}: {type(e).__name__}: {e}"[:120])
                continue
            for rank, s, ws, _gen in inv:
                if s == step and 0 <= rank < ws:
                    ranks.setdefault(ws, set()).add(rank)
        complete = sorted((ws for ws, r in ranks.items() if len(r) == ws), reverse=True)
        if not complete:
            found = {w: sorted(r) for w, r in ranks.items()}
            return 0, "; ".join(why) or f"no complete set of replicas of step {step} (world size: ranks {found})"
        return (self.info.world_size if self.info.world_size in complete else complete[0]), ""

    def _fetch(self, rank: int, step: int, world_size: int) -> tuple[bytes | None, str]:
        """Rank ``rank``'s replica of ``step`` made at ``world_size``: this rank's own holder first, then the
        others' (a checksum mismatch, an absent or unreachable holder: the next one)."""
        why = []
        order = [self.holder] + [h for h in dict.fromkeys(self.holders) if h != self.holder]
        for addr in order:
            try:
                with HolderClient(addr, self.job, self.generation, self.key) as c:
                    got = c.get(rank, step)
            except (OSError, p.ProtocolError) as e:
                why.append(f"{addr}: {type(e).__name__}: {e}"[:160])
                continue
            if got is None:
                why.append(f"{addr}: absent")
            elif got[1] != world_size:
                why.append(f"{addr}: world size {got[1]}")
            else:
                return got[0], addr
        return None, "; ".join(why)

    def _agree(self, value: int) -> bool:
        """Every rank holds the same ``value`` (> 0)."""
        t = torch.tensor([value, -value], dtype=torch.float64)
        if self.info.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.info.ckpt_group)
        return value > 0 and t[0].item() == value and -t[1].item() == value

    def _load_own(self, step: int, model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any] | None, str, int]:
        body, source = self._fetch(self.info.rank, step, self.info.world_size)
        if body is None:
            return None, source, 0
        extra = snapshot.restore(body, model, optimizer)
        if int(extra["step"]) != step or int(extra["rank"]) != self.info.rank:
            raise ValueError(f"it names step {extra['step']} rank {extra['rank']}")
        return extra, ("local" if source == self.holder else source), len(body)

    def _load_resharded(self, step: int, saved_ws: int, model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any] | None, str, int]:
        """Every old rank's replica, one at a time, sliced into this rank's blocks (trainer.replicas.reshard)."""
        r = reshard.Resharder(model, optimizer, self.info.rank)
        nbytes, sources = 0, []
        for old in range(saved_ws):
            body, source = self._fetch(old, step, saved_ws)
            if body is None:
                return None, f"old rank {old}: {source}", nbytes
            saved = snapshot.decode(body)
            got = saved["extra"]
            if (int(got["step"]), int(got["rank"]), int(got["world_size"])) != (step, old, saved_ws):
                raise ValueError(f"it names step {got['step']} rank {got['rank']} world size {got['world_size']}")
            r.add(saved)
            nbytes += len(body)
            sources.append("local" if source == self.holder else source)
            del saved, body
        return r.finish(), ",".join(dict.fromkeys(sources)), nbytes

    def restore(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """Collective: every rank restores its part of ``step`` or every rank raises ReplicaUnusable. Replicas
        made by a world of another size are resharded (each rank takes its slice of every old shard)."""
        t0 = time.monotonic()
        saved_ws, source = self._world_of(step)
        extra: dict[str, Any] | None = None
        nbytes = 0
        if self._agree(saved_ws):
            try:
                if saved_ws == self.info.world_size:
                    extra, source, nbytes = self._load_own(step, model, optimizer)
                else:
                    extra, source, nbytes = self._load_resharded(step, saved_ws, model, optimizer)
            except Exception as e:  # another model, another layout, undecodable: unusable, never half-used
                extra, source = None, f"{source or 'restore'}: {type(e).__name__}: {e}"
        elif saved_ws > 0:
            source = f"the ranks found different world sizes for step {step}"
        failed = torch.tensor([0.0 if extra is not None else 1.0], dtype=torch.float64)
        if self.info.world_size > 1:
            dist.all_reduce(failed, group=self.info.ckpt_group)
        if failed.item() > 0:  # every rank says why the first rank that failed did
            mine = None if extra is not None else f"rank {self.info.rank} step {step}: {source}"[:280]
            whys: list[Any] = [mine]
            if self.info.world_size > 1:
                whys = [None] * self.info.world_size
                dist.all_gather_object(whys, mine, group=self.info.ckpt_group)
            raise ReplicaUnusable(next((str(w) for w in whys if w is not None), f"step {step}: unusable"))
        assert extra is not None
        print(f"replica_resumed step={step} rank={self.info.rank} source={source} saved_world_size={saved_ws} "
              f"world_size={self.info.world_size} bytes={nbytes} load_s={time.monotonic() - t0:.3f}", flush=True)
        sys.stdout.flush()
        return extra
