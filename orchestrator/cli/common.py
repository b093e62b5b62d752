"""What orchctl's subcommands share: exit codes and where orchd's NATS is (``resolve_server``).

Both ``main`` (the admin commands) and the subcommands in their own modules (``logs``, ``demo``) import
this module; it imports neither of them.

Where orchd is: --server, else $ORCH_SERVER, else nats.urls of --config, else <state-dir>/orchd.json
written by a running orchd (default state dir ./var/orchd), else nats://127.0.0.1:4222.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from pathlib import Path

from orchestrator.settings import NatsSettings, load_settings

EXIT_OK, EXIT_DAEMON, EXIT_USAGE = 0, 1, 2
"""0 ok, 1 orchd answered with an error, 2 usage error, invalid spec, or orchd unreachable."""

DEFAULT_SERVER = "nats://127.0.0.1:4222"


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
    disc = Path(state_dir or "./var/orchd") / "orchd.json"
    if disc.exists():
        try:
            return json.loads(disc.read_text())["nats_url"].split(","), nats_settings
        except (ValueError, KeyError):
            pass
    return [DEFAULT_SERVER], nats_settings
