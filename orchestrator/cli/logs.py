"""``orchctl logs JOB [--node N] [--follow]``: the trainer ranks' output, as shipped by the agents.

Role: read ``LogLine`` records from the JetStream stream ORCH_LOGS (subjects ``orch.logs.<job>.<node>``,
written by every agent's log shipper), oldest first: print what is stored and exit, or keep printing
new lines with ``--follow`` until interrupted. ``-o json``/``yaml``: one record per line (JSON lines) or
a YAML list; the table form is ``format_line``.

Read-only, so that the operator role can: each line is one ``$JS.API.STREAM.MSG.GET.ORCH_LOGS``
request (``next_by_subj`` from the last sequence seen) and nothing is created on the server: no
consumer, no ``$JS.API.CONSUMER.*`` or flow-control subject to grant (``orchctl_permissions``). Replies
come on ``_INBOX.orchctl.>``.

Exit codes (``common``): 0, the not-found code when orchd does not know the job and nothing is stored
for it, the unreachable code without NATS.

Formatting is a pure function (``format_line``); the reader is a thin loop around nats-py.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import anyio
import msgspec
import yaml

from orchestrator.cli.common import (
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    format_time,
    resolve_server,
    unreachable_hint,
)
from orchestrator.security.nats_auth import ORCHCTL_INBOX
from orchestrator.settings import SettingsError
from wire import LogLine, WireError, decode

LOGS_STREAM = "ORCH_LOGS"


def format_line(rec: LogLine, *, show_node: bool = True, fmt: str = "table") -> str:
    """One record as text (no newline): ``table`` (date, time, node, generation, rank | line), ``json``
    (one object) or ``yaml`` (one list item)."""
    if fmt == "json":
        return json.dumps(msgspec.to_builtins(rec), separators=(",", ":"))
    if fmt == "yaml":
        return yaml.safe_dump([msgspec.to_builtins(rec)], sort_keys=False).rstrip("\n")
    where = f"{rec.node_id} " if show_node else ""
    err = " !" if rec.stream == "stderr" else ""
    return f"{format_time(rec.ts)} {where}g{rec.generation} r{rec.rank}{err} | {rec.line}"


async def read_logs(urls: list[str], job: str, *, node: str | None = None, follow: bool = False,
                    out: Callable[[str], None], idle_s: float = 1.0, connect_opts: dict[str, Any] | None = None,
                    fmt: str = "table") -> int:
    """Print the stored lines (and new ones with ``follow``, polling every ``idle_s`` when idle).
    Returns the number of lines printed."""
    import nats
    from nats.js.errors import NotFoundError

    nc = await nats.connect(urls, allow_reconnect=follow, max_reconnect_attempts=-1 if follow else 1,
                            reconnect_time_wait=0.5, connect_timeout=3, error_cb=_quiet, inbox_prefix=ORCHCTL_INBOX,
                            **(connect_opts or {}))
    js = nc.jetstream(timeout=5.0)
    subject = f"orch.logs.{job}.{node or '*'}"
    printed, seq = 0, 1
    try:
        while True:
            try:
                raw = await js.get_msg(LOGS_STREAM, seq=seq, subject=subject, next=True)
            except NotFoundError:  # nothing (more) stored, or no stream yet
                if not follow:
                    break
                await anyio.sleep(idle_s)
                continue
            seq = (raw.seq or seq) + 1
            try:
                rec = decode(raw.data or b"", LogLine)
            except WireError:
                continue
            out(format_line(rec, show_node=node is None, fmt=fmt) + "\n")
            printed += 1
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(2):
            await nc.close()
    return printed


async def _quiet(_e: Exception) -> None:
    pass


async def job_known(urls: list[str], job: str, nats_settings: Any, timeout_s: float) -> bool | None:
    """Whether orchd knows ``job`` (None: orchd did not answer: logs outlive it, so read them anyway)."""
    from orchestrator.cli.client import AdminClient, AdminError, AdminUnreachable

    try:
        async with await AdminClient.connect(urls, timeout_s=timeout_s, nats_settings=nats_settings) as c:
            await c.job(job)
    except AdminError as e:
        return False if e.code == 404 else None
    except AdminUnreachable:
        return None
    return True


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

    async def main() -> tuple[bool | None, int]:
        known = await job_known(urls, args.job_id, ns, min(getattr(args, "timeout", 5.0), 5.0))
        printed = await read_logs(urls, args.job_id, node=args.node, follow=args.follow and known is not False,
                                  out=out, connect_opts=opts, fmt=getattr(args, "output", "table"))
        return known, printed

    try:
        known, printed = anyio.run(main, backend="asyncio")
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as e:  # nats' NoServersError, OSError, auth errors: unreachable
        sys.stderr.write(f"orchctl: NATS unreachable at {','.join(urls)}: {e!r}\n" + unreachable_hint(args, urls))
        return EXIT_UNREACHABLE
    if known is False and printed == 0:
        sys.stderr.write(f"orchctl: no job {args.job_id!r} (orchd does not know it, and no log line is stored)\n")
        return EXIT_NOT_FOUND
    return EXIT_OK
