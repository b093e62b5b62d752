"""Crash and outage behaviour with real processes: orchd killed with SIGKILL and restarted (same state,
no duplicate launch - counted on the cloud side, in the file-backed fake cloud), a NATS server restart
(no lost event), and orchctl failing fast against a dead daemon or a dead server."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import nats
import pytest

import wire as ev
from orchestrator.daemon.run import run_daemon
from orchestrator.natsserver import NatsServer
from simulations.fakecloud import read_fake_file
from tests.conftest import free_port
from tests.integration import helpers as h
from tests.integration.helpers import actl, ctl

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[2]




class Orchd:
    """orchd as a real subprocess (python -m orchestrator.daemon --config FILE)."""

    def __init__(self, cfg: Path, log: Path) -> None:
        self.cfg, self.log = cfg, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> Orchd:
        disc = Path(json.loads(json.dumps(str(self.cfg.parent / "state" / "orchd.json"))))
        if disc.exists():
            disc.unlink()
        with open(self.log, "a") as err:  # the child keeps its own descriptor
            self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator.daemon", "--config", str(self.cfg)],
                                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.time() + 30
        while not disc.exists():
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.time() < deadline, "orchd did not start"
            time.sleep(0.05)
        return self

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


async def test_kill9_mid_job_restart_same_state_no_duplicate_launch(server, tmp_path):
    url = server.url
    fake_file = tmp_path / "fake.json"
    cfg = h.write_config(tmp_path, url,
                         extra=f'[providers]\nenabled = ["fake"]\n[providers.fake]\nstate_file = "{fake_file}"\n')
    nc = await nats.connect(url)
    js = nc.jetstream()
    agent = await h.SimAgent(nc).start()
    orchd = await anyio.to_thread.run_sync(Orchd(cfg, tmp_path / "orchd.log").start)
    try:
        await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL, 1.0, 3.0))
        await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL_OD, 3.0, 3.0))
        spec = tmp_path / "job.yaml"
        spec.write_text("name: crashy\ntotal_steps: 100\ngpu_type: A100\nnodes: 3\nnodes_max: 3\n"
                        "clouds: [fake]\ncheckpoint:\n  url: file:///tmp/crashy\n")
        await anyio.sleep(0.5)
        code, out, err = await actl(url, "jobs", "submit", str(spec), "-o", "json")
        assert code == 0, err
        job_id = json.loads(out)["job_id"]
        # SIGKILL right after the submit was acknowledged: the Launch is in the outbox, maybe executed
        await anyio.to_thread.run_sync(orchd.kill9)
        await anyio.to_thread.run_sync(orchd.start)
        await h.wait_for(lambda: len(read_fake_file(fake_file)) >= 3, timeout=30)
        insts = read_fake_file(fake_file)
        for inst in insts:
            reg = ev.NodeRegistered(id=f"reg-{inst.node_id}", node_id=inst.node_id, instance_id=inst.instance_id,
                                    pool=inst.pool, host="127.0.0.1", ts=time.time())
            await h.publish_js(js, ev.subject_node_event(inst.node_id), reg)
        await h.wait_for(lambda: len({c.node_id for c in agent.of_kind(ev.StartGenerationCmd)}) == 3, timeout=30)
        code, before, err = await actl(url, "jobs", "show", job_id, "-o", "json")
        assert code == 0, err
        # mid-job: kill -9 again, restart, same state
        await anyio.to_thread.run_sync(orchd.kill9)
        await anyio.to_thread.run_sync(orchd.start)
        code, after, err = await actl(url, "jobs", "show", job_id, "-o", "json")
        assert code == 0, err
        b, a = json.loads(before), json.loads(after)
        for key in ("phase", "generation", "nodes", "zone"):
            assert a["job"][key] == b["job"][key], (key, b["job"], a["job"])
        assert sorted(n["node_id"] for n in a["nodes"]) == sorted(n["node_id"] for n in b["nodes"])
        await anyio.sleep(1.5)  # several ticks of the restarted daemon
        insts = read_fake_file(fake_file)
        assert len(insts) == 3, [i.instance_id for i in insts]  # no duplicate launch on the cloud side
        assert len({i.node_id for i in insts}) == 3
        code, out, _ = await actl(url, "status", "-o", "json")
        assert json.loads(out)["fencing_token"] >= 3  # every start took a new lease revision
        assert orchd.stop() == 0  # SIGTERM: clean shutdown
    finally:
        if orchd.proc and orchd.proc.poll() is None:
            orchd.proc.kill()
        await nc.close()


async def test_nats_server_restart_loses_no_event(tmp_path):
    port = free_port()
    server = NatsServer(tmp_path / "nats", port=port).start()
    settings = h.settings_for(tmp_path, server.url)
    pub = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1,
                             error_cb=_quiet, disconnected_cb=_quiet_cb, reconnected_cb=_quiet_cb)
    js = pub.jetstream(timeout=1.0)
    n = 60
    pools = [ev.PoolKey(cloud="fake", region="r1", zone=f"z{i}", instance_type="gpu.small", market=ev.Market.SPOT)
             for i in range(n)]

    async def publish(i: int) -> None:
        msg = h.price(pools[i], 1.0 + i / 100, 3.0)
        while True:  # retry with the same Nats-Msg-Id until stored (dedup makes it exactly once)
            try:
                await js.publish(ev.subject_price("fake", "r1"), ev.encode(msg), headers={"Nats-Msg-Id": f"px-{i}"})
                return
            except Exception:
                await anyio.sleep(0.1)

    try:
        async with anyio.create_task_group() as tg:
            d = await tg.start(lambda task_status: run_daemon(settings, {}, task_status=task_status))
            for i in range(n // 2):
                await publish(i)
            await anyio.to_thread.run_sync(server.restart)
            for i in range(n // 2, n):
                await publish(i)
            def seen() -> set[str]:
                return {p.pool.zone for p in d.state.pools.values() if p.pool.market == ev.Market.SPOT}

            await h.wait_for(lambda: len(seen()) == n and d.connected, timeout=30)
            assert seen() == {p.zone for p in pools}
            prices = {p.pool.zone: p.price_usd_h for p in d.state.pools.values() if p.pool.market == ev.Market.SPOT}
            assert all(abs(prices[f"z{i}"] - (1.0 + i / 100)) < 1e-9 for i in range(n))
            assert d.state.meta.bus_connected is True
            code, out, err = await actl(server.url, "status", "-o", "json")
            assert code == 0, err
            d.request_stop()
    finally:
        await pub.close()
        server.cleanup()


async def _quiet(_e: Exception) -> None:
    pass


async def _quiet_cb() -> None:
    pass


def test_orchctl_fails_fast_without_server_or_daemon(server):
    dead = f"nats://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    code, _, err = ctl(dead, "status")
    assert code == 69 and "unreachable" in err and time.monotonic() - t0 < 5  # EXIT_UNREACHABLE
    t0 = time.monotonic()
    code, _, err = ctl(server.url, "jobs", "list")  # a server, no orchd: no responders, at once
    assert code == 69 and "not running" in err and time.monotonic() - t0 < 5
    code, _, err = ctl(server.url, "bogus-command")
    assert code == 2


def test_orchctl_subprocess_exit_code_and_spec_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = ""\ntotal_steps = -1\ngpu_type = "A100"\nnodes = 5\nnodes_max = 2\nmystery = 1\n'
                   '[checkpoint]\nurl = "ftp://x"\nkeep = "three"\n')
    env = {**os.environ, "ORCH_SERVER": f"nats://127.0.0.1:{free_port()}"}
    p = subprocess.run([sys.executable, "-m", "orchestrator.cli", "jobs", "submit", str(bad)], cwd=ROOT,
                       capture_output=True, text=True, env=env, timeout=30)
    assert p.returncode == 2  # the spec is checked before connecting: every bad key in one error
    for key in ("mystery", "checkpoint.keep", "checkpoint.url", "name", "total_steps", "nodes"):
        assert f"- {key}:" in p.stderr, p.stderr
    from orchestrator.jobspec import load_jobspec
    good = ROOT / "config" / "jobs"
    for f in sorted(good.glob("*.toml")) + sorted(good.glob("*.yaml")):
        load_jobspec(f, now=time.time())  # a relative deadline (deadline_in) is resolved at submission


def test_sigterm_during_nats_outage_exits_within_grace(tmp_path):
    """SIGTERM while the NATS server is down: the batch that cannot be persisted is abandoned after
    daemon.shutdown_grace_s (unacked, undispatched: redelivered later), and orchd exits cleanly."""
    server = NatsServer(tmp_path / "nats").start()
    cfg = h.write_config(tmp_path, server.url)
    orchd = Orchd(cfg, tmp_path / "orchd.log").start()
    try:
        server.stop()
        time.sleep(1.0)  # orchd sees the outage: BusState(connected=False) waits to be persisted
        t0 = time.monotonic()
        code = orchd.stop()
        elapsed = time.monotonic() - t0
        assert code == 0, (tmp_path / "orchd.log").read_text()[-2000:]
        assert elapsed < 5.0 * 2 + 8, elapsed  # grace for the loop + grace for the leftovers + closing
    finally:
        if orchd.proc and orchd.proc.poll() is None:
            orchd.proc.kill()
        server.cleanup()


async def test_nats_outage_longer_than_heartbeat_timeout_is_not_node_failure(tmp_path):
    """The NATS server is down for longer than the heartbeat timeout: orchd feeds BusState to the core,
    which pauses failure detection, so no node is suspected, abandoned or terminated."""
    from simulations.fakecloud import FakeCloud

    port = free_port()
    server = NatsServer(tmp_path / "nats", port=port).start()
    settings = h.settings_for(tmp_path, server.url)  # heartbeat_timeout_s = 5
    cloud = FakeCloud()
    opts = dict(max_reconnect_attempts=-1, reconnect_time_wait=0.1, error_cb=_quiet,
                disconnected_cb=_quiet_cb, reconnected_cb=_quiet_cb)
    nc = await nats.connect(server.url, **opts)
    js = nc.jetstream(timeout=1.0)
    agent = await h.SimAgent(nc).start()
    try:
        async with anyio.create_task_group() as tg:
            d = await tg.start(lambda task_status: run_daemon(settings, {"fake": cloud}, task_status=task_status))
            await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL, 1.0, 3.0))
            await h.wait_for(lambda: len(d.state.pools) >= 1)
            code, out, err = await actl(server.url, "jobs", "submit", str(_spec(tmp_path)), "-o", "json")
            assert code == 0, err
            job_id = json.loads(out)["job_id"]
            await h.wait_for(lambda: len(cloud.all_instances()) == 2)
            for inst in cloud.all_instances():
                reg = ev.NodeRegistered(id=f"reg-{inst.node_id}", node_id=inst.node_id, instance_id=inst.instance_id,
                                        pool=inst.pool, host="127.0.0.1", ts=time.time())
                await h.publish_js(js, ev.subject_node_event(inst.node_id), reg)
            starts = await h.wait_for(lambda: len(agent.of_kind(ev.StartGenerationCmd)) == 2 and
                                      agent.of_kind(ev.StartGenerationCmd))

            async def heartbeats() -> None:
                seq = 0
                while True:
                    seq += 1
                    for c in starts:
                        hb = ev.Heartbeat(node_id=c.node_id, seq=seq, ts=time.time(), state=ev.AgentState.TRAINING,
                                          job_id=c.job_id, generation=c.generation, step=seq)
                        with contextlib.suppress(Exception):
                            await nc.publish(ev.subject_heartbeat(c.node_id), ev.encode(hb))
                    await anyio.sleep(1.0)

            tg.start_soon(heartbeats)
            await h.wait_for(lambda: d.state.jobs[job_id].phase == "running")
            sent_before = len(agent.received)
            seq_before = d.events.seq
            await anyio.to_thread.run_sync(server.stop)
            await anyio.sleep(settings.daemon.heartbeat_timeout_s + 2.0)  # silence longer than the timeout
            await anyio.to_thread.run_sync(server.start)
            await h.wait_for(lambda: d.connected and d.state.meta.bus_connected, timeout=20)
            await anyio.sleep(settings.daemon.heartbeat_timeout_s + 1.0)  # the pause after reconnecting, and more
            assert d.state.jobs[job_id].phase == "running"
            assert all(n.suspect_since is None for n in d.state.nodes.values())
            assert len(agent.received) == sent_before  # no checkpoint/abandon/stop sent to anyone
            decided = [e for e in d.events.recent if e["seq"] > seq_before]
            assert not decided, decided  # not even a CheckInstance: nobody was suspected
            assert all(i.alive for i in cloud.all_instances())  # nothing terminated
            d.request_stop()
            tg.cancel_scope.cancel()
    finally:
        await nc.close()
        server.cleanup()


def _spec(tmp_path: Path) -> Path:
    spec = tmp_path / "job.toml"
    spec.write_text(h.JOB_TOML.format(nodes=2))
    return spec
