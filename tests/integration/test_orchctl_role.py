"""orchctl under the project's own operator role, end to end.

A real nats-server with the least-privilege users of ``orchestrator.security.nats_auth`` (``orchd`` with
``orchd_permissions``, ``ops`` with ``orchctl_permissions``), a real orchd subprocess logged in as
``orchd``, and orchctl subprocesses logged in as ``ops`` (``--config``). orchctl must take its replies on
the role's inbox (``_INBOX.orchctl``; nats-py's default ``_INBOX`` is a subscription violation there,
and orchctl said "orchd unreachable"), and ``logs`` must read ORCH_LOGS with what the role grants.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest

import wire as ev
from orchestrator.natsserver import NatsServer
from orchestrator.security.nats_auth import (
    User,
    hash_password,
    orchctl_permissions,
    orchd_permissions,
    render_authorization,
    render_server_config,
)

ROOT = Path(__file__).resolve().parents[2]
ORCHD_PW = "orchd-role-test-password"
OPS_PW = "ops-role-test-password"


@pytest.fixture
def secured(tmp_path: Path):
    users = [User(name="orchd", password_hash=hash_password(ORCHD_PW), permissions=orchd_permissions()),
             User(name="ops", password_hash=hash_password(OPS_PW), permissions=orchctl_permissions())]
    (tmp_path / "auth.conf").write_text(render_authorization(users))
    (tmp_path / "server.conf").write_text(render_server_config(host="127.0.0.1", port=-1, store_dir=None,
                                                               http_port=None))
    server = NatsServer(tmp_path / "srv", config_file=str(tmp_path / "server.conf")).start()
    yield server
    server.cleanup()


def _config(path: Path, url: str, user: str, password: str, state: Path) -> Path:
    path.write_text(f'[nats]\nurls = ["{url}"]\nuser = "{user}"\npassword = "{password}"\n'
                    f'[daemon]\nstate_dir = "{state}"\ntick_s = 0.5\n[metrics]\nenabled = false\n'
                    '[log]\nlevel = "info"\nformat = "json"\n')
    return path


def _orchctl(*argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "ORCH_SERVER": ""})


async def _publish_logs(url: str, job: str) -> None:
    nc = await nats.connect(url, user="orchd", password=ORCHD_PW)
    js = nc.jetstream()
    for i in range(3):
        line = ev.LogLine(job_id=job, node_id="n1", generation=1, rank=0, seq=i, line=f"hello {i}",
                          ts=1_790_000_000.0 + i)
        await js.publish(f"orch.logs.{job}.n1", ev.encode(line))
    await nc.close()


async def _only_reads_the_log_stream(url: str) -> None:
    """The role's JetStream grant is one read-only API: no purge, delete, consumer or other stream."""
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    nc = await nats.connect(url, user="ops", password=OPS_PW, inbox_prefix=orchctl_permissions().inbox_prefix,
                            error_cb=on_error, allow_reconnect=False)
    try:
        for subject in ("$JS.API.STREAM.PURGE.ORCH_LOGS", "$JS.API.STREAM.MSG.DELETE.ORCH_LOGS",
                        "$JS.API.CONSUMER.CREATE.ORCH_LOGS", "$JS.API.STREAM.MSG.GET.ORCH_EVENTS"):
            with pytest.raises(nats.errors.TimeoutError):
                await nc.request(subject, b"{}", timeout=0.3)
            assert any(subject.lower() in e.lower() for e in errors), (subject, errors)
    finally:
        await nc.close()


def test_orchctl_works_under_the_operator_role(secured: NatsServer, tmp_path: Path) -> None:
    import anyio

    state = tmp_path / "state"
    orchd_cfg = _config(tmp_path / "orchd.toml", secured.url, "orchd", ORCHD_PW, state)
    ops = str(_config(tmp_path / "ops.toml", secured.url, "ops", OPS_PW, state))
    with open(tmp_path / "orchd.log", "ab") as err:
        orchd = subprocess.Popen([sys.executable, "-m", "orchestrator.daemon", "--config", str(orchd_cfg)], cwd=ROOT,
                                 stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 30
        while not (state / "orchd.json").exists():
            assert orchd.poll() is None, (tmp_path / "orchd.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "orchd did not start"
            time.sleep(0.05)
        anyio.run(_publish_logs, secured.url, "j1")

        p = _orchctl("--config", ops, "jobs", "list", "-o", "json")
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["jobs"] == []
        p = _orchctl("--config", ops, "events", "-o", "json")
        assert p.returncode == 0, p.stderr
        assert "events" in json.loads(p.stdout)
        p = _orchctl("--config", ops, "status")
        assert p.returncode == 0, p.stderr
        p = _orchctl("--config", ops, "logs", "j1")
        assert p.returncode == 0, p.stderr
        assert [line.split("| ", 1)[1] for line in p.stdout.splitlines()] == ["hello 0", "hello 1", "hello 2"]
        p = _orchctl("--config", ops, "logs", "j1", "-o", "json")
        assert p.returncode == 0, p.stderr
        assert [json.loads(line)["line"] for line in p.stdout.splitlines()] == ["hello 0", "hello 1", "hello 2"]
        p = _orchctl("--config", ops, "logs", "no-such-job")  # orchd: 404, nothing stored
        assert p.returncode == 66 and "no job 'no-such-job'" in p.stderr, (p.returncode, p.stderr)
        # nothing orchctl did was a permissions violation (the server logs each one)
        assert "Violation" not in secured.log_path.read_text(), secured.log_path.read_text()[-2000:]
        anyio.run(_only_reads_the_log_stream, secured.url)
    finally:
        orchd.send_signal(signal.SIGTERM)
        try:
            orchd.wait(20)
        except subprocess.TimeoutExpired:
            orchd.kill()
            orchd.wait()
