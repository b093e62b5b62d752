"""Emergency protocol: checkpoint requests (SIGUSR1 + request file, SIGTERM) and the per-step agreement.

Role: turn asynchronous requests into a decision that every rank takes at the *same* step. Signal
handlers only record the request (CheckpointRequest read from ORCH_CONTROL_DIR, or a synthetic one for
SIGTERM with deadline now + ORCH_SIGTERM_GRACE_S); at the end of every step each rank contributes its flags
to one tiny all-reduce (SUM over a 9-element float64 tensor), so all ranks see the same verdict and stop
after the same step. The same all-reduce carries the loss sum, "my async save is done" and "my shard
replica's copy is still in flight" (trainer.replicas), so a step costs exactly one extra collective.

Concurrency: handlers run in the main thread between bytecodes (Python's rule); the only shared state is
this object's fields, written by the handler and read by the loop in the same thread.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer import contract
from trainer import signals as early_signals


@dataclass(frozen=True, slots=True)
class Verdict:
    stop: bool  # some rank holds a checkpoint request: all stop after this step
    oom: bool  # some rank ran out of memory in this step: all retry it with a smaller micro-batch
    saves_done: bool  # every rank's pending async save has finished writing
    save_failed: bool  # some rank's finished async save raised: the checkpoint is abandoned
    periodic_due: bool  # some rank's periodic-checkpoint timer (ORCH_CKPT_INTERVAL_S) expired
    loss_sum: float  # sum over ranks of the contributed loss values
    deadline_ts: float | None  # the earliest deadline among ranks' requests
    world_size: int
    replicas_done: bool = True  # no rank's shard replica copy is in flight (trainer.replicas)


class EmergencyState:
    """Pending checkpoint request of this process (first request wins; later ones only tighten the
    deadline)."""

    def __init__(self, control_dir: str | None, sigterm_grace_s: float) -> None:
        self.control_dir = control_dir
        self.sigterm_grace_s = sigterm_grace_s
        self.request: contract.CheckpointRequest | None = None
        self.received_monotonic: float | None = None
        self.received_ts: float | None = None

    @classmethod
    def from_env(cls) -> EmergencyState:
        return cls(
            os.environ.get(contract.ENV_CONTROL_DIR) or None,
            float(os.environ.get(contract.ENV_SIGTERM_GRACE_S) or contract.DEFAULT_SIGTERM_GRACE_S),
        )

    def install(self) -> None:
        signal.signal(signal.SIGUSR1, self._on_sigusr1)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        for signum, _ts in early_signals.received:  # requests that arrived while torch was importing
            (self._on_sigusr1 if signum == signal.SIGUSR1 else self._on_sigterm)(signum, None)
        early_signals.received.clear()

    def _record(self, req: contract.CheckpointRequest) -> None:
        if self.request is None:
            self.request = req
            self.received_monotonic = time.monotonic()
            self.received_ts = time.time()
        elif req.deadline_ts is not None and (
            self.request.deadline_ts is None or req.deadline_ts < self.request.deadline_ts
        ):
            self.request = contract.CheckpointRequest(
                request_id=self.request.request_id, reason=self.request.reason,
                deadline_ts=req.deadline_ts, issued_ts=self.request.issued_ts,
            )

    def _on_sigusr1(self, signum: int, frame: object) -> None:
        req = contract.read_checkpoint_request(self.control_dir) if self.control_dir else None
        if req is None:  # a bare signal (no file): checkpoint now, no deadline known
            now = time.time()
            req = contract.CheckpointRequest(request_id=f"sigusr1-{uuid.uuid4().hex[:8]}", reason="admin",
                                             deadline_ts=None, issued_ts=now)
        self._record(req)

    def _on_sigterm(self, signum: int, frame: object) -> None:
        now = time.time()
        self._record(contract.CheckpointRequest(
            request_id=f"sigterm-{uuid.uuid4().hex[:8]}", reason="sigterm",
            deadline_ts=now + self.sigterm_grace_s, issued_ts=now,
        ))

    def request_local(self, reason: str, deadline_ts: float | None = None) -> None:
        """Ask for an emergency checkpoint from code (tests, in-process agents)."""
        self._record(contract.CheckpointRequest(
            request_id=f"local-{uuid.uuid4().hex[:8]}", reason=reason, deadline_ts=deadline_ts, issued_ts=time.time(),
        ))


def agree(
    state: EmergencyState,
    *,
    oom: bool = False,
    save_pending: bool = False,
    save_failed: bool = False,
    periodic_due: bool = False,
    replica_pending: bool = False,
    loss: float = 0.0,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> Verdict:
    """The per-step agreement: one all-reduce (SUM) of
    [stop, oom, save_pending, loss, deadline, has_deadline, save_failed, periodic_due, replica_pending].

    Every rank gets the same stop/oom/saves_done verdict. The deadline is the mean of the ranks' deadlines
    (equal when relayed from one orchd request), capped by the local one; a rank without a request of
    its own still learns a deadline from its peers."""
    req = state.request
    deadline = req.deadline_ts if req is not None and req.deadline_ts is not None else None
    t = torch.tensor(
        [1.0 if req is not None else 0.0, 1.0 if oom else 0.0, 1.0 if save_pending else 0.0, float(loss),
         float(deadline or 0.0), 1.0 if deadline is not None else 0.0, 1.0 if save_failed else 0.0,
         1.0 if periodic_due else 0.0, 1.0 if replica_pending else 0.0],
        dtype=torch.float64, device=device,
    )
    ws = 1
    if dist.is_initialized():
        ws = dist.get_world_size(group)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    v = t.tolist()
    agreed_deadline = v[4] / v[5] if v[5] > 0 else None  # mean of the ranks' deadlines (equal when relayed)
    if deadline is not None:
        agreed_deadline = min(deadline, agreed_deadline) if agreed_deadline is not None else deadline
    return Verdict(stop=v[0] > 0, oom=v[1] > 0, saves_done=v[2] == 0, save_failed=v[6] > 0, periodic_due=v[7] > 0,
                   loss_sum=v[3], deadline_ts=agreed_deadline, world_size=ws, replicas_done=v[8] == 0)
