"""orchctl's command-line conventions, with real subprocesses (and a real orchd / nats-server where one
is the subject).

* ``--version`` on orchctl, orchd and orch-agent;
* distinct exit codes: 2 usage, 66 not found, 69 unreachable (with a hint naming a stale or missing
  orchd.json), 130 on Ctrl-C;
* ``orchctl completion bash|zsh`` prints a completion script;
* times in tables carry their date; ``-o`` is honoured by ``logs``;
* a clean stop of orchd removes its orchd.json.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import nats
import pytest
import yaml

import wire as ev
from orchestrator.cli.common import EXIT_CODES, format_time
from orchestrator.cli.main import format_reply
from orchestrator.natsserver import NatsServer
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "ORCH_SERVER": "", "PYTHONUNBUFFERED": "1"}


def _run(*argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)


def _orchctl(*argv: str) -> subprocess.CompletedProcess[str]:
    return _run("-m", "orchestrator.cli", *argv)


def test_version_on_all_three_commands() -> None:
    version = importlib.metadata.version("spot-orchestrator")
    commands = (("orchctl", "orchestrator.cli"), ("orchd", "orchestrator.daemon"), ("orch-agent", "agent.main"))
    for prog, module in commands:
        p = _run("-m", module, "--version")
        assert p.returncode == 0, (module, p.stderr)
        assert p.stdout.strip() == f"{prog} {version}", (module, p.stdout, p.stderr)


def test_exit_codes_are_distinct_and_documented() -> None:
    assert sorted(EXIT_CODES) == [0, 1, 2, 66, 69, 130]
    doc = (ROOT / "docs" / "admin.md").read_text()
    for code in EXIT_CODES:
        assert f"| {code} |" in doc, f"exit code {code} is not in docs/admin.md's table"
    p = _orchctl("jobs", "frobnicate")
    assert p.returncode == 2 and "invalid choice" in p.stderr
    p = _orchctl("--help")
    assert p.returncode == 0 and "69 NATS or orchd unreachable" in p.stdout


def test_completion_scripts() -> None:
    p = _orchctl("completion", "bash")
    assert p.returncode == 0, p.stderr
    assert "complete" in p.stdout and "jobs" in p.stdout and "completion" in p.stdout
    bash = shutil.which("bash")
    if bash:  # the script parses
        check = subprocess.run([bash, "-n"], input=p.stdout, text=True, capture_output=True)
        assert check.returncode == 0, check.stderr
    p = _orchctl("completion", "zsh")
    assert p.returncode == 0 and p.stdout.startswith("#compdef orchctl"), p.stdout[:200]
    assert _orchctl("completion", "fish").returncode == 2


def test_table_times_have_a_date() -> None:
    ts = 1_790_000_000.0
    assert format_time(ts) == "2026-09-21 14:13:20Z"
    page = ev.EventsReply(events=[{"seq": 1, "ts": ts, "event": "Tick", "command": "Launch"}], last_seq=1)
    assert "2026-09-21 14:13:20Z" in format_reply("events", page, "table")
    from orchestrator.cli.logs import format_line

    line = ev.LogLine(job_id="j", node_id="n1", generation=1, rank=0, seq=0, line="x", ts=ts)
    assert format_line(line).startswith("2026-09-21 14:13:20Z n1 g1 r0 | x")
    # a time inside a field (jobs show: a restart hold's or a wait's "until")
    from orchestrator.cli.main import render_kv

    shown = render_kv({"hold": {"reason": "exited_early", "until": ts, "holds": 1}})
    assert '"until":"2026-09-21 14:13:20Z"' in shown and '"holds":1' in shown


async def _publish_line(url: str, job: str, text: str, ts: float) -> None:
    from agent.logship import ensure_logs_stream

    nc = await nats.connect(url)
    await ensure_logs_stream(nc)
    line = ev.LogLine(job_id=job, node_id="n1", generation=1, rank=0, seq=0, line=text, ts=ts)
    await nc.jetstream().publish(f"orch.logs.{job}.n1", ev.encode(line))
    await nc.close()


def test_logs_output_formats_follow_and_ctrl_c(tmp_path: Path) -> None:
    """No orchd here (logs outlive it): stored lines as yaml; --follow prints, Ctrl-C exits 130."""
    server = NatsServer(tmp_path / "nats").start()
    try:
        anyio.run(_publish_line, server.url, "j1", "first", 1_790_000_000.0)
        p = _orchctl("--server", server.url, "logs", "j1", "-o", "yaml")
        assert p.returncode == 0, p.stderr
        assert [r["line"] for r in yaml.safe_load(p.stdout)] == ["first"]
        out = tmp_path / "follow.out"
        with open(out, "wb") as f:
            proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "--server", server.url, "logs", "j1",
                                     "--follow"], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=ENV)
        try:
            _wait(lambda: "| first" in out.read_text(), proc)
            anyio.run(_publish_line, server.url, "j1", "second", 1_790_000_001.0)
            _wait(lambda: "| second" in out.read_text(), proc)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(20) == 130, out.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert "Traceback" not in out.read_text()
    finally:
        server.cleanup()


def _wait(cond, proc: subprocess.Popen, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert proc.poll() is None, f"exited with {proc.returncode}"
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_clean_stop_removes_orchd_json_and_unreachable_hints_at_a_stale_one(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cfg = tmp_path / "orchd.toml"
    cfg.write_text(f'[daemon]\nstate_dir = "{state}"\ntick_s = 0.5\n[metrics]\nenabled = false\n'
                   '[log]\nlevel = "info"\nformat = "json"\n')
    disc = state / "orchd.json"
    with open(tmp_path / "orchd.log", "ab") as err:
        orchd = subprocess.Popen([sys.executable, "-m", "orchestrator.daemon", "--config", str(cfg)], cwd=ROOT,
                                 stdout=subprocess.DEVNULL, stderr=err, env=ENV)
    try:
        _wait(disc.exists, orchd)
        p = _orchctl("--state-dir", str(state), "jobs", "show", "no-such-job")
        assert p.returncode == 66 and "no job" in p.stderr, (p.returncode, p.stderr)  # found orchd, 404
        orchd.send_signal(signal.SIGTERM)
        assert orchd.wait(30) == 0, (tmp_path / "orchd.log").read_text()[-2000:]
    finally:
        if orchd.poll() is None:
            orchd.kill()
            orchd.wait()
    assert not disc.exists(), "a clean stop must remove orchd.json"
    p = _orchctl("--state-dir", str(state), "status")
    assert p.returncode == 69 and f"no {disc}" in p.stderr, p.stderr
    # orchd killed (-9) or a reboot: the file stays, naming a pid that is gone
    dead = subprocess.Popen(["true"])
    dead.wait()
    disc.write_text(json.dumps({"nats_url": f"nats://127.0.0.1:{free_port()}", "pid": dead.pid}))
    p = _orchctl("--state-dir", str(state), "jobs", "list")
    assert p.returncode == 69, p.stderr
    assert f"{disc} is stale" in p.stderr and f"pid {dead.pid}" in p.stderr, p.stderr
    p = _orchctl("--state-dir", str(state), "logs", "j1")
    assert p.returncode == 69 and f"{disc} is stale" in p.stderr, p.stderr


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_demo_accepts_output_format(fmt: str) -> None:
    from orchestrator.cli.demo import options_from_args
    from orchestrator.cli.main import build_parser

    args = build_parser().parse_args(["demo", "--fast", "-o", fmt])
    assert args.output == fmt and options_from_args(args).steps == 90


def _leaves(parser, path=()):
    import argparse

    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for name, child in subs[0].choices.items():
        yield from _leaves(child, (*path, name))


def test_every_command_takes_output_format() -> None:
    from orchestrator.cli.main import build_parser

    for path, parser in _leaves(build_parser()):
        if path == ("completion",):  # prints a shell script
            continue
        assert any("-o" in a.option_strings for a in parser._actions), f"orchctl {' '.join(path)} has no -o"
    p = _orchctl("examples", "--list", "-o", "json")
    assert p.returncode == 0, p.stderr
    assert "systemd/orchd.service" in json.loads(p.stdout)["files"]


def test_a_503_from_orchd_exits_69_with_a_retry_hint(nats_server) -> None:
    """orchd answers 503 when it lost the leader lease while holding the request (``not_leader``) or is
    stopping: transient, so orchctl exits 69 (retry), not 1. A stand-in responder on a real server sends
    orchd's reply (the micro error headers and an AdminErrorBody)."""
    import wire as ev

    async def answer_503() -> subprocess.CompletedProcess[str]:
        nc = await nats.connect(nats_server.url)
        try:
            message = "this orchd lost the leader lease; retry: the new leader answers"

            async def respond(msg) -> None:
                await nc.publish(msg.reply, ev.encode(ev.AdminErrorBody(code=503, message=message)),
                                 headers={"Nats-Service-Error-Code": "503", "Nats-Service-Error": message})

            await nc.subscribe(ev.admin_subject("status", "get"), cb=respond)
            await nc.flush()
            return await anyio.to_thread.run_sync(lambda: _orchctl("--server", nats_server.url, "status"))
        finally:
            await nc.close()

    p = anyio.run(answer_503, backend="asyncio")
    assert p.returncode == 69, (p.returncode, p.stderr)
    assert "503" in p.stderr and "retry" in p.stderr
