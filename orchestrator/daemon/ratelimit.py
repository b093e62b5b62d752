"""A rate limit per sending node, applied where messages enter orchd (``ingest.Intake``).

A node's agent may publish only on its own subjects (``orch.node.<node>.hb``, ``orch.node.<node>.event``,
``orch.notice.<cloud>.<node>``), so the subject names the sender. Each (kind, node) has a token bucket of
``rate`` messages per second and ``burst`` at most: an honest agent sends a heartbeat every few seconds
and a handful of events per generation, far below it. Over the limit a message is rejected before it is
buffered (a heartbeat dropped, a JetStream message terminated) and counted as
``orchd_messages_rejected_total{kind, reason="rate_limited"}``: a node that floods its subjects loses its
own excess, and another job's notice never waits behind that flood in the decide loop.

Heartbeats, node events and notices have separate buckets (a node's event flood does not cost it its own
notice). Price ticks are not limited here: a feed publishes one tick per pool per round, and the price
screen and confirmation bound what a feed can do (docs/security.md).

Pure apart from the clock the caller passes; memory is bounded (``max_senders``: full buckets, which are
the same as no bucket, are dropped first).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def sender_of(subject: str) -> tuple[str, str] | None:
    """(kind, node) of a node's subject; None for any other subject (not limited)."""
    parts = subject.split(".")
    if len(parts) == 4 and parts[0] == "orch":
        if parts[1] == "node" and parts[3] in ("hb", "event"):
            return parts[3], parts[2]
        if parts[1] == "notice":
            return "notice", parts[3]
    return None


@dataclass(slots=True)
class SenderLimiter:
    rate: float  # tokens per second per sender
    burst: float  # bucket size
    max_senders: int = 200_000
    _buckets: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)  # -> (tokens, ts)

    def allow(self, subject: str, now: float) -> bool:
        """Take one token from the subject's sender; False when it has none (the message is refused)."""
        key = sender_of(subject)
        if key is None or self.rate <= 0:
            return True
        tokens, ts = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - ts) * self.rate) if now > ts else tokens
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            return False
        if len(self._buckets) >= self.max_senders and key not in self._buckets:
            self._evict(now)
        self._buckets[key] = (tokens - 1.0, now)
        return True

    def _evict(self, now: float) -> None:
        """Drop the buckets that are full again (the same as absent); if none is, the oldest half."""
        full = [k for k, (t, ts) in self._buckets.items() if t + (now - ts) * self.rate >= self.burst]
        if not full:
            full = sorted(self._buckets, key=lambda k: self._buckets[k][1])[: len(self._buckets) // 2]
        for k in full:
            del self._buckets[k]

    def __len__(self) -> int:
        return len(self._buckets)
