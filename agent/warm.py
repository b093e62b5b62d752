"""Warm rank processes: Python interpreters that have already imported torch and the trainer.

Role: a new generation's time to first step is mostly interpreter start and imports (torch alone is
seconds on a busy host), and every second of it counts against a preemption's recovery time. The agent
therefore keeps one pre-started process per local rank slot (``WarmPool``); starting a generation hands
each rank's environment and module to one of them instead of exec'ing a new interpreter.

``python -m agent.warm MOD [MOD...]`` (this module as a program) imports the modules, then blocks reading
ONE JSON line on stdin: ``{"env": {...}, "cwd": "...", "argv": [...], "module": "trainer"}``. It replaces
its environment with ``env`` (so the trainer reads the contract's variables exactly as if exec'd with
them), then runs ``module`` as ``__main__`` (``runpy``). Its stdout/stderr are the rank's. It prints
nothing before the request, so report parsing is unaffected. A closed stdin (the agent died) ends it.

Only for trainers started as ``python -m <module>`` (the built-in trainer is ``python -m trainer``);
any other command is spawned normally.

Priority: a warm process imports at nice 10 (``ORCH_WARM_NICE``) and resets to 0 when it becomes a rank
(where permitted), so refilling the pool right after a generation started does not slow that start.

Concurrency contract: ``WarmPool`` is used from the agent's event loop only; spawning happens in the
agent's task group (``refill`` starts processes and returns at once; they import in the background).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # run as a program (a warm process), this module imports nothing it does not need
    import anyio.abc

_AGENT_ONLY = ("CREDENTIALS_DIRECTORY", "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID")


def rank_base_env() -> dict[str, str]:
    """The agent's environment minus what is the agent's alone: its configuration and secrets
    (``ORCH_AGENT_*``: NATS credentials, enrolment token) and systemd's sockets/credentials. Trainer
    code (and its dependencies) is less trusted than the agent and never needs them."""
    return {k: v for k, v in os.environ.items() if not k.startswith("ORCH_AGENT_") and k not in _AGENT_ONLY}


DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "trainer.gpt")


def module_of(argv: list[str]) -> str | None:
    """``[python, -m, X, ...]`` with this interpreter -> X (only then can a warm process run it)."""
    if len(argv) >= 3 and argv[1] == "-m" and os.path.realpath(argv[0]) == os.path.realpath(sys.executable):
        return argv[2]
    return None


class WarmPool:
    """Pre-started interpreters, each waiting for one rank's request on stdin."""

    def __init__(self, size: int, cwd: str, *, preload: tuple[str, ...] = DEFAULT_PRELOAD,
                 env: dict[str, str] | None = None) -> None:
        self.size = size
        self.cwd = cwd
        self.preload = preload
        self.env = env
        self._procs: list[anyio.abc.Process] = []
        self.used = 0
        self.spawned = 0

    async def refill(self) -> None:
        import anyio
        import structlog

        self._procs = [p for p in self._procs if p.returncode is None]
        while len(self._procs) < self.size:
            proc = await anyio.open_process(
                [sys.executable, "-m", "agent.warm", *self.preload], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, cwd=self.cwd, env=self.env if self.env is not None else rank_base_env(),
                start_new_session=True)
            self._procs.append(proc)
            self.spawned += 1
            structlog.get_logger("agent.warm").info("warm_process_started", pid=proc.pid)

    def take(self) -> anyio.abc.Process | None:
        while self._procs:
            proc = self._procs.pop(0)
            if proc.returncode is None:
                self.used += 1
                return proc
        return None

    async def close(self) -> None:
        for proc in self._procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        self._procs.clear()


def _serve(preload: list[str]) -> None:
    import importlib
    import runpy

    # Import at low priority: a warm process is started while a generation is starting up, and must
    # not slow it down. Restored when used (where permitted: an unprivileged process cannot lower its
    # nice value again, and then the rank runs at nice 10, harmless on a node of its own).
    nice = int(os.environ.get("ORCH_WARM_NICE", "10"))
    if nice:
        try:
            os.nice(nice)
        except OSError:
            nice = 0
    for name in preload:
        with contextlib.suppress(ImportError):  # the request's module will fail loudly if it really needs it
            importlib.import_module(name)
    line = sys.stdin.readline()
    if not line:
        sys.exit(0)  # the agent went away before using us
    req = json.loads(line)
    if nice:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    os.environ.clear()
    os.environ.update(req["env"])
    if req.get("cwd"):
        os.chdir(req["cwd"])
    sys.argv = list(req.get("argv") or [req["module"]])
    runpy.run_module(req["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _serve(sys.argv[1:])
