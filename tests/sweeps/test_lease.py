"""One acting sweep controller per storage (orchestrator/sweeps/lease.py): the lease row in the storage's
database, and two real ``orchctl sweep run`` processes on one SQLite storage - one leads, the other stands
by; kill -9 of the leader hands the lease over once it expires; a clean stop hands it over at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from orchestrator.sweeps.lease import ControllerLease
from orchestrator.sweeps.store import SweepStore

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def test_one_holder_at_a_time_takeover_after_expiry_and_release(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'l.db'}")
    a, b = ControllerLease(engine, "a", ttl_s=10.0), ControllerLease(engine, "b", ttl_s=10.0)
    t = 1_800_000_000.0
    assert a.acquire(t) and a.held() and a.token == 1
    assert not b.acquire(t + 1) and not b.held()
    assert a.acquire(t + 5) and a.token == 1  # a renewal keeps the token
    assert a.current() == ("a", t + 15, 1)
    assert not b.acquire(t + 14.9)
    assert b.acquire(t + 15.1) and b.token == 2  # a's term expired: a takeover, a new fencing token
    assert not a.acquire(t + 16) and not a.held()
    b.release()
    assert a.current() is None
    assert a.acquire(t + 17) and a.token >= 1
    with pytest.raises(ValueError, match="ttl_s must be > 0"):
        ControllerLease(engine, "c", ttl_s=0.0)


def _holder(url: str) -> tuple[str, float, int] | None:
    return ControllerLease(SweepStore(url).storage.engine, "probe").current()


def _wait(cond, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.1)


def test_two_controller_services_one_acts_and_kill9_hands_over(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'sweeps.db'}"
    SweepStore(url)  # Optuna's tables first (two services creating them at once would race on it)
    logs = [tmp_path / f"c{i}.log" for i in range(2)]

    def start(i: int) -> subprocess.Popen:
        # no orchd anywhere: a controller that leads logs "orchd unreachable" and keeps its lease
        return subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "--server", "nats://127.0.0.1:9", "--timeout", "0.5",
             "sweep", "run", "--storage", url, "--interval", "0.2", "--lease-ttl", "3"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(logs[i], "w"),  # noqa: SIM115 (the child's)
            env={k: v for k, v in os.environ.items() if not k.startswith("ORCH_")})

    procs = [start(0)]
    try:
        _wait(lambda: _holder(url) is not None, 40)
        first = _holder(url)
        assert first is not None and f":{procs[0].pid}:" in first[0]
        procs.append(start(1))
        _wait(lambda: "sweep_controller_standby" in logs[1].read_text(), 40)
        time.sleep(1.0)
        now = _holder(url)
        assert now is not None and now[0] == first[0] and now[2] == first[2]  # still the first, same term
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(10)
        killed = time.time()
        _wait(lambda: (h := _holder(url)) is not None and f":{procs[1].pid}:" in h[0], 20)
        took = _holder(url)
        assert took is not None and took[2] == first[2] + 1  # a takeover: the fencing token moved on
        assert time.time() - killed >= 3.0 - 1.0  # not before the dead one's term could expire (ttl 3 s)
        assert "sweep_controller_leading" in logs[1].read_text()
        procs[1].send_signal(signal.SIGTERM)  # a clean stop gives the lease up
        procs[1].wait(20)
        assert _holder(url) is None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_the_storage_url_from_a_systemd_credential(tmp_path: Path) -> None:
    """systemd/orch-sweep.service hands a storage URL with a password in as a credential, not in the env."""
    import argparse

    from orchestrator.cli.sweep import _storage_url

    (tmp_path / "sweep-storage.url").write_text("postgresql://sweeps:pw@db/sweeps\n")
    args = argparse.Namespace(storage=None)
    assert _storage_url(args, {"CREDENTIALS_DIRECTORY": str(tmp_path)}) == "postgresql://sweeps:pw@db/sweeps"
    both = {"ORCH_SWEEP_STORAGE": "sqlite:///s.db", "CREDENTIALS_DIRECTORY": str(tmp_path)}
    assert _storage_url(args, both) == "sqlite:///s.db"  # the environment first, then the credential
    assert _storage_url(args, {"CREDENTIALS_DIRECTORY": str(tmp_path / "none")}) == ""
