"""sd_notify(3) without libsystemd: tell systemd we are ready, alive, busy with what, or stopping.

Role: the daemon and the agent run as ``Type=notify`` services with ``WatchdogSec``. They call

* ``notify_ready("...")`` once start-up is done (NATS connected, streams/KV bound, lease role known),
* ``notify_watchdog()`` every ``watchdog_interval_s()`` (half of WatchdogSec) FROM THE EVENT LOOP (a
  timer task in the main task group, never a thread: a wedged loop must stop the pings),
* ``notify_status("leader rev=42, 3 jobs")`` whenever the one-line state changes,
* ``notify_stopping()`` when SIGTERM arrives, before the graceful shutdown.

Every call is a no-op returning False when ``$NOTIFY_SOCKET`` is unset (tests, a terminal), so callers
need no branches. A leading ``@`` names a Linux abstract socket. Sends are one non-blocking datagram;
errors are swallowed (returns False): a notification must never take the daemon down.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


def notify(state: str, env: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (newline-separated ``KEY=value`` lines) to $NOTIFY_SOCKET; False if not sent."""
    path = (os.environ if env is None else env).get("NOTIFY_SOCKET", "")
    if not path:
        return False
    addr = "\0" + path[1:] if path.startswith("@") else path
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.setblocking(False)
            sock.sendto(state.encode(), addr)
        return True
    except OSError:
        return False


def notify_ready(status: str = "") -> bool:
    return notify("READY=1" + (f"\nSTATUS={status}" if status else ""))


def notify_status(status: str) -> bool:
    return notify(f"STATUS={status.replace(chr(10), ' ')}")


def notify_watchdog() -> bool:
    return notify("WATCHDOG=1")


def notify_stopping(status: str = "") -> bool:
    return notify("STOPPING=1" + (f"\nSTATUS={status}" if status else ""))


def watchdog_interval_s(env: Mapping[str, str] | None = None) -> float | None:
    """Half of the watchdog timeout systemd set for THIS process, or None when there is none."""
    env = os.environ if env is None else env
    usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2_000_000
