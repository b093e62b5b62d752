"""What orchctl's subcommands share: exit codes, time cells, tables (``render_table``, ``render_kv``), where
orchd's NATS is (``resolve_server``) and the hint given when it is unreachable (``unreachable_hint``).

Both ``main`` (the admin commands) and the subcommands in their own modules (``logs``, ``demo``) import
this module; it imports neither of them.

Where orchd is: --server, else $ORCH_SERVER, else nats.urls of --config, else <state-dir>/orchd.json
written by a running orchd (default state dir ./var/orchd, removed by orchd on a clean stop), else
nats://127.0.0.1:4222.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrator.settings import NatsSettings, load_settings

EXIT_OK = 0
"""Done."""
EXIT_DAEMON = 1
"""orchd answered with an error (refused: 400/409, or failed: 500)."""
EXIT_USAGE = 2
"""Usage error: bad arguments, an invalid job spec or --config file."""
EXIT_NOT_FOUND = 66
"""What was named does not exist (orchd's 404: job, node, dead letter; ``logs`` of an unknown job).
sysexits' EX_NOINPUT."""
EXIT_UNREACHABLE = 69
"""No NATS server, no orchd answering in time, or orchd's 503 (it lost the leader lease or is stopping):
transient, worth a retry. sysexits' EX_UNAVAILABLE."""
EXIT_INTERRUPTED = 130
"""Interrupted (Ctrl-C, SIGINT): 128 + 2, as shells report it."""

EXIT_CODES: dict[int, str] = {
    EXIT_OK: "ok",
    EXIT_DAEMON: "orchd answered with an error",
    EXIT_USAGE: "usage error (arguments, job spec, --config)",
    EXIT_NOT_FOUND: "not found (job, node, dead letter)",
    EXIT_UNREACHABLE: "NATS or orchd unreachable, or orchd's 503 (transient: retry)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}

DEFAULT_SERVER = "nats://127.0.0.1:4222"
DEFAULT_STATE_DIR = "./var/orchd"


def package_version() -> str:
    try:
        return importlib.metadata.version("spot-orchestrator")
    except importlib.metadata.PackageNotFoundError:  # a bare checkout, not installed
        return "unknown"


def format_time(ts: float) -> str:
    """A wall-clock time as a table cell: date and time in UTC (``2026-11-25 20:10:46Z``)."""
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(ts))


def _discovery_path(args: argparse.Namespace, state_dir: str | None) -> Path:
    return Path(state_dir or getattr(args, "state_dir", None) or DEFAULT_STATE_DIR) / "orchd.json"


def resolve_server(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> tuple[
        list[str], NatsSettings | None]:
    """Where orchd's NATS is (see the module docstring), and the NATS settings of --config (its
    credentials) if given. Raises SettingsError on a bad --config."""
    nats_settings = None
    state_dir = args.state_dir
    if args.config:
        settings = load_settings(args.config, env={})
        nats_settings = settings.nats
        state_dir = state_dir or settings.daemon.state_dir
    if args.server:
        return [u.strip() for u in args.server.split(",") if u.strip()], nats_settings
    if env.get("ORCH_SERVER"):
        return [u.strip() for u in env["ORCH_SERVER"].split(",") if u.strip()], nats_settings
    if nats_settings and nats_settings.urls:
        return list(nats_settings.urls), nats_settings
    disc = _read_discovery(_discovery_path(args, state_dir))
    if disc is not None and isinstance(disc.get("nats_url"), str):
        return disc["nats_url"].split(","), nats_settings
    return [DEFAULT_SERVER], nats_settings


def _read_discovery(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def unreachable_hint(args: argparse.Namespace, urls: list[str], env: Mapping[str, str] = os.environ) -> str:
    """A line to add to "orchd unreachable" when the address came from orchd.json: a stale file (its
    orchd is gone: killed, or the host rebooted) names the file and the pid; no file, the defaults."""
    if args.server or env.get("ORCH_SERVER") or args.config:
        return ""
    path = _discovery_path(args, None)
    disc = _read_discovery(path)
    if disc is None:
        return (f"hint: no {path} (written by a running orchd): give --server URL, $ORCH_SERVER, "
                f"--config FILE or --state-dir DIR\n")
    pid = disc.get("pid")
    if isinstance(pid, int) and not _alive(pid):
        return (f"hint: {path} is stale: the orchd that wrote it (pid {pid}, {','.join(urls)}) is not running; "
                f"start orchd, or remove the file and give --server URL\n")
    return ""


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).is_running() and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e9 else format_time(v)
    if isinstance(v, list | tuple):
        return ",".join(map(str, v))
    if isinstance(v, dict):  # times inside (a hold's or a wait's "until") carry their date too
        shown = {k: format_time(x) if isinstance(x, float) and abs(x) >= 1e9 else x for k, x in v.items()}
        return json.dumps(shown, separators=(",", ":"))[:80]
    return str(v)


def render_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None, title: str = "") -> str:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    cols = list(columns or (list(rows[0]) if rows else []))
    if rows and columns:
        cols = [c for c in cols if any(c in r for r in rows)] or list(rows[0])
    table = Table(title=Text(title) if title else None, box=None, header_style="bold", pad_edge=False)
    for c in cols:
        table.add_column(c.upper())
    for r in rows:
        table.add_row(*(Text(_cell(r.get(c))) for c in cols))  # plain text: "[aws, gcp]" is not markup
    buf = io.StringIO()
    Console(file=buf, width=200, force_terminal=False, color_system=None).print(table)
    return buf.getvalue().rstrip() + "\n"


def render_kv(data: dict[str, Any]) -> str:
    width = max((len(k) for k in data), default=0)
    return "".join(f"{k.ljust(width)}  {_cell(v)}\n" for k, v in data.items())
