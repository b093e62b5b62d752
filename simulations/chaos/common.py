"""Shared pieces of the drills: NATS connections, publishing prices, admin calls that tolerate a dead orchd."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import anyio
import nats

import wire as ev
from orchestrator.cli.client import AdminClient, AdminUnreachable
from simulations.chaos.harness import PRICES, price_tick


async def _quiet(*_a: Any) -> None:
    pass


async def connect(url: str, name: str) -> Any:
    """A client that reconnects forever (agents and publishers outlive server restarts)."""
    return await nats.connect(url, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.1,
                              error_cb=_quiet, disconnected_cb=_quiet, reconnected_cb=_quiet,
                              pending_size=256 * 1024 * 1024)


async def publish_until_stored(js: Any, subject: str, msg: Any, msg_id: str, timeout_s: float = 60.0) -> Any:
    """Publish with one Nats-Msg-Id until the stream acknowledges (exactly once, even across outages)."""
    data = ev.encode(msg)
    with anyio.fail_after(timeout_s):
        while True:
            try:
                return await js.publish(subject, data, headers={"Nats-Msg-Id": msg_id})
            except Exception:
                await anyio.sleep(0.1)


async def publish_prices(js: Any, tag: str) -> None:
    for pool, usd, od in PRICES:
        t = price_tick(pool, usd, od, tag)
        await publish_until_stored(js, ev.subject_price(pool.cloud, pool.region), t, t.id)


async def admin(url: str, timeout_s: float = 5.0) -> AdminClient:
    return await AdminClient.connect([url], timeout_s=timeout_s)


async def call(client: AdminClient, method: str, *args: Any, retry_s: float = 60.0, **kw: Any) -> Any:
    """An admin call retried while orchd is down or restarting (AdminUnreachable), up to ``retry_s``."""
    deadline = time.monotonic() + retry_s
    while True:
        try:
            return await getattr(client, method)(*args, **kw)
        except AdminUnreachable:
            if time.monotonic() > deadline:
                raise
            await anyio.sleep(0.2)


async def shutdown(orchd: Any, server: Any, *conns: Any) -> None:
    """End a drill whatever happened: stop orchd if it is still up, close the connections, remove the
    server. Shielded, so a cancelled drill still cleans up."""
    with anyio.CancelScope(shield=True):
        if orchd.alive():
            await anyio.to_thread.run_sync(orchd.stop)
        for conn in conns:
            if conn is not None:
                with contextlib.suppress(Exception):  # a broken connection is already closed for our purpose
                    await conn.close()
        server.cleanup()


async def publish_prices_to(urls: dict[str, str], tag: str) -> None:
    """``publish_prices`` over a connection of its own to any of ``urls`` (a cluster), closed after."""
    nc = await nats.connect(servers=list(urls.values()), name="chaos-prices", max_reconnect_attempts=-1,
                            reconnect_time_wait=0.2, error_cb=_quiet)
    try:
        await publish_prices(nc.jetstream(timeout=2.0), tag)
    finally:
        await nc.close()
