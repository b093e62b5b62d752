"""Partitions across real network namespaces (simulations/chaos/netns.py, partitions.py; docs/chaos.md).

The topology helper: every namespace, link and process it made is gone after a normal exit, an exception,
SIGINT and SIGTERM (also Ctrl-C of the drill command mid-drill); what a SIGKILLed driver left is swept by
the next one; cut/heal, one-way blocks and
random drops really change what crosses a link (TCP connects and UDP counts over the bridge); ``delay`` says
why it cannot (no netem). The drills' trainer (``parttrainer``, the ranks of the real orch-agent in the
drills) and the store scoring of ``commits_from_given_up`` (no root needed). Then the CI set of partition
drills (``partitions.CI_DRILLS``, seeded, every drill) with every goal asserted.

Needs root, ``ip`` and ``iptables`` (.ci/run installs them): skipped with the reason elsewhere, a failure
under ORCH_CI=1.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from simulations.chaos import netns, partitions, partscore
from tests.conftest import IN_CI

# namespaces, a bridge and a subnet per driver process: the drills of this file run on one xdist worker
pytestmark = pytest.mark.xdist_group("netns")

ROOT = Path(__file__).resolve().parents[2]

SERVER = r"""
import socket, sys, threading
ip = sys.argv[1]
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); udp.bind((ip, 9001))
count = [0]
def rx():
    while True:
        udp.recv(64); count[0] += 1
threading.Thread(target=rx, daemon=True).start()
tcp = socket.socket(); tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); tcp.bind((ip, 9000)); tcp.listen(16)
print("listening", flush=True)
while True:
    c, _ = tcp.accept(); c.sendall(str(count[0]).encode()); c.close()
"""


@pytest.fixture(scope="module")
def namespaces() -> None:
    reason = netns.unavailable()
    if reason:
        if IN_CI:
            pytest.fail(f"partition drills must run in CI: {reason} (.ci/run installs iproute2 and iptables)")
        pytest.skip(reason)


def _hold(mode: str, n: int) -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen([sys.executable, "-m", "simulations.chaos.netns", mode, str(n)], cwd=ROOT,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.startswith("ready"), (line, p.stderr.read() if p.stderr else "")
    return p, p.pid


def _sleepers(pid: int) -> list[str]:
    return netns.leftovers(pid)["processes"]


def test_bad_fault_arguments_are_refused() -> None:
    topo = netns.Topology()
    with pytest.raises(netns.TopologyError, match="drop share"):
        topo.drop("any", 1.5)
    with pytest.raises(netns.TopologyError, match="direction"):
        topo.block("any", "sideways")


def test_delay_says_why_it_cannot(namespaces: None) -> None:
    """This kernel has no netem: ``delay`` refuses with that reason instead of pretending."""
    topo = netns.Topology()
    with pytest.raises(netns.TopologyError, match="delay must be > 0"):
        topo.delay("any", 0)
    reason = netns.netem_unavailable()
    if reason is None:
        pytest.skip("this kernel has netem: links can be delayed")
    assert "netem" in reason
    with pytest.raises(netns.TopologyError, match="cannot delay any's link: this kernel has no netem"):
        topo.delay("any", 100)
    assert not [n for n in netns.leftovers(topo.pid)["namespaces"] if n.endswith("-netem")]


def _trainer(tmp_path: Path, generation: int, resume: str, total: int = 1000) -> subprocess.Popen[str]:
    env = {**os.environ, "RANK": "0", "ORCH_GENERATION": str(generation), "ORCH_TOTAL_STEPS": str(total),
           "ORCH_CKPT_URL": f"file://{tmp_path}/ck", "ORCH_RESUME_FROM": resume, "ORCH_JOB_ID": "j",
           "ORCH_TRAINER_ARGS": json.dumps({"step_time_s": 0.01}), "CHAOS_NODE_ID": "n1",
           "CHAOS_JOURNAL": str(tmp_path / "journal.jsonl"), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "simulations.chaos.parttrainer"], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, text=True)


def test_the_drills_trainer_checkpoints_on_request_and_resumes(tmp_path: Path) -> None:
    """parttrainer (the ranks of the drills' agents): steps, a checkpoint on SIGUSR1 then exit 75, a resume
    from the commit marker's step, exit 78 when the checkpoint to resume from has no marker."""
    p = _trainer(tmp_path, 1, "")
    assert p.stdout is not None
    first = p.stdout.readline()
    assert '"orch":"step"' in first.replace(" ", ""), first
    p.send_signal(signal.SIGUSR1)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 75, out
    (ckpt,) = sorted((tmp_path / "ck").glob("step_*"))
    marker = json.loads((ckpt / "COMMITTED").read_text())
    assert marker["node_id"] == "n1" and marker["generation"] == 1 and ckpt.name == f"step_{marker['step']:09d}"
    assert [w["step"] for w in partscore.store_writes(tmp_path / "ck")] == [marker["step"]]
    p = _trainer(tmp_path, 2, f"file://{ckpt}", total=marker["step"] + 3)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0, out
    assert (tmp_path / "ck" / f"step_{marker['step'] + 3:09d}" / "COMMITTED").exists()
    (ckpt / "COMMITTED").unlink()
    p = _trainer(tmp_path, 3, f"file://{ckpt}")
    p.communicate(timeout=30)
    assert p.returncode == 78
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "journal.jsonl").read_text().splitlines()]
    assert kinds == ["start", "ckpt", "exit", "start", "ckpt", "exit", "start", "exit"]


def test_commits_from_given_up_nodes_are_read_from_the_store(tmp_path: Path) -> None:
    """The scoring of ``commits_from_given_up``: a save by a node after orchd removed it as lost, in a
    checkpoint the job resumed from or orchd accepted, counts; a save before the removal does not."""
    for step, node, t in ((10, "n1", 100.0), (20, "n2", 100.0), (30, "n1", 300.0), (40, "n1", 300.0)):
        d = tmp_path / f"step_{step:09d}"
        d.mkdir()
        (d / f"rank0-g1-{node}.json").write_text(json.dumps({"step": step, "node_id": node, "generation": 1, "t": t}))
    url = f"file://{tmp_path}/step_"
    entries = [{"action": "remove_node", "ts": 200.0, "details": {"node_id": "n1", "lost": True}},
               {"action": "checkpoint_committed", "ts": 310.0, "details": {"url": f"{url}000000040"}}]
    records = [{"t": 250.0, "kind": "cmd", "host": "a", "msg": {"type": "start_generation", "job_id": "j",
                                                                "resume_from": f"{url}000000030"}},
               {"t": 250.0, "kind": "cmd", "host": "b", "msg": {"type": "start_generation", "job_id": "j",
                                                                "resume_from": f"{url}000000010"}}]
    assert partscore.given_up_commits(tmp_path, records, entries, "j") == [f"{url}000000030", f"{url}000000040"]
    assert partscore.given_up_commits(tmp_path, records, entries[1:], "j") == []  # n1 never given up on


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cleanup_on_signal(namespaces: None, sig: int) -> None:
    p, pid = _hold("hold", 3)
    made = netns.leftovers(pid)
    assert len(made["namespaces"]) == 4 and made["links"] and len(made["processes"]) == 3  # 3 hosts + the hub
    p.send_signal(sig)
    p.communicate(timeout=30)
    assert p.returncode != 0
    assert netns.leftovers(pid) == {"namespaces": [], "links": [], "processes": []}
    for proc in made["processes"]:
        assert not netns._pid_alive(int(proc)), f"process {proc} survived"


def test_cleanup_on_failure(namespaces: None) -> None:
    p, pid = _hold("fail", 2)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 1 and "failing on purpose" in err
    assert netns.leftovers(pid) == {"namespaces": [], "links": [], "processes": []}


def test_sigkilled_driver_is_swept(namespaces: None) -> None:
    p, pid = _hold("hold", 2)
    procs = netns.leftovers(pid)["processes"]
    p.kill()
    p.wait(10)  # reaped: its pid is dead
    assert netns.leftovers(pid)["namespaces"], "SIGKILL leaves everything behind"
    assert {f"{netns.PREFIX}{pid}-hub", f"{netns.PREFIX}{pid}-n0"} <= set(netns.sweep())
    assert netns.leftovers(pid)["namespaces"] == []
    time.sleep(0.2)
    assert not any(netns._pid_alive(int(x)) for x in procs)  # gone, or a zombie waiting for init


def test_ctrl_c_during_a_drill_cleans_up(namespaces: None) -> None:
    """The command interrupted mid-drill (servers, both orchd and an agent up): nothing is left."""
    p = subprocess.Popen([sys.executable, "-m", "simulations.chaos", "--partitions", "--drills", "agent_short"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not any(n.endswith("-agent1") for n in netns.leftovers(p.pid)["namespaces"]):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-2000:]
        time.sleep(0.2)
    made = netns.leftovers(p.pid)
    assert len(made["namespaces"]) >= 7 and len(made["processes"]) >= 6  # hub, 3 servers, 2 orchd, an agent
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=60)
    assert p.returncode != 0
    assert netns.leftovers(p.pid) == {"namespaces": [], "links": [], "processes": []}
    assert not any(netns._pid_alive(int(x)) for x in made["processes"])


def _connects(ip: str) -> bool:
    try:
        with socket.create_connection((ip, 9000), timeout=0.7) as c:
            c.recv(16)
        return True
    except OSError:
        return False


def _count(ip: str) -> int:
    with socket.create_connection((ip, 9000), timeout=5) as c:
        return int(c.recv(16))


def test_cut_block_and_drop_change_what_crosses(namespaces: None, tmp_path: Path) -> None:
    with netns.Topology() as topo:
        host = topo.add_host("srv")
        proc = topo.spawn("srv", [sys.executable, "-c", SERVER, host.ip], log=tmp_path / "srv.log")
        deadline = time.monotonic() + 20
        while "listening" not in (tmp_path / "srv.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "srv.log").read_text()
            time.sleep(0.05)
        assert _connects(host.ip)
        topo.cut("srv")
        assert not _connects(host.ip)
        topo.heal("srv")
        assert _connects(host.ip)
        for direction in ("in", "out"):
            topo.block("srv", direction)
            assert not _connects(host.ip), direction
            topo.clear("srv")
            assert _connects(host.ip)
        before = _count(host.ip)
        topo.drop("srv", 0.3)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            for _ in range(400):
                udp.sendto(b"x", (host.ip, 9001))
                time.sleep(0.001)
        topo.clear("srv")
        time.sleep(0.3)
        got = _count(host.ip) - before
        assert 200 <= got <= 360, f"{got} of 400 datagrams crossed a 30% drop (expected about 280)"
        assert [f[1:] for f in topo.faults] == [("srv", "cut"), ("srv", "heal"), ("srv", "block_in"), ("srv", "clear"),
                                                ("srv", "block_out"), ("srv", "clear"), ("srv", "drop_0.3"),
                                                ("srv", "clear")]
        pid = topo.pid
    assert netns.leftovers(pid) == {"namespaces": [], "links": [], "processes": []}


def test_partition_drills(namespaces: None, tmp_path: Path) -> None:
    """The CI set: every drill's goals (0 lost jobs, duplicate launches, split-brain actions, needless
    recoveries, lost events, ...) and its own assertions (``Drill.problems``)."""
    t0 = time.monotonic()
    drills = anyio.run(lambda: partitions.run(7, tmp_path, drills=partitions.CI_DRILLS, drop_s=10.0),
                       backend="asyncio")
    out = partitions.summary(drills, 7, time.monotonic() - t0)
    report = {d["name"]: (d["facts"], d["problems"]) for d in out["drills"]}
    assert out["drills_run"] == len(partitions.CI_DRILLS)
    failed = {n: report[n] for n in out["drills_failed"]}  # each failed drill's problems and facts, whole
    assert out["drills_failed"] == [], json.dumps(failed, default=str)
    for k in partitions.ZERO:
        assert out[k] == 0, (k, report)
    facts = {d["name"]: d["facts"] for d in out["drills"]}
    assert facts["agent_short"]["suspected"] == 0
    assert facts["agent_long"]["suspected"] and facts["agent_long"]["kept"] and facts["agent_long"]["provider_checked"]
    assert facts["agent_gone"]["given_up_s"] is not None and not facts["agent_gone"]["zombie_commit_accepted"]
    assert facts["leader_cut"]["takeover_s"] <= 2 * facts["leader_cut"]["lease_ttl_s"]
    assert facts["leader_cut"]["old_standby_after_heal"]
    assert facts["drops"]["notice_to_command_s"] <= partitions.NOTICE_S
    for name in ("asymmetric_out", "asymmetric_in"):
        assert facts[name]["notice_to_command_s"] <= partitions.NOTICE_S
    # the hosts ran the real orch-agent, whose ranks (parttrainer) committed into each job's checkpoint root
    started = [f for f in tmp_path.glob("agent*/agent.log") if '"event": "agent_started"' in f.read_text()]
    assert len(started) >= len(partitions.CI_DRILLS), started
    for d in out["drills"]:
        assert list((tmp_path / "checkpoints").glob(f"{d['job_id']}*/step_*/COMMITTED")), d["name"]
