"""Stopping orchd with local nodes, and an agent that loses NATS and its metadata service.

- orchd (a real subprocess, embedded NATS, the local provider) gets SIGTERM while a 2-node job trains:
  its local nodes are stopped with it (docs/providers.md): each agent checkpoints and leaves on SIGTERM,
  no agent or rank process survives (psutil), no traceback in any log.
- An agent whose NATS server and metadata service go away logs one line per state change, with
  backoff while it lasts (not one per poll), and leaves on SIGTERM with exit code 0 and no traceback.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil

from orchestrator.natsserver import NatsServer
from providers.local.metadata import MetadataServer
from tests.conftest import free_port
from tests.integration.local_orchd import ROOT, LocalOrchd, local_job, wait_until


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def _training(orchd: LocalOrchd, n: int) -> bool:
    nodes = orchd.ctl_json("nodes", "list")["nodes"]
    return sum(1 for x in nodes if x["phase"] == "running" and (x.get("step") or 0) > 0) >= n


def test_sigterm_to_orchd_stops_its_local_nodes_cleanly(tmp_path: Path) -> None:
    orchd = LocalOrchd(tmp_path, None).start()  # embedded nats-server, as `orchd -c orchd.toml` runs
    try:
        code, out, err = orchd.ctl("jobs", "submit", str(local_job(tmp_path)), "--id", "j1")
        assert code == 0, (out, err)
        wait_until(lambda: _training(orchd, 2), 60, "2 local nodes training")
        procs = [p for p in orchd.processes() if "nats-server" not in p.name()]
        agents = [p for p in procs if "agent.main" in " ".join(p.cmdline())]
        assert len(agents) == 2 and len(procs) >= 4, procs  # 2 agents, 2 ranks
        assert orchd.stop() == 0, orchd.log.read_text()[-3000:]
        gone, alive = psutil.wait_procs(procs, timeout=10)
        assert not alive, f"left running after orchd stopped: {alive}"
    finally:
        orchd.kill_all()
    for log in sorted(orchd.nodes_dir.glob("*/agent.log")):
        text = log.read_text()
        assert "Traceback" not in text, f"{log}:\n{text[-3000:]}"
        events = _events(log)
        leaving = [e for e in events if e["event"] == "agent_leaving"]
        assert len(leaving) == 1 and leaving[0]["reason"] == "sigterm", (log, leaving)
        assert leaving[0]["outbox_flushed"] is True  # NodeLeaving stored while NATS was still up
        assert [e for e in events if e["event"] == "checkpoint_committed" and e["emergency"]], log
        assert not [e for e in events if e["event"] in ("metadata_poll_failed", "parent_exited")], log
    orchd_log = orchd.log.read_text()
    assert "Traceback" not in orchd_log
    assert "local_nodes_stopping" in orchd_log


def test_agent_losing_nats_and_metadata_logs_state_changes_with_backoff(tmp_path: Path) -> None:
    port = free_port()
    md = MetadataServer().start()
    log = tmp_path / "agent.log"  # nothing listens on the port yet: the agent starts before its server
    args = [sys.executable, "-m", "agent.main", "--node-id", "n-lost", "--nats-url", f"nats://127.0.0.1:{port}",
            "--metadata", "aws", "--metadata-endpoint", md.url, "--metadata-poll-s", "0.25",
            "--heartbeat-s", "0.25", "--work-dir", str(tmp_path / "work")]
    with open(log, "ab") as out:
        agent = subprocess.Popen(args, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    nats_srv = None
    try:
        time.sleep(5.0)  # ~10 connection attempts, one per reconnect_time_wait (0.5 s)
        nats_srv = NatsServer(tmp_path / "nats", port=port).start()
        wait_until(lambda: "agent_started" in log.read_text(), 30, "the agent to start", every_s=0.1)
        before = Counter(e["event"] for e in _events(log))
        assert 2 <= before["nats_unreachable"] <= 4 and before["nats_connected"] == 1, before  # 1, 2, 4, 8
        md.stop()  # what a local node sees of orchd going away: its metadata service and NATS
        nats_srv.stop()
        time.sleep(6.0)  # ~24 failed metadata polls, ~12 reconnect attempts
        counts = Counter(e["event"] for e in _events(log)) - before
        assert counts["nats_disconnected"] == 1, counts
        assert 2 <= counts["nats_unreachable"] <= 4, counts  # again 1, 2, 4, 8: the count restarted
        assert 2 <= counts["metadata_poll_failed"] <= 6, counts  # 1, 2, 4, 8, 16 (~24 failed polls)
        nats_srv = NatsServer(tmp_path / "nats2", port=port).start()  # back, same address (the metadata not)
        wait_until(lambda: "nats_reconnected" in log.read_text(), 20, "the reconnect", every_s=0.1)
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(30) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
        if nats_srv is not None:
            nats_srv.cleanup()
        md.stop()
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    counts = Counter(e["event"] for e in _events(log))
    assert counts["nats_reconnected"] == 1 and counts["agent_leaving"] == 1, counts
    assert counts["metadata_poll_failed"] <= 7, counts


def test_agent_leaves_when_its_parent_dies_before_nats_answers(tmp_path: Path) -> None:
    """A local node whose orchd died (SIGKILL: nothing stopped it) while the agent was still trying to
    reach NATS: ``--exit-with-parent`` ends it anyway, quietly."""
    log = tmp_path / "agent.log"
    args = [sys.executable, "-m", "agent.main", "--node-id", "n-orphan", "--exit-with-parent",
            "--nats-url", f"nats://127.0.0.1:{free_port()}", "--work-dir", str(tmp_path / "work")]
    # the parent starts the agent, waits until it is trying to reach NATS, and exits (as orchd killed -9)
    spawn = ("import pathlib, subprocess, sys, time; "
             f"p = subprocess.Popen({args!r}, stdout=open({str(log)!r}, 'ab'), stderr=subprocess.STDOUT, "
             "stdin=subprocess.DEVNULL, start_new_session=True); print(p.pid, flush=True); t = time.time() + 30\n"
             f"while 'nats_unreachable' not in pathlib.Path({str(log)!r}).read_text() and time.time() < t: "
             "time.sleep(0.1)")
    parent = subprocess.run([sys.executable, "-c", spawn], cwd=ROOT, capture_output=True, text=True, check=True)
    agent = psutil.Process(int(parent.stdout.split()[0]))  # the parent has exited: the agent is an orphan
    try:
        assert "nats_unreachable" in log.read_text()
        wait_until(lambda: not agent.is_running() or agent.status() == psutil.STATUS_ZOMBIE, 15,
                   "the orphaned agent to leave", every_s=0.1)
    finally:
        if agent.is_running() and agent.status() != psutil.STATUS_ZOMBIE:
            agent.kill()
    text = log.read_text()
    assert '"parent_exited"' in text and "Traceback" not in text, text[-3000:]
