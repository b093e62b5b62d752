"""orchd, the agent and orchctl over TLS say what they have to say and nothing else.

nats-py upgrades its connection with ``loop.start_tls``; asyncio's stream protocol then answers the
server's TLS close as if on plain TCP, and asyncio wrote "returning true from eof_received() has no
effect when using ssl", raw, on stderr: in orchd's and the agents' JSON logs, and at every orchctl call
over TLS (found by the production drill, whose cluster requires TLS). ``wire.logs`` drops that one
message of the ``asyncio`` logger (``configure`` for orchd and the agent, ``AdminClient`` for orchctl).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from orchestrator.natsserver import NatsServer
from orchestrator.security.nats_auth import render_server_config
from simulations.drill.cluster_secrets import make_tls

ROOT = Path(__file__).resolve().parents[2]
NOISE = "returning true from eof_received() has no effect when using ssl"


def test_orchctl_over_tls_prints_only_its_own_lines(tmp_path: Path) -> None:
    """A real nats-server with TLS and no orchd: orchctl reports orchd unreachable, and that alone."""
    tls = make_tls(tmp_path / "pki")
    conf = tmp_path / "nats.conf"
    conf.write_text(render_server_config(auth_include=None, tls=tls, host="127.0.0.1", port=-1, store_dir=None,
                                         http_port=None, server_name="tls-only"))
    server = NatsServer(tmp_path / "srv", config_file=str(conf)).start()
    try:
        cfg = tmp_path / "ops.toml"
        cfg.write_text(f'[nats]\nurls = ["{server.url}"]\ntls_ca_file = "{tls.ca_file}"\n')
        res = subprocess.run([sys.executable, "-m", "orchestrator.cli", "--config", str(cfg), "--timeout", "5",
                              "status"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    finally:
        server.cleanup()
    assert res.returncode == 69, res.stderr  # unreachable: the TLS connection worked, no orchd answered
    assert "no responders" in res.stderr  # so the request went through over TLS
    assert all(line.startswith("orchctl:") for line in res.stderr.strip().splitlines()), res.stderr


def test_configured_logging_drops_that_message_only() -> None:
    """After ``wire.logs.configure`` (orchd's and the agent's start) the asyncio logger drops the noise
    and keeps every other warning."""
    code = ("import logging; from wire import logs; logs.configure('info', 'json'); a = logging.getLogger('asyncio'); "
            f"a.warning({NOISE!r}); a.warning('another asyncio warning')")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "another asyncio warning" in res.stderr and NOISE not in res.stderr
