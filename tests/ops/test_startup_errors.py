"""orchd's start-up problems: ONE message listing every problem, exit 2, no traceback.

Each case runs the real ``orchd`` command (a subprocess) the way an operator would: the settings file,
``ORCH_*`` overrides, the enabled providers' own tables and what would only fail later in the start (a
busy port, an unwritable state directory) are all reported together. A last case takes the port after
the pre-flight check (``run_daemon`` directly) and still gets a one-line error naming the port.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from orchestrator.daemon.run import run_daemon
from orchestrator.daemon.startup import StartupError
from orchestrator.settings import load_settings

ORCHD = str(Path(sys.executable).parent / "orchd")


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port another process listens on."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def _orchd(cfg: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_") and k != "CREDENTIALS_DIRECTORY"}
    return subprocess.run([ORCHD, "--config", str(cfg)], capture_output=True, text=True, timeout=60,
                          env={**base, **env})


def _report(res: subprocess.CompletedProcess[str]) -> list[str]:
    """The problems of orchd's one report (asserting there is exactly one report and no traceback)."""
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr and "ExceptionGroup" not in res.stderr, res.stderr[-3000:]
    assert res.stderr.count("orchd: ") == 1, res.stderr
    return [line.removeprefix("  - ") for line in res.stderr.splitlines() if line.startswith("  - ")]


def test_every_problem_in_one_report(tmp_path: Path, busy_port: int) -> None:
    cfg = tmp_path / "orchd.toml"
    cfg.write_text(f"""
[daemon]
state_dir = "{tmp_path / 'state'}"
tick_s = -1
[metrics]
port = {busy_port}
[providers]
enabled = ["local"]
[providers.local]
work_dir = "{tmp_path / 'nodes'}"
max_nodes = 4
""")
    problems = _report(_orchd(cfg, ORCH_DAEMON__HEARTBEAT_TIMEOUT_S="soon", ORCH_DAEMON__NO_SUCH_KEY="1"))
    keys = sorted(p.split(":")[0] for p in problems)
    assert keys == ["ORCH_DAEMON__NO_SUCH_KEY", "daemon.heartbeat_timeout_s", "daemon.tick_s", "metrics.port",
                    "providers.local.max_nodes"], problems
    (port_problem,) = [p for p in problems if p.startswith("metrics.port")]
    assert f"127.0.0.1:{busy_port}" in port_problem and "in use" in port_problem


def test_a_provider_that_fails_late_is_one_line_too(tmp_path: Path) -> None:
    """A value only the provider's constructor refuses (not its table's types) is still a problem line."""
    cfg = tmp_path / "orchd.toml"
    cfg.write_text(f"""
[daemon]
state_dir = "{tmp_path / 'state'}"
[metrics]
enabled = false
[providers]
enabled = ["local"]
[providers.local]
work_dir = "{tmp_path / 'nodes'}"
prices = "bogus"
""")
    problems = _report(_orchd(cfg, ORCH_METRICS__PORT="x"))
    assert [p.split(":")[0] for p in problems] == ["metrics.port", "providers.local.prices"], problems


def test_busy_metrics_port_alone_is_named(tmp_path: Path, busy_port: int) -> None:
    cfg = tmp_path / "orchd.toml"
    cfg.write_text(f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n[metrics]\nport = {busy_port}\n')
    (problem,) = _report(_orchd(cfg))
    assert problem.startswith(f"metrics.port: cannot listen on 127.0.0.1:{busy_port}: Address already in use")


def test_state_dir_and_embedded_nats_port(tmp_path: Path, busy_port: int) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the state directory's parent should be
    cfg = tmp_path / "orchd.toml"
    cfg.write_text(f"""
[daemon]
state_dir = "{blocker / 'state'}"
[nats]
embedded_port = {busy_port}
[metrics]
port = 0
""")
    problems = _report(_orchd(cfg))
    assert sorted(p.split(":")[0] for p in problems) == ["daemon.state_dir", "nats.embedded_port"], problems


def test_check_flag(tmp_path: Path, busy_port: int) -> None:
    """``orchd --check``: the same report without starting (exit 2), or exit 0 when nothing is wrong."""
    cfg = tmp_path / "orchd.toml"
    cfg.write_text(f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n[metrics]\nport = {busy_port}\n')
    res = subprocess.run([ORCHD, "--config", str(cfg), "--check"], capture_output=True, text=True, timeout=60)
    assert [p.split(":")[0] for p in _report(res)] == ["metrics.port"]
    res = subprocess.run([ORCHD, "--config", str(cfg), "--check"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "ORCH_METRICS__PORT": "0"})
    assert res.returncode == 0 and "no problems" in res.stdout, res.stderr
    assert not (tmp_path / "state").exists()  # a check creates nothing


def test_environment_override_is_typed(tmp_path: Path) -> None:
    """``ORCH_DAEMON__CLUSTER_ID=2024`` is the string "2024" (a str field), not a type error."""
    assert load_settings(None, env={"ORCH_DAEMON__CLUSTER_ID": "2024"}).daemon.cluster_id == "2024"


@pytest.mark.anyio
async def test_port_taken_after_the_check_names_the_port(tmp_path: Path, busy_port: int) -> None:
    settings = load_settings(None, env={"ORCH_DAEMON__STATE_DIR": str(tmp_path / "state"),
                                        "ORCH_METRICS__PORT": str(busy_port)})
    with pytest.raises((StartupError, BaseExceptionGroup)) as e:
        with anyio.fail_after(60):
            await run_daemon(settings, {}, feeds=False)
    err = e.value
    while isinstance(err, BaseExceptionGroup):
        (err,) = err.exceptions
    assert isinstance(err, StartupError)
    assert str(err).startswith(f"metrics.port: cannot listen on 127.0.0.1:{busy_port}")
