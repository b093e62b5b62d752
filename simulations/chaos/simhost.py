"""One simulated GPU host as its own process: the agent side of the partition drills.

``python -m simulations.chaos.simhost --nats URL[,URL...] --fake-file F --instance ID --out DIR``

Runs ``agents.SimFleet`` for one instance of the fake cloud (the VM this process stands for), inside the
network namespace the drill put it in, with orch-agent's connection settings (``AGENT_CONNECT``: the
same ping interval, outstanding pings and reconnect wait as agent/connection.py), so it notices a dead
server when orch-agent would. Everything it receives and emits is appended to ``DIR/records.jsonl`` (one
JSON object a line: ``{"t", "kind": "cmd"|"event", "msg"}``) for the drill to score. A file ``DIR/notice``
holding a number N makes it publish a preemption notice with a deadline N seconds ahead (then the file is
renamed ``notice.sent``), as the agent's metadata watcher would. When the instance is gone from the fake
cloud a ``vm_gone`` record marks the end of whatever it was training.

Concurrency contract: one asyncio loop; runs until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import nats

from simulations.chaos.agents import SimFleet

AGENT_CONNECT = {"max_reconnect_attempts": -1, "reconnect_time_wait": 0.5, "connect_timeout": 2,
                 "ping_interval": 10, "max_outstanding_pings": 2}
"""orch-agent's nats.connect options (agent/connection.py)."""


async def _quiet(*_a: Any) -> None:
    pass


async def _dump(fleet: SimFleet, out: Path) -> None:
    done_cmds = done_events = 0
    notice = out / "notice"
    gone: set[str] = set()
    with open(out / "records.jsonl", "a") as f:
        while True:
            for t, cmd in fleet.commands[done_cmds:]:
                f.write(json.dumps({"t": t, "kind": "cmd", "msg": json.loads(_enc(cmd))}) + "\n")
            done_cmds = len(fleet.commands)
            for e in fleet.events[done_events:]:
                f.write(json.dumps({"t": getattr(e, "ts", 0.0), "kind": "event", "msg": json.loads(_enc(e))}) + "\n")
            done_events = len(fleet.events)
            for node in fleet.nodes.values():
                if not node.alive and node.node_id not in gone:  # the VM is gone: its training ends here
                    gone.add(node.node_id)
                    f.write(json.dumps({"t": time.time(), "kind": "event",
                                        "msg": {"type": "vm_gone", "node_id": node.node_id, "job_id": node.job_id,
                                                "generation": node.generation}}) + "\n")
            f.flush()
            if notice.exists() and fleet.nodes:
                deadline_s = float(notice.read_text().strip() or "120")
                notice.rename(out / "notice.sent")
                fleet.publish_notice(next(iter(fleet.nodes)), deadline_s)
            await anyio.sleep(0.05)


def _enc(msg: Any) -> bytes:
    import wire as ev

    return ev.encode(msg)


async def main_async(a: argparse.Namespace) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    nc = await nats.connect(servers=a.nats.split(","), name=f"simhost-{a.instance}", error_cb=_quiet,
                            disconnected_cb=_quiet, reconnected_cb=_quiet, **AGENT_CONNECT)
    fleet = SimFleet(nc, Path(a.fake_file), step_s=a.step_s, hb_s=a.hb_s, only=frozenset({a.instance}))
    async with anyio.create_task_group() as tg:
        await tg.start(fleet.run)
        tg.start_soon(_dump, fleet, out)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
            async for _ in sigs:
                break
        tg.cancel_scope.cancel()
    with anyio.CancelScope(shield=True), anyio.move_on_after(2):
        await nc.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulations.chaos.simhost", description=__doc__)
    p.add_argument("--nats", required=True, help="comma-separated NATS URLs")
    p.add_argument("--fake-file", required=True)
    p.add_argument("--instance", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--hb-s", type=float, default=0.5)
    a = p.parse_args(argv)
    anyio.run(main_async, a, backend="asyncio")
    return 0


if __name__ == "__main__":
    sys.exit(main())
