"""``orchctl demo`` stopped by SIGTERM or SIGINT leaves no process behind.

A real ``orchctl demo`` subprocess: once its embedded nats-server (and, for SIGTERM, its local nodes) run,
every descendant is listed with psutil, the signal is sent, and each listed process must be gone within
a few seconds of the demo's exit; the exit code is 128 + the signal. nats-server and the nodes run in
sessions of their own: the demo must stop them itself.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="orchctl demo needs torch")


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _names(procs: list[psutil.Process]) -> str:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid}:{' '.join(p.cmdline())[:100]}")
        except psutil.Error:
            out.append(f"{p.pid}:?")
    return "; ".join(out)


def _is(p: psutil.Process, word: str) -> bool:
    try:
        return any(word in part for part in p.cmdline())
    except psutil.Error:
        return False


@pytest.mark.parametrize(("sig", "wait_for_nodes"), [(signal.SIGTERM, True), (signal.SIGINT, False)])
def test_demo_leaves_no_process_on_signal(tmp_path: Path, sig: signal.Signals, wait_for_nodes: bool) -> None:
    log = open(tmp_path / "demo.out", "wb")  # noqa: SIM115 - closed below
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "demo", "--fast", "--state-dir",
                             str(tmp_path / "state")], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env)
    snapshot: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            snapshot = _descendants(proc.pid)
            servers = [p for p in snapshot if _is(p, "nats-server")]
            nodes = [p for p in snapshot if _is(p, "agent")]
            if servers and (nodes or not wait_for_nodes):
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"the demo did not start: {(tmp_path / 'demo.out').read_text()[-3000:]}")
        time.sleep(0.5)
        snapshot = _descendants(proc.pid)  # everything alive now, listed before the signal
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
        _gone, alive = psutil.wait_procs(snapshot, timeout=5)
        assert not alive, f"left running after {sig.name}: {_names(alive)}"
        assert _descendants(proc.pid) == []
        assert code == 128 + sig, (tmp_path / "demo.out").read_text()[-3000:]
    finally:
        for p in [*snapshot, *_descendants(proc.pid)]:
            with contextlib.suppress(psutil.Error):
                p.kill()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
