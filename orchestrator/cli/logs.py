"""``orchctl logs JOB [--node N] [--follow]``: the trainer ranks' output, as shipped by the agents.

Role: read ``LogLine`` records from the JetStream stream ORCH_LOGS (subjects ``orch.logs.<job>.<node>``,
written by every agent's log shipper) with an ordered, ephemeral consumer from the first stored line:
print what is stored and exit, or keep printing new lines with ``--follow`` until interrupted.

Formatting is a pure function (``format_line``); the reader is a thin loop around nats-py.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio

from orchestrator.cli.common import EXIT_OK, EXIT_USAGE, resolve_server
from orchestrator.settings import SettingsError
from wire import LogLine, WireError, decode

LOGS_STREAM = "ORCH_LOGS"


def format_line(rec: LogLine, *, show_node: bool = True) -> str:
    t = time.strftime("%H:%M:%S", time.localtime(rec.ts))
    where = f"{rec.node_id} " if show_node else ""
    err = " !" if rec.stream == "stderr" else ""
    return f"{t} {where}g{rec.generation} r{rec.rank}{err} | {rec.line}"


async def read_logs(urls: list[str], job: str, *, node: str | None = None, follow: bool = False,
                    out: Callable[[str], None], idle_s: float = 1.0, connect_opts: dict[str, Any] | None = None) -> int:
    """Print the stored lines (and new ones with ``follow``). Returns the number of lines printed."""
    import nats
    from nats.js.api import DeliverPolicy
    from nats.js.errors import NotFoundError

    nc = await nats.connect(urls, allow_reconnect=follow, max_reconnect_attempts=-1 if follow else 1,
                            reconnect_time_wait=0.5, connect_timeout=3, error_cb=_quiet, **(connect_opts or {}))
    js = nc.jetstream()
    subject = f"orch.logs.{job}.{node or '*'}"
    printed = 0
    try:
        try:
            info = await js.stream_info(LOGS_STREAM)
        except NotFoundError:
            return 0
        if info.state.messages == 0 and not follow:
            return 0
        sub = await js.subscribe(subject, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=idle_s)
                except nats.errors.TimeoutError:
                    if follow:
                        continue
                    break
                try:
                    rec = decode(msg.data, LogLine)
                except WireError:
                    continue
                out(format_line(rec, show_node=node is None) + "\n")
                printed += 1
                if not follow and msg.metadata.num_pending == 0:
                    break
        finally:
            with anyio.CancelScope(shield=True):
                await sub.unsubscribe()
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(2):
            await nc.close()
    return printed


async def _quiet(_e: Exception) -> None:
    pass


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("logs", parents=[common], help="trainer logs of a job, as shipped by the agents")
    s.add_argument("job_id")
    s.add_argument("--node", default=None, help="only this node")
    s.add_argument("--follow", "-f", action="store_true", help="keep printing new lines")
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        urls, ns = resolve_server(args)
    except SettingsError as e:
        sys.stderr.write(f"orchctl: {e}\n")
        return EXIT_USAGE
    opts: dict[str, Any] = {}
    if ns is not None:
        from orchestrator.bus import auth_options

        opts = auth_options(ns)

    def out(s: str) -> None:
        sys.stdout.write(s)
        sys.stdout.flush()

    try:
        anyio.run(lambda: read_logs(urls, args.job_id, node=args.node, follow=args.follow, out=out, connect_opts=opts),
                  backend="asyncio")
    except KeyboardInterrupt:
        return EXIT_OK
    except Exception as e:  # nats' NoServersError, OSError: unreachable
        sys.stderr.write(f"orchctl: NATS unreachable at {','.join(urls)}: {e!r}\n")
        return EXIT_USAGE
    return EXIT_OK
