"""The wedge oracle of the adversarial drill: after each hostile batch a notice for a healthy job must still
be decided in time.

Role: ``notice_to_command_s(fleet, node, limit_s)`` publishes a preemption notice for a training node
through the simulated fleet (as its cloud's notice feed would) and returns the seconds until orchd's
``CheckpointCmd`` for that node reached the node, or None when none came within ``limit_s``.
``bound_s(base_s)`` is how long a decision may take: ``WEDGE_FACTOR`` times the unattacked time, at most
``WEDGE_MAX_S``; ``wedges(base_s, times)`` names every batch whose notice was not decided within it. A
daemon that no longer decides (a loop that waits forever, a write retried forever) is caught here even
though it never crashes.

Concurrency contract: ``notice_to_command_s`` runs on the fleet's asyncio loop; the rest is pure.
"""

from __future__ import annotations

import time
from typing import Any

import anyio

import wire as ev

WEDGE_FACTOR = 5.0
WEDGE_MAX_S = 5.0


def bound_s(base_s: float) -> float:
    """The longest a notice may take to be decided after a batch: 5x the unattacked time, at most 5 s."""
    return min(WEDGE_FACTOR * base_s, WEDGE_MAX_S)


def wedges(base_s: float | None, times: list[float | None]) -> list[str]:
    """One line per batch whose notice was not decided within ``bound_s(base_s)`` (None: never decided).
    Without an unattacked time (``base_s`` None) every batch is judged against ``WEDGE_MAX_S``."""
    limit = WEDGE_MAX_S if base_s is None else bound_s(base_s)
    out = []
    for k, t in enumerate(times, 1):
        if t is None:
            out.append(f"batch {k}: a notice for a healthy job was not decided within {limit:.3f} s")
        elif t > limit:
            out.append(f"batch {k}: a notice for a healthy job took {t:.3f} s (bound {limit:.3f} s)")
    return out


async def notice_to_command_s(fleet: Any, node_id: str, limit_s: float = WEDGE_MAX_S) -> float | None:
    """Seconds from a notice for ``node_id`` (published now) to orchd's checkpoint command at that node; None
    when it did not come within ``limit_s``."""
    t0 = time.time()
    fleet.publish_notice(node_id)
    deadline = time.monotonic() + limit_s
    while True:
        got = [t for t, c in fleet.commands[-50:] if isinstance(c, ev.CheckpointCmd) and c.node_id == node_id
               and t >= t0]
        if got:
            return round(min(got) - t0, 3)
        if time.monotonic() > deadline:
            return None
        await anyio.sleep(0.005)
