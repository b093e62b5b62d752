"""Catch checkpoint signals from the first moment of a rank process, before torch is imported.

Role: SIGUSR1's default action kills a process, and importing torch takes seconds; a request the agent
sends in that window must not kill the rank. ``install_early()`` (torch-free, called first by
``python -m trainer`` and recommended at the top of any script) records signals; the real handlers in
trainer.emergency replay what was recorded when they take over.
"""

from __future__ import annotations

import signal
import time

received: list[tuple[int, float]] = []  # (signal number, wall-clock time), in arrival order


def _record(signum: int, frame: object) -> None:
    received.append((signum, time.time()))


def install_early() -> None:
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, _record)
