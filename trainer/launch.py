"""A minimal local launcher: ``python -m trainer.launch --nproc 2 [--port P] -- python -m trainer [flags]``.

Role: what the agent does for one host, for manual runs and the docs: one process per rank with
RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT set (ORCH_* are inherited from the
environment). SIGUSR1 and SIGTERM are forwarded to every rank; it exits with the highest rank exit code
(so 75 when the ranks checkpointed on request). Not torchrun: no restarts, no rendezvous.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int, base: dict[str, str] | None = None,
             addr: str = "127.0.0.1") -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
               MASTER_ADDR=addr, MASTER_PORT=str(port))
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.launch")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        p.error("missing command after --")
    port = a.port or free_port()
    procs: list[subprocess.Popen] = []

    def forward(signum: int, frame: object) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    signal.signal(signal.SIGUSR1, forward)  # before spawning: a request never kills the launcher
    signal.signal(signal.SIGTERM, forward)
    procs.extend(subprocess.Popen(cmd, env=rank_env(r, a.nproc, port)) for r in range(a.nproc))
    return max(proc.wait() for proc in procs)


if __name__ == "__main__":
    sys.exit(main())
