"""One GPU host of the partition drills with the real orch-agent: the VM, its metadata service, its agent.

``python -m simulations.chaos.realhost --nats URL[,URL...] --fake-file F --instance ID --out DIR --ip A``

Run inside the host's network namespace, it stands for the VM the fake cloud launched as ``ID``:

- **the metadata service**: ``providers.local.metadata.MetadataServer`` on the namespace's own loopback
  (as a cloud's link-local 169.254.169.254: no partition of the host's link cuts it). A file ``DIR/notice``
  holding a number N makes the cloud announce a termination N seconds ahead (AWS ``instance-action``),
  then it is renamed ``notice.sent``: the agent learns of it by polling, as on EC2;
- **orch-agent**, started as the local provider starts a node (providers/local/provider.py):
  ``python -m agent.main --node-id ... --metadata aws --metadata-endpoint URL --cloud-name fake
  --work-dir ... --instance-id ... --pool JSON --advertise-host A --nats-url ...`` with the drills'
  heartbeat interval; its ranks are ``simulations.chaos.parttrainer`` (the job's ``trainer.command``);
- **the VM's end**: when the instance is no longer alive in the fake cloud's file (terminated by orchd,
  or by the driver as a host failure), the agent and its ranks are killed at once (power off).

What the drills score is written to ``DIR/records.jsonl`` (``{"t", "kind": "cmd"|"event", "msg"}``), from
what this host really saw and did, never from orchd: ``cmd`` - each command (first delivery of its
``cmd_id``) that reached this host on ``orch.cmd.<node>`` (a listener in the same namespace, with
orch-agent's connection settings, that never replies); ``event`` - ``generation_started`` /
``checkpoint_committed`` from the trainer's journal (``parttrainer``), ``ranks_exited`` when a rank process
is gone, ``vm_gone`` when the VM ends. Checkpoints themselves are in the job's checkpoint root.

Concurrency contract: one asyncio loop; runs until SIGTERM/SIGINT or the VM's end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats

from providers.local.metadata import MetadataServer
from providers.local.provider import kill_tree
from simulations.chaos.netns import _pid_alive
from simulations.chaos.simhost import AGENT_CONNECT
from simulations.fakecloud import read_fake_file

CLOUD = "fake"
ROOT = Path(__file__).resolve().parents[2]


async def _quiet(*_a: Any) -> None:
    pass


class Host:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.out = Path(a.out)
        self.journal = self.out / "trainer.jsonl"
        self.records = open(self.out / "records.jsonl", "a")  # noqa: SIM115 - closed in run()
        self.seen: set[str] = set()
        self.training: dict[int, dict[str, Any]] = {}  # trainer pid -> its start line
        self.last_gen: dict[str, Any] = {}
        self.gone = False

    def write(self, kind: str, msg: dict[str, Any], t: float | None = None) -> None:
        self.records.write(json.dumps({"t": time.time() if t is None else t, "kind": kind, "msg": msg}) + "\n")
        self.records.flush()

    def on_cmd(self, data: bytes) -> None:
        if self.gone:
            return
        try:
            msg = json.loads(data)
        except ValueError:
            return
        if isinstance(msg, dict) and msg.get("cmd_id") not in self.seen:
            self.seen.add(str(msg.get("cmd_id")))
            self.write("cmd", msg)

    def start_agent(self, inst: Any, md: MetadataServer) -> subprocess.Popen[bytes]:
        a = self.a
        argv = [sys.executable, "-m", "agent.main", "--node-id", str(inst.node_id), "--metadata", "aws",
                "--metadata-endpoint", md.url, "--cloud-name", CLOUD, "--work-dir", str(self.out / "agent"),
                "--instance-id", str(inst.instance_id), "--pool", msgspec.json.encode(inst.pool).decode(),
                "--advertise-host", a.ip, "--heartbeat-s", str(a.hb_s)]
        for u in a.nats.split(","):
            argv += ["--nats-url", u]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
        path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)  # ranks run in the agent's dir
        env.update(PYTHONUNBUFFERED="1", PYTHONPATH=path, CHAOS_NODE_ID=str(inst.node_id),
                   CHAOS_JOURNAL=str(self.journal))
        with open(self.out / "agent.log", "ab") as log:
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)

    def read_journal(self, offset: int) -> int:
        if not self.journal.exists():
            return offset
        with open(self.journal) as f:
            f.seek(offset)
            text = f.read()
        done = text.rfind("\n") + 1
        for line in text[:done].splitlines():
            try:
                j = json.loads(line)
            except ValueError:
                continue
            base = {"node_id": j["node_id"], "job_id": j["job_id"], "generation": j["generation"]}
            if j["kind"] == "start":
                self.training[j["pid"]] = base
                self.last_gen = base
                self.write("event", {"type": "generation_started", **base, "resume_from": j["resume_from"],
                                     "step": j["step"]}, j["t"])
            elif j["kind"] == "ckpt":
                self.write("event", {"type": "checkpoint_committed", **base, "step": j["step"], "url": j["url"]},
                           j["t"])
        return offset + len(text[:done].encode())

    def reap(self) -> None:
        """A rank process that is gone: its generation stopped training on this host."""
        for pid in [p for p in self.training if not _pid_alive(p)]:
            self.write("event", {"type": "ranks_exited", **self.training.pop(pid)})

    def vm_gone(self, agent: subprocess.Popen[bytes]) -> None:
        self.gone = True
        kill_tree(agent.pid)
        agent.wait()
        self.reap()
        self.write("event", {"type": "vm_gone", **(self.last_gen or {"node_id": "", "job_id": None, "generation": 0})})


def _instance(fake_file: str, iid: str) -> Any:
    try:
        return next((i for i in read_fake_file(fake_file) if str(i.instance_id) == iid), None)
    except (OSError, ValueError):
        return None


async def _watch(h: Host, agent: subprocess.Popen[bytes], md: MetadataServer) -> None:
    offset = 0
    notice = h.out / "notice"
    while not h.gone:
        offset = h.read_journal(offset)
        h.reap()
        if notice.exists():
            deadline_s = float(notice.read_text().strip() or "120")
            notice.rename(h.out / "notice.sent")
            md.inject_terminate(time.time() + deadline_s)
        inst = _instance(h.a.fake_file, h.a.instance)
        if inst is not None and not inst.alive:
            h.read_journal(offset)
            h.vm_gone(agent)
            return
        await anyio.sleep(0.05)


async def main_async(a: argparse.Namespace) -> None:
    out = Path(a.out)
    (out / "agent").mkdir(parents=True, exist_ok=True)
    h = Host(a)
    inst = None
    while inst is None:
        inst = _instance(a.fake_file, a.instance)
        await anyio.sleep(0.05)
    nc = await nats.connect(servers=a.nats.split(","), name=f"realhost-{a.instance}", error_cb=_quiet,
                            disconnected_cb=_quiet, reconnected_cb=_quiet, **AGENT_CONNECT)

    async def on_cmd(msg: Any) -> None:
        h.on_cmd(msg.data)

    await nc.subscribe(f"orch.cmd.{inst.node_id}", cb=on_cmd)
    await nc.flush()  # listening before the agent can register: no command goes unrecorded
    md = MetadataServer(instance_name=a.instance).start()
    agent = h.start_agent(inst, md)
    try:
        async with anyio.create_task_group() as tg:
            async def watch() -> None:
                await _watch(h, agent, md)
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
                async for _ in sigs:
                    break
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(2):
            await nc.close()
        if agent.poll() is None:
            kill_tree(agent.pid)
        md.stop()
        h.records.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulations.chaos.realhost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nats", required=True, help="comma-separated NATS URLs")
    p.add_argument("--fake-file", required=True)
    p.add_argument("--instance", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--ip", required=True, help="the host's address (the agent's advertised host)")
    p.add_argument("--hb-s", type=float, default=0.5)
    a = p.parse_args(argv)
    anyio.run(main_async, a, backend="asyncio")
    return 0


if __name__ == "__main__":
    sys.exit(main())
