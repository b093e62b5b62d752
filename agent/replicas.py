"""The node's replica holder: started for a job with replicas, kept across that job's generations.

Role: the agent's side of the shard replicas (trainer.replicas). For a ``StartGenerationCmd`` with a
``replica_secret`` the agent starts (or keeps) one holder process for the job
(``python -m trainer.replicas.holder``, bound on all interfaces, advertised as ``--advertise-host``), tells
it the new generation before any rank of that generation starts (the command passed the fencing check),
and gives the ranks the holder's address, the key of this generation only (never the job's secret), k,
orchd's replica step and the node whose holder keeps their second copies (orchd's choice of buddy). When
the ranks exit it asks the holder what it keeps: ``RanksExited.replicas``. The holder outlives the ranks
(a vanished peer makes them exit 77; their replicas stay) and ends with the job on this node, or with the
agent (its stdin is the agent's pipe).

Concurrency: called from the agent's event loop; the blocking socket calls run in worker threads.
"""

from __future__ import annotations

import subprocess
from typing import cast

import anyio.to_thread
import msgspec
import structlog

from trainer.replicas import protocol as p
from trainer.replicas.client import HolderClient, start_holder
from wire import ReplicaHeld, StartGenerationCmd

log = structlog.get_logger("agent.replicas")


class ReplicaHolder:
    def __init__(self, advertise_host: str) -> None:
        self.advertise_host = advertise_host
        self.job: str | None = None
        self.secret = ""
        self.addr = ""
        self.proc: subprocess.Popen[bytes] | None = None

    def _agent_client(self) -> HolderClient:
        return HolderClient(self.addr, self.job or "", 0, self.secret.encode(), role=p.ROLE_AGENT, timeout_s=5.0)

    def _ensure(self, job: str, secret: str, generation: int) -> None:
        alive = self.proc is not None and self.proc.poll() is None
        if not (alive and self.job == job and self.secret == secret):
            self.stop()
            self.proc, self.addr = start_holder(job, secret, generation, bind="0.0.0.0",
                                                advertise=self.advertise_host)
            self.job, self.secret = job, secret
            log.info("replica_holder_started", job_id=job, addr=self.addr, pid=self.proc.pid)
        with self._agent_client() as c:
            c.set_generation(generation)

    async def prepare(self, cmd: StartGenerationCmd) -> dict[str, str]:
        """The ranks' replica environment for this generation ({} for a job without replicas)."""
        secret, every = cmd.replica_secret, cmd.replica_every
        if isinstance(secret, msgspec.UnsetType) or not isinstance(every, int) or every <= 0:
            if self.proc is not None and self.job != (cmd.job_id or "job"):
                self.stop()  # another job on this node: the old job's replicas go
            return {}
        job = cmd.job_id or "job"
        await anyio.to_thread.run_sync(self._ensure, job, secret, cmd.generation)
        env = {p.ENV_HOLDER: self.addr, p.ENV_KEY: p.generation_key(secret, cmd.generation).hex(),
               p.ENV_EVERY: str(every)}
        if isinstance(cmd.replica_step, int) and cmd.replica_step > 0:
            env[p.ENV_STEP] = str(cmd.replica_step)
        if isinstance(cmd.replica_buddy, int) and 0 <= cmd.replica_buddy < cmd.nnodes:
            env[p.ENV_BUDDY] = str(cmd.replica_buddy)
        return env

    def _inventory(self) -> tuple[ReplicaHeld, ...]:
        with self._agent_client() as c:
            return tuple(ReplicaHeld(rank=r, step=s, world_size=ws) for (r, s, ws, _g) in c.inventory()
                         if s > 0)[:4096]

    async def inventory(self, job: str) -> tuple[ReplicaHeld, ...] | msgspec.UnsetType:
        """What the holder keeps for ``job`` (UNSET when this node holds none for it)."""
        if self.job != job or self.proc is None or self.proc.poll() is not None:
            return msgspec.UNSET
        try:
            return cast(tuple[ReplicaHeld, ...], await anyio.to_thread.run_sync(self._inventory))
        except (OSError, p.ProtocolError) as e:
            log.warning("replica_inventory_failed", job_id=job, error=f"{type(e).__name__}: {e}")
            return ()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc, self.job, self.secret, self.addr = None, None, "", ""
