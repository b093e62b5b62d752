"""Nodes for replica tests: a replica holder process and a work directory per node, and generations of
real gloo ranks (one per node, ``LOCAL_WORLD_SIZE=1``) launched over them the way the agent does."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from tests.trainer.helpers import GPT_CMD, REPO, Rank
from trainer import contract
from trainer.launch import free_port
from trainer.replicas import protocol as p
from trainer.replicas.client import HolderClient, start_holder

SECRET = "replica-test-secret-0123456789abcdef"


@dataclass
class Node:
    name: str
    work: Path
    job: str
    generation: int
    holder: subprocess.Popen[bytes] | None = None
    addr: str = ""
    allow_debug: bool = False

    def start(self) -> Node:
        self.work.mkdir(parents=True, exist_ok=True)
        self.holder, self.addr = start_holder(self.job, SECRET, self.generation, allow_debug=self.allow_debug)
        return self

    def agent(self) -> HolderClient:
        return HolderClient(self.addr, self.job, 0, SECRET.encode(), role=p.ROLE_AGENT)

    def set_generation(self, gen: int) -> None:
        with self.agent() as a:
            a.set_generation(gen)

    def inventory(self) -> list[tuple[int, int, int, int]]:
        with self.agent() as a:
            return a.inventory()

    def vanish(self) -> None:
        """The node is gone without notice: its holder's memory and its work directory with it."""
        if self.holder is not None and self.holder.poll() is None:
            os.killpg(self.holder.pid, signal.SIGKILL)
            self.holder.wait()
        shutil.rmtree(self.work, ignore_errors=True)

    def stop(self) -> None:
        if self.holder is not None and self.holder.poll() is None:
            self.holder.kill()
            self.holder.wait()


@dataclass
class ReplicaGeneration:
    ranks: list[Rank] = field(default_factory=list)

    def log(self) -> str:
        return "\n".join(f"[{i}] {line}" for i, r in enumerate(self.ranks) for line in r.lines[-40:])

    def reports(self, kind: type) -> list:
        return [x for r in self.ranks for x in r.reports() if isinstance(x, kind)]

    def max_step(self) -> int:
        return max((x.step for x in self.reports(contract.StepReport)), default=0)

    def wait(self, timeout: float = 120.0) -> list[int]:
        codes = [r.proc.wait(timeout=timeout) for r in self.ranks]
        for r in self.ranks:
            assert r.reader is not None
            r.reader.join(timeout=10)
        return codes


def launch(nodes: list[Node], gen: int, env: dict[str, str], every: int = 1,
           replica_step: int = 0, buddies: list[int] | None = None) -> ReplicaGeneration:
    """One rank per node, rank = the node's index; the node's holder and this generation's key; ``buddies``:
    orchd's buddy of each node (ORCH_REPLICA_BUDDY), else the ring."""
    port, ws = free_port(), len(nodes)
    key = p.generation_key(SECRET, gen).hex()
    g = ReplicaGeneration()
    for r, node in enumerate(nodes):
        control = node.work / "control" / f"gen{gen}"
        control.mkdir(parents=True, exist_ok=True)
        rank_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **env,
                    "RANK": str(r), "WORLD_SIZE": str(ws), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), contract.ENV_GENERATION: str(gen),
                    contract.ENV_CONTROL_DIR: str(control), contract.ENV_JOB_ID: node.job,
                    p.ENV_HOLDER: node.addr, p.ENV_KEY: key, p.ENV_EVERY: str(every)}
        if replica_step:
            rank_env[p.ENV_STEP] = str(replica_step)
        if buddies is not None:
            rank_env[p.ENV_BUDDY] = str(buddies[r])
        proc = subprocess.Popen(GPT_CMD, env=rank_env, cwd=REPO, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, bufsize=1, start_new_session=True)
        rank = Rank(proc)
        rank.reader = threading.Thread(target=_read, args=(rank,), daemon=True)
        rank.reader.start()
        g.ranks.append(rank)
    return g


def _read(rank: Rank) -> None:
    assert rank.proc.stdout is not None
    for line in rank.proc.stdout:
        rank.lines.append(line.rstrip("\n"))
