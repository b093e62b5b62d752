"""``orchctl nodes preempt`` / ``nodes kill`` on a real orchd (subprocess) with the local provider.

A 2-node job of the contract-following fake trainer runs on local nodes (agent processes):
- preempt with a notice: the node's metadata service announces the reclaim, the agent reports it and
  relays the emergency checkpoint, orchd checkpoints the job, the node is killed at the deadline, the job
  runs again from the committed step (new generation, steps beyond it);
- kill: every process of a node dies with no notice; orchd finds the node gone and the job runs again;
- a node of another provider (the fake cloud) is refused with a clear error; an unknown node is 404,
  a notice outside 0 .. 3600 s is a bad request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import nats
import psutil
import pytest

from tests.integration import helpers as h
from tests.integration.local_orchd import LocalOrchd, local_job, wait_until
from wire import subject_price

pytestmark = pytest.mark.anyio


def _job(orchd: LocalOrchd, job: str) -> dict[str, Any]:
    return orchd.ctl_json("jobs", "show", job)["summary"]


def _nodes(orchd: LocalOrchd, job: str) -> dict[str, dict[str, Any]]:
    return {n["node_id"]: n for n in orchd.ctl_json("nodes", "list", "--job", job)["nodes"]}


def _training_again(orchd: LocalOrchd, job: str, after_generation: int, past_step: int) -> bool:
    """A later generation runs and some node reports a step beyond ``past_step``."""
    s = _job(orchd, job)
    running = [n for n in _nodes(orchd, job).values() if n["phase"] == "running" and n["generation"] > after_generation]
    return s["generation"] > after_generation and any(n["step"] > past_step for n in running)


def _running(orchd: LocalOrchd, job: str, n: int) -> list[str]:
    nodes = _nodes(orchd, job)
    ids = sorted(k for k, v in nodes.items() if v["phase"] == "running" and v["step"] > 0)
    return ids if len(ids) >= n else []


def _agent_pid(orchd: LocalOrchd, node: str) -> psutil.Process:
    for p in orchd.processes():
        if f"--node-id {node} " in " ".join(p.cmdline()) + " ":
            return p
    raise AssertionError(f"no agent process for {node}")


async def test_preempt_and_kill_local_nodes_the_job_recovers(server: Any, tmp_path: Path) -> None:
    fake_state = tmp_path / "fake.json"
    orchd = LocalOrchd(tmp_path, server.url, extra=f'[providers.fake]\nstate_file = "{fake_state}"\n')
    await anyio.to_thread.run_sync(orchd.start)
    nc = await nats.connect(server.url)
    try:
        await h.publish_js(nc.jetstream(), subject_price("fake", "r1"), h.price())
        fake_job = tmp_path / "fake-job.toml"
        fake_job.write_text(h.JOB_TOML.format(nodes=1).replace("/tmp/orch-itest-ckpt", str(tmp_path / "fake-ckpt")))
        assert (await h.actl(server.url, "jobs", "submit", str(fake_job), "--id", "jf"))[0] == 0
        assert (await h.actl(server.url, "jobs", "submit", str(local_job(tmp_path)), "--id", "j1"))[0] == 0
        await anyio.to_thread.run_sync(lambda: _run_faults(orchd))
    finally:
        await nc.close()
        await anyio.to_thread.run_sync(orchd.stop)
        await anyio.to_thread.run_sync(orchd.kill_all)


def _run_faults(orchd: LocalOrchd) -> None:
    # --- refusals first (the local job is still starting) ---
    fake_node = wait_until(lambda: next(iter(_nodes(orchd, "jf")), None), 30, "the fake cloud's node")
    for argv in (("nodes", "preempt", fake_node, "--notice", "5"), ("nodes", "kill", fake_node)):
        code, out, err = orchd.ctl(*argv)
        assert code == 1 and "'fake'" in err and "only into the local provider's nodes" in err, (argv, code, out, err)
    code, _, err = orchd.ctl("nodes", "kill", "no-such-node")
    assert code == 66 and "no node 'no-such-node'" in err, err
    code, _, err = orchd.ctl("nodes", "preempt", fake_node, "--notice", "-1")
    assert code == 2, err  # a usage error (argparse says why on stderr), before orchd is asked

    # --- preempt with a notice: checkpoint at the notice, killed at the deadline, recovery ---
    _, victim = wait_until(lambda: _running(orchd, "j1", 2), 90, "2 local nodes training")
    gen = _job(orchd, "j1")["generation"]
    agent = _agent_pid(orchd, victim)
    code, out, err = orchd.ctl("nodes", "preempt", victim, "--notice", "3")
    assert code == 0 and "injected" in out, (code, out, err)
    code, _, err = orchd.ctl("nodes", "preempt", victim, "--notice", "3")  # a second one while it is pending
    assert code == 1 and "pending already" in err, err
    wait_until(lambda: _job(orchd, "j1")["committed_step"] > 0, 30, "the emergency checkpoint")
    committed = _job(orchd, "j1")["committed_step"]
    agent.wait(30)  # killed at the deadline at the latest
    wait_until(lambda: victim not in _nodes(orchd, "j1"), 30, "orchd to drop the preempted node")
    wait_until(lambda: _training_again(orchd, "j1", gen, committed), 60, "the job to run again after the preemption")
    agent_log = (orchd.nodes_dir / victim / "agent.log").read_text()
    assert '"spot_notice_received"' in agent_log and '"emergency": true' in agent_log  # the cloud's notice path

    # --- kill: no notice; orchd finds the node gone and recovers ---
    gen = _job(orchd, "j1")["generation"]
    victim = _running(orchd, "j1", 1)[0]
    agent = _agent_pid(orchd, victim)
    code, out, err = orchd.ctl("nodes", "kill", victim)
    assert code == 0 and "killed" in out, (code, out, err)
    assert not agent.is_running() or agent.status() == psutil.STATUS_ZOMBIE
    wait_until(lambda: victim not in _nodes(orchd, "j1"), 30, "orchd to see the killed node gone")
    wait_until(lambda: _training_again(orchd, "j1", gen, 0), 60, "the job to run again after the kill")
    assert _job(orchd, "j1")["phase"] not in ("failed", "cancelled")
    code, _, err = orchd.ctl("nodes", "kill", victim)
    assert code == 66, err  # gone from orchd's state
