"""One acting sweep controller per storage: a lease row in the Optuna storage's own database.

Role: two ``orch-sweep`` services pointed at one storage (two hosts for availability, or a second one
started by mistake) must not both act - both could ask Optuna for trials beyond ``trials``, or cancel
what the other just submitted. The lease is one row of a table of its own (``orch_sweep_lease``) in the
storage's database, next to Optuna's tables, so it needs nothing the controller does not already reach:

- **acquire / renew**: one ``UPDATE ... WHERE holder = me OR expires_ts < now`` - atomic in every SQL
  database Optuna supports (SQLite, PostgreSQL, MySQL) -, or the first ``INSERT`` of the row. The winner
  holds it until ``now + ttl_s``; a takeover from another holder increments ``token`` (the fencing
  token: logged, so a takeover is visible).
- **act only while held**: ``held()`` is true until a local monotonic deadline, ``ttl_s`` minus a margin
  after the last successful renewal - a controller cut off from the database stops acting before the
  row can expire for the others. The service renews before every pass and the controller checks
  ``held()`` before every sweep of a pass.
- **a controller that dies** (kill -9, a lost host) leaves the row: another takes over once it expires,
  at most ``ttl_s`` plus one pass interval later. A controller that stops cleanly deletes its row
  (``release``), so a standby takes over at its next pass.

Expiry compares the controllers' wall clocks (``time.time()`` of each host): keep them within a small
part of ``ttl_s`` (NTP). Concurrency contract: synchronous and blocking (SQLAlchemy); call it from the
controller's worker thread.
"""

from __future__ import annotations

import time
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

TABLE: Final = "orch_sweep_lease"
NAME: Final = "controller"
DEFAULT_TTL_S: Final = 30.0

_meta = sa.MetaData()
_lease = sa.Table(
    TABLE, _meta,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("holder", sa.String(200), nullable=False),
    sa.Column("expires_ts", sa.Float, nullable=False),
    sa.Column("token", sa.Integer, nullable=False),
)


class ControllerLease:
    def __init__(self, engine: Any, holder: str, ttl_s: float = DEFAULT_TTL_S) -> None:
        if not ttl_s > 0:
            raise ValueError(f"lease ttl_s must be > 0, got {ttl_s!r}")
        self.engine = engine
        self.holder = holder[:200]
        self.ttl_s = ttl_s
        self.token = 0
        self._valid_until = 0.0  # time.monotonic() deadline of the current term
        _meta.create_all(engine, tables=[_lease], checkfirst=True)

    def held(self) -> bool:
        """Held now, by the local clock: acting is allowed."""
        return time.monotonic() < self._valid_until

    def acquire(self, now: float | None = None) -> bool:
        """Take or renew the lease; True while this controller holds it."""
        now = time.time() if now is None else now
        started = time.monotonic()
        t = _lease.c
        with self.engine.begin() as c:
            done = c.execute(
                sa.update(_lease)
                .where(t.name == NAME, sa.or_(t.holder == self.holder, t.expires_ts < now))
                .values(expires_ts=now + self.ttl_s,
                        token=sa.case((t.holder == self.holder, t.token), else_=t.token + 1),
                        holder=self.holder)
            ).rowcount
            if done == 1:
                self.token = int(c.execute(sa.select(t.token).where(t.name == NAME)).scalar_one())
        if done != 1:
            try:
                with self.engine.begin() as c:
                    c.execute(sa.insert(_lease).values(name=NAME, holder=self.holder, expires_ts=now + self.ttl_s,
                                                       token=1))
                self.token = 1
            except IntegrityError:  # another controller holds the row
                self._valid_until = 0.0
                return False
        # a margin for the time the call took and for the clocks: stop acting well before others may take it
        self._valid_until = started + self.ttl_s * 2.0 / 3.0
        return True

    def release(self) -> None:
        """Give the lease up (a clean stop): a standby takes over at its next pass."""
        self._valid_until = 0.0
        with self.engine.begin() as c:
            c.execute(sa.delete(_lease).where(_lease.c.name == NAME, _lease.c.holder == self.holder))

    def current(self) -> tuple[str, float, int] | None:
        """(holder, expires_ts, token) of the row, or None."""
        t = _lease.c
        with self.engine.connect() as c:
            row = c.execute(sa.select(t.holder, t.expires_ts, t.token).where(t.name == NAME)).first()
        return None if row is None else (str(row[0]), float(row[1]), int(row[2]))
