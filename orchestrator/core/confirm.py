"""Price confirmation: two observations before a price moves money.

Role: apply an observed pool price (from a ``PriceTick``) to the pool's *confirmed* price
(``PoolStats.price_usd_h`` / ``on_demand_usd_h``) only once a second observation agrees with it.

Rule (docs/core.md, "Price confirmation"):
- a price that differs from the confirmed one becomes *pending* (``seen_*`` fields) with one audit
  record ``price_unconfirmed`` (once per pool per change; ticks within ``PRICE_TOLERANCE`` of the
  pending price do not restart it or audit again);
- it is confirmed only by a second PriceTick within tolerance of it, at least ``confirm_s`` after it
  was first seen, with no tick in between outside the tolerance (such a tick restarts the pending
  price; a tick back at the confirmed price drops it). Time alone never confirms: a Tick does not, so
  one tick followed by silence moves nothing however long the silence lasts. The shell may fetch a
  fresh quote from the provider once a pending price is due and feed it in as a PriceTick;
- the first price of a new pool is confirmed at once when the pool is known (``known``: its instance
  type is listed in ``CoreConfig.known_instance_types``, or without a list, the cloud already has a
  priced pool of that type, or the cloud is new - its first feed round); else it is pending and only a
  second PriceTick within tolerance, at least ``confirm_s`` later, confirms it (two signals: a one-off
  tick for a pool nobody configured never becomes a launch target). With a list, a pool of an unlisted
  type is never a launch target (placement.py). A running job moves only to a pool whose confirmed
  price was first seen at least ``confirm_s`` ago with no other price pending (``held``);
- ``confirm_s() <= 0``: every price is confirmed at once (the behaviour before confirmation existed).

Confirming closes the pool's price integral at the old confirmed price, so costs accrue at confirmed
prices only.
"""

from __future__ import annotations

import msgspec

from orchestrator.core.model import PoolStats, fin
from orchestrator.core.pricing import pool_cum_usd
from orchestrator.core.tx import Tx
from wire.messages import Market, PoolKey, PriceTick

PRICE_TOLERANCE = 0.01  # relative: ticks within 1% of a pending price keep it pending (not restarted)

_replace = msgspec.structs.replace
_UNSET = msgspec.UNSET


def close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= PRICE_TOLERANCE * max(abs(a), abs(b))


def held(ps: PoolStats, confirm_s: float, now: float) -> bool:
    """A pool a running job may move to: its confirmed price was first seen at least ``confirm_s`` ago
    and no different price is pending."""
    return confirm_s <= 0 or (now - ps.price_ts >= confirm_s and isinstance(ps.seen_ts, msgspec.UnsetType))


def _apply(tx: Tx, name: str, ps: PoolStats, price: float, od: float | None, since: float) -> bool:
    """Make (price, od) the confirmed prices; True when a confirmed price rose (or was unknown)."""
    rise = ps.price_usd_h is None or price > ps.price_usd_h or (
        od is not None and (ps.on_demand_usd_h is None or od > ps.on_demand_usd_h))
    # Close the price integral at the old price: jobs' costs stay exact without touching any job.
    cum = pool_cum_usd(ps, tx.now) if ps.price_usd_h is not None else ps.cum_usd
    tx.put_pool(name, _replace(ps, price_usd_h=price, on_demand_usd_h=od, price_ts=since, cum_usd=cum,
                               cum_ts=max(tx.now, ps.cum_ts), seen_usd_h=_UNSET, seen_od_usd_h=_UNSET,
                               seen_ts=_UNSET))
    return rise


def known(tx: Tx, pool: PoolKey) -> bool:
    """Whether the first price of a new pool counts at once. With ``CoreConfig.known_instance_types``:
    the pool's type is listed. Without: the state holds a priced pool of the same cloud and instance
    type, or the pool's cloud is new - no priced pool yet, or all of them first priced less than
    ``confirm_s`` ago (the first round of a feed). Any other pool waits for a second PriceTick."""
    cfg = tx.cfg
    if not isinstance(cfg.known_instance_types, msgspec.UnsetType):
        return cfg.knows(pool)
    first = tx.now
    for ps in tx.pools.values():
        p = ps.pool
        if p.cloud != pool.cloud or ps.price_usd_h is None:
            continue
        if p.instance_type == pool.instance_type:
            return True
        first = min(first, ps.price_ts)
    return tx.now - first < cfg.confirm_s()


def observe(tx: Tx, name: str, pt: PriceTick, market: Market, price: float, od: float | None) -> bool:
    """One observed price of pool ``name`` (``market``: the tick's pool's, or on-demand for the
    on-demand price a spot tick carries). True when a confirmed price rose (budgets re-check)."""
    cfg, now = tx.cfg, tx.now
    hint = fin(pt.capacity_hint) if market == pt.pool.market else None
    ps = tx.pools.get(name)
    if ps is None:
        pool = pt.pool if pt.pool.market == market else _replace(pt.pool, market=market)
        ps = PoolStats(pool=pool, gpu_type=pt.gpu_type, gpus_per_node=pt.gpus_per_node, capacity_hint=hint)
        if cfg.confirm_s() <= 0 or known(tx, pool):
            return _apply(tx, name, ps, price, od, now)
    elif ps.capacity_hint != hint or ps.gpu_type != pt.gpu_type or ps.gpus_per_node != pt.gpus_per_node:
        ps = tx.put_pool(name, _replace(ps, capacity_hint=hint, gpu_type=pt.gpu_type, gpus_per_node=pt.gpus_per_node))
    if ps.price_usd_h == price and ps.on_demand_usd_h == od:
        if not isinstance(ps.seen_ts, msgspec.UnsetType):  # back at the confirmed price: the change is void
            tx.put_pool(name, _replace(ps, seen_usd_h=_UNSET, seen_od_usd_h=_UNSET, seen_ts=_UNSET))
            tx.record(None, "price_unconfirmed_dropped", "price_returned", pool=name, price_usd_h=price)
        return False
    confirm_s = cfg.confirm_s()
    if confirm_s <= 0:
        return _apply(tx, name, ps, price, od, now)
    seen_ts, seen_usd, seen_od = ps.seen_ts, ps.seen_usd_h, ps.seen_od_usd_h
    if (
        not isinstance(seen_ts, msgspec.UnsetType) and not isinstance(seen_usd, msgspec.UnsetType)
        and not isinstance(seen_od, msgspec.UnsetType) and close(seen_usd, price) and close(seen_od, od)
    ):
        if now - seen_ts >= confirm_s:  # the second observation
            rise = _apply(tx, name, ps, price, od, seen_ts)
            tx.record(None, "price_confirmed", "second_tick", pool=name, price_usd_h=price, since_ts=seen_ts)
            return rise
        return False  # still pending: neither restarted nor audited again
    tx.put_pool(name, _replace(ps, seen_usd_h=price, seen_od_usd_h=od, seen_ts=now))
    tx.record(None, "price_unconfirmed", "price_changed", pool=name, price_usd_h=price, on_demand_usd_h=od,
              confirmed_usd_h=ps.price_usd_h, confirm_s=confirm_s)
    return False


def due(ps: PoolStats, confirm_s: float, now: float) -> bool:
    """A pending price that a second agreeing PriceTick would confirm now: the moment for the shell to
    fetch a fresh quote of this pool (the core never confirms on time alone)."""
    return not isinstance(ps.seen_ts, msgspec.UnsetType) and now - ps.seen_ts >= confirm_s
