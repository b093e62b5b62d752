"""Leader lease for HA orchd on a JetStream KV bucket; its revision is the fencing token.

Role: exactly one orchd (the leader) decides and calls clouds; the others stand by. The lease is one
key in a dedicated KV bucket whose ``ttl`` (stream max_age) equals the lease TTL, so a dead leader's
key disappears by itself.

* acquire: ``kv.create(key)`` (fails while someone holds it); standbys retry every TTL/3.
* renew:   ``kv.update(key, last=rev)`` every TTL/3. A CAS failure (someone else holds it) steps down
  at once; transport errors (NATS down, cluster failover) keep the lease only until the local deadline.
  A renewal is never awaited past the deadline, and a leader whose renewals fail wakes at its deadline:
  the step-down (``on_change(0)``) comes at the deadline, not when a stuck request finally times out.
* deadline: ``monotonic() before the write + TTL * (1 - safety)``. The server expires the key no
  earlier than TTL after it stored the write, so our deadline passes before any standby can create
  the key: two leaders never both see ``valid()`` (assuming comparable clock rates; ``safety``
  covers drift).
* release: ``kv.delete(key, last=rev)`` on clean exit: a standby takes over at its next try.

``revision`` is the KV revision at which THIS term was acquired: constant for the term, strictly
greater than any revision an earlier leader ever held (KV revisions are stream sequences). Every
command carries it as ``fencing_token``; agents remember the highest seen and refuse lower ones. The
executor calls ``valid()`` before every provider call, since clouds know nothing of fencing.

Concurrency contract: one task runs ``run()``; ``valid()``/``revision`` are read from any task of the
same loop (and from executor threads: they read two attributes, no awaits).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Awaitable, Callable

import anyio
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue

LEASE_BUCKET = "orch_lease"
LEASE_KEY = "leader"

# Anything but a CAS failure is transient for the lease (timeouts, no responders, "no response from
# stream" during a stream leader election, 503s, closed connections): keep the lease until the local
# deadline, retry on the next period. KeyWrongLastSequenceError is caught before these.
_TRANSIENT = (nats.errors.Error, OSError)


async def lease_bucket(js: JetStreamContext, *, ttl_s: float, replicas: int = 1,
                       bucket: str = LEASE_BUCKET) -> KeyValue:
    """The lease bucket (created when missing; its ttl must equal the lease TTL)."""
    try:
        kv = await js.key_value(bucket)
    except nats.js.errors.BucketNotFoundError:
        return await js.create_key_value(config=KeyValueConfig(bucket=bucket, ttl=ttl_s, history=1,
                                                               replicas=replicas))
    status = await kv.status()
    if abs((status.ttl or 0) - ttl_s) > 1e-3:
        raise ValueError(f"lease bucket {bucket} has ttl {status.ttl}s, settings say {ttl_s}s")
    return kv


class LeaderLease:
    def __init__(self, kv: KeyValue, *, ttl_s: float, holder: str | None = None, key: str = LEASE_KEY,
                 safety: float = 0.1, clock: Callable[[], float] = time.monotonic) -> None:
        self.kv = kv
        self.ttl_s = ttl_s
        self.key = key
        self.holder = holder or socket.gethostname()
        self.safety = safety
        self._clock = clock
        self._term = 0  # revision at acquisition: the fencing token
        self._rev = 0  # latest revision we wrote (the CAS base)
        self._deadline = 0.0

    # -- what the rest of orchd reads -------------------------------------------------------------

    @property
    def revision(self) -> int:
        """Fencing token of the current term; 0 when not leader."""
        return self._term

    @property
    def is_leader(self) -> bool:
        return self._term != 0

    def valid(self) -> bool:
        """True while we lead and the local monotonic deadline has not passed."""
        return self._term != 0 and self._clock() < self._deadline

    def remaining_s(self) -> float:
        return max(0.0, self._deadline - self._clock()) if self._term else 0.0

    # -- steps -------------------------------------------------------------------------------------

    def _value(self) -> bytes:
        return json.dumps({"holder": self.holder, "term": self._term}).encode()

    async def try_acquire(self) -> bool:
        if self.is_leader:
            return True
        started = self._clock()
        try:
            rev = await self.kv.create(self.key, self._value())
        except nats.js.errors.KeyWrongLastSequenceError:
            return False  # held by someone else
        except _TRANSIENT:
            return False
        self._term = self._rev = rev
        self._deadline = started + self.ttl_s * (1 - self.safety)
        return True

    async def renew(self) -> bool:
        """Extend the lease; False (and stepped down) when it is lost."""
        if not self.is_leader:
            return False
        if not self.valid():
            self._step_down()
            return False
        started = self._clock()
        try:
            # never past the deadline: a renewal stuck in a stream leader election must not keep this
            # daemon deciding (and acking) after a standby may have taken the lease
            with anyio.fail_after(self.remaining_s()):
                rev = await self.kv.update(self.key, self._value(), last=self._rev)
        except nats.js.errors.KeyWrongLastSequenceError:
            self._step_down()
            return False
        except (*_TRANSIENT, TimeoutError):
            if not self.valid():
                self._step_down()
                return False
            return True  # keep leading until the deadline; the next renew may get through
        self._rev = rev
        self._deadline = started + self.ttl_s * (1 - self.safety)
        return True

    async def release(self) -> None:
        """Give the lease up (clean exit): a standby can take it at once."""
        if not self.is_leader:
            return
        rev = self._rev
        self._step_down()
        try:
            await self.kv.delete(self.key, last=rev)
        except (nats.js.errors.KeyWrongLastSequenceError, *_TRANSIENT):
            pass  # lost anyway, or it expires by itself

    def _step_down(self) -> None:
        self._term = self._rev = 0
        self._deadline = 0.0

    async def run(self, on_change: Callable[[int], Awaitable[None] | None]) -> None:
        """Acquire/renew forever; ``on_change(revision)`` on winning, ``on_change(0)`` on losing.

        Cancel to stop: a held lease is released (shielded, bounded by 2 s)."""
        try:
            while True:
                was = self.revision
                await (self.renew() if self.is_leader else self.try_acquire())
                if self.revision != was:
                    res = on_change(self.revision)
                    if res is not None:
                        await res
                # a leader wakes at its deadline at the latest: losing the lease is reported then
                await anyio.sleep(min(self.ttl_s / 3, self.remaining_s()) if self.is_leader else self.ttl_s / 3)
        finally:
            with anyio.move_on_after(2, shield=True):
                await self.release()
