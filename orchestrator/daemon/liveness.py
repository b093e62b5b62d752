"""Liveness flushes: the node records that only heartbeats changed, written at a lower rate.

Role: the core returns an empty ``dirty`` for liveness-only changes (last seen, step, loss); the
decide pipeline hands those node keys here (``Decided.liveness``). Every ``daemon.liveness_flush_s``
a flush round starts: the keys collected so far are written in slices of ``daemon.liveness_flush_max``
off the decide loop, one slice at a time (``write``: the store's background writer, which encodes each
value from the newest state at the moment its publish is queued). On the final batch every pending
key, a slice in flight included, is written with the batch.

Concurrency contract: called from the decide loop's task only; the slices run in the task group given
to ``attach`` (the daemon's), one at a time.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from anyio.abc import TaskGroup


class LivenessFlusher:
    def __init__(self, write: Callable[[set[str]], Awaitable[None]], slice_max: int) -> None:
        self.write = write
        self.slice_max = slice_max
        self.pending: set[str] = set()  # node keys changed by heartbeats only, not yet persisted
        self.round: set[str] = set()  # keys of the current flush round not yet written
        self.writing: set[str] = set()  # the keys of the slice being written
        self.round_due = False  # set every liveness_flush_s: start a flush round
        self.busy = False  # one background slice at a time
        self._tg: TaskGroup | None = None

    def attach(self, tg: TaskGroup) -> None:
        """The task group that runs the background slices (the daemon's, alive while it decides)."""
        self._tg = tg

    def start_round(self) -> None:
        """The next batch moves every pending key into a new flush round."""
        self.round_due = True

    def settle(self, liveness: Iterable[str], dirty: set[str], *, final: bool) -> None:
        """Before a batch is persisted: take its liveness keys; start a round when due; on the ``final``
        batch add every key of the round and of the slice in flight to ``dirty`` (written with it). Keys
        written with the batch anyway are no longer pending."""
        self.pending.update(liveness)
        if self.round_due:
            self.round |= self.pending
            self.pending.clear()
            self.round_due = False
        if final and (self.round or self.writing):
            dirty.update(self.round, self.writing)
            self.round.clear()
        self.pending.difference_update(dirty)

    def write_slice(self) -> None:
        """Start writing the next slice of the round in the background (none while one is in flight)."""
        if not self.round or self.busy or self._tg is None:
            return
        keys = {self.round.pop() for _ in range(min(self.slice_max, len(self.round)))}
        self.busy = True
        self._tg.start_soon(self._write, keys)

    async def _write(self, keys: set[str]) -> None:
        self.writing = keys
        try:
            await self.write(keys)
        finally:
            self.busy = False
            self.writing = set()
