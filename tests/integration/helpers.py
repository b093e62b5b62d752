"""Helpers of the shell's integration tests: settings, a simulated agent, publishers.

The simulated agent is a real NATS subscriber on ``orch.cmd.>`` that acknowledges every command with a
``CommandAck`` (as orch-agent does) and records what it received.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import msgspec

import wire as ev
from orchestrator.settings import load_settings

POOL = ev.PoolKey(cloud="fake", region="r1", zone="r1a", instance_type="gpu.small", market=ev.Market.SPOT)
POOL_OD = ev.PoolKey(cloud="fake", region="r1", zone="r1a", instance_type="gpu.small", market=ev.Market.ON_DEMAND)

JOB_TOML = """
name = "itest"
total_steps = 1000
gpu_type = "A100"
gpus_per_node = 1
nodes = {nodes}
nodes_min = 1
nodes_max = {nodes}
clouds = ["fake"]
market = "spot_with_fallback"
[checkpoint]
url = "file:///tmp/orch-itest-ckpt"
interval_s = 600
"""


def write_config(tmp: Path, nats_url: str, *, metrics_port: int = 0, extra: str = "") -> Path:
    state = tmp / "state"
    cfg = tmp / "orchd.toml"
    cfg.write_text(f"""
[nats]
urls = ["{nats_url}"]
reconnect_wait_s = 0.2
[daemon]
state_dir = "{state}"
tick_s = 0.5
price_confirm_s = 0.0
heartbeat_interval_s = 1.0
heartbeat_timeout_s = 5.0
command_ack_timeout_s = 1.0
command_retries = 3
shutdown_grace_s = 5.0
[metrics]
port = {metrics_port}
[log]
level = "info"
format = "json"
{extra}
""")
    return cfg


def settings_for(tmp: Path, nats_url: str, **kw: Any):
    return load_settings(write_config(tmp, nats_url, **kw), env={})


def price(pool: ev.PoolKey = POOL, usd: float = 1.0, od: float = 3.0, ts: float | None = None) -> ev.PriceTick:
    ts = ts or time.time()
    return ev.PriceTick(id=f"p-{pool.name}-{ts}", pool=pool, gpu_type="A100", gpus_per_node=1,
                        price_usd_h=usd, on_demand_usd_h=od, ts=ts)


async def publish_js(js: Any, subject: str, msg: msgspec.Struct, msg_id: str | None = None) -> Any:
    mid = msg_id or getattr(msg, "id", None) or uuid.uuid4().hex
    return await js.publish(subject, ev.encode(msg), headers={"Nats-Msg-Id": mid})


class SimAgent:
    """Acks every command on orch.cmd.> and records them (node_id -> list of commands)."""

    def __init__(self, nc: Any, *, ack: bool = True, fencing: bool = False) -> None:
        self.nc = nc
        self.ack = ack
        self.fencing = fencing  # refuse commands with a token below the highest seen, as agents do
        self.highest_token = 0
        self.refused: list[Any] = []
        self.received: list[Any] = []
        self.arrival: dict[str, float] = {}
        self.sub = None

    async def start(self) -> SimAgent:
        async def on_cmd(msg: Any) -> None:
            cmd = ev.decode(msg.data)
            self.arrival.setdefault(cmd.cmd_id, time.time())
            self.received.append(cmd)
            if not (self.ack and msg.reply):
                return
            if self.fencing and cmd.fencing_token < self.highest_token:
                self.refused.append(cmd)
                await msg.respond(ev.encode(ev.CommandAck(cmd_id=cmd.cmd_id, node_id=cmd.node_id, ok=False,
                                                          error="stale_fencing_token", ts=time.time())))
                return
            self.highest_token = max(self.highest_token, cmd.fencing_token)
            await msg.respond(ev.encode(ev.CommandAck(cmd_id=cmd.cmd_id, node_id=cmd.node_id, ok=True,
                                                      ts=time.time())))

        self.sub = await self.nc.subscribe("orch.cmd.>", cb=on_cmd)
        await self.nc.flush()
        return self

    def of_kind(self, cls: type) -> list[Any]:
        return [c for c in self.received if isinstance(c, cls)]


def ctl(url: str, *argv: str) -> tuple[int, str, str]:
    """orchctl in this process against ``url``: (exit code, stdout, stderr)."""
    from orchestrator.cli import main as cli

    out: list[str] = []
    err: list[str] = []
    code = cli.main(["--server", url, "--timeout", "10", *argv], out=out.append, err=err.append)
    return code, "".join(out), "".join(err)


async def actl(url: str, *argv: str) -> tuple[int, str, str]:
    """``ctl`` in a worker thread (orchctl runs its own event loop)."""
    return await anyio.to_thread.run_sync(lambda: ctl(url, *argv))


async def wait_for(pred: Any, timeout: float = 10.0, interval: float = 0.05) -> Any:
    with anyio.fail_after(timeout):
        while True:
            v = pred()
            if v:
                return v
            await anyio.sleep(interval)


async def start_enrolling_agent(tg: Any, d: Any, inst: Any, token: str, url: str,
                                work_dir: Path) -> tuple[anyio.CancelScope, dict]:
    """A real orch-agent for ``inst`` that enrols with ``token`` (per-node credentials), started in
    ``tg``; returns once orchd has its heartbeats: (the agent's cancel scope, its stored credential)."""
    import json

    from agent.config import AgentConfig
    from agent.main import Agent

    agent = Agent(AgentConfig(node_id=inst.node_id, nats_urls=(url,), enrol_token=token, instance_id=inst.instance_id,
                              pool=inst.pool, work_dir=str(work_dir), heartbeat_s=0.2, metadata="none"))
    scope = anyio.CancelScope()

    async def run_agent() -> None:
        with scope, contextlib.suppress(ConnectionResetError):  # its credential revoked under it
            await agent.run()

    tg.start_soon(run_agent)
    await wait_for(lambda: d.state.nodes.get(inst.node_id) is not None and d.state.nodes[inst.node_id].last_seen > 0,
                   timeout=15)
    return scope, json.loads((work_dir / "nats-credential.json").read_text())


async def running_job(d: Any, cloud: Any, nc: Any, agent: SimAgent, tmp: Path, url: str, job_id: str,
                      nodes: int = 2) -> list[Any]:
    """A job of ``nodes`` fake-cloud nodes training under orchd ``d``: priced pools, the submit, every node
    registered, the generation started (its ``StartGenerationCmd``s, returned) and one training heartbeat
    each."""
    js = nc.jetstream()
    await publish_js(js, ev.subject_price("fake", "r1"), price(POOL, 1.0, 3.0))
    await publish_js(js, ev.subject_price("fake", "r1"), price(POOL_OD, 3.0, 3.0))
    await wait_for(lambda: len(d.state.pools) == 2)
    spec = tmp / f"{job_id}.toml"
    spec.write_text(JOB_TOML.format(nodes=nodes).replace("orch-itest-ckpt", f"orch-itest-ckpt-{tmp.name}-{job_id}"))
    code, _out, err = await actl(url, "jobs", "submit", str(spec), "--id", job_id)
    assert code == 0, err
    await wait_for(lambda: len(cloud.all_instances()) == nodes)
    for inst in cloud.all_instances():
        reg = ev.NodeRegistered(id=f"reg-{inst.node_id}", node_id=inst.node_id, instance_id=inst.instance_id,
                                pool=inst.pool, host="127.0.0.1", ts=time.time())
        await publish_js(js, ev.subject_node_event(inst.node_id), reg)
    starts: list[Any] = await wait_for(lambda: len(agent.of_kind(ev.StartGenerationCmd)) == nodes
                                       and agent.of_kind(ev.StartGenerationCmd))
    for c in starts:
        hb = ev.Heartbeat(node_id=c.node_id, seq=1, ts=time.time(), state=ev.AgentState.TRAINING,
                          job_id=c.job_id, generation=c.generation, step=5)
        await nc.publish(ev.subject_heartbeat(c.node_id), ev.encode(hb))
    await wait_for(lambda: d.state.jobs[job_id].phase == "running")
    return starts
