"""Leader lease on a real nats-server: one leads, the other stands by and takes over within 2x TTL
after the leader stops renewing, never while the old leader still considers itself valid; stale
revisions fail their CAS; fencing tokens grow; a renewal with no answer steps down at the deadline."""

from __future__ import annotations

import signal
import time

import anyio
import nats
import pytest
from nats.js.errors import KeyWrongLastSequenceError

from orchestrator.daemon.lease import LeaderLease, lease_bucket
from orchestrator.natsserver import NatsServer

pytestmark = pytest.mark.anyio
TTL = 1.0


async def _connect(url: str):
    async def quiet(_e: Exception) -> None:
        return None

    return await nats.connect(url, error_cb=quiet, allow_reconnect=False, max_reconnect_attempts=1)


async def _kv(nc, bucket: str):
    return await lease_bucket(nc.jetstream(), ttl_s=TTL, bucket=bucket)


async def test_one_leads_the_other_takes_over_within_2_ttl(nats_url: str) -> None:
    nc_a, nc_b = await _connect(nats_url), await _connect(nats_url)
    a = LeaderLease(await _kv(nc_a, "lease_takeover"), ttl_s=TTL, holder="a")
    b = LeaderLease(await _kv(nc_b, "lease_takeover"), ttl_s=TTL, holder="b")
    changes: list[tuple[str, int, float]] = []

    async with anyio.create_task_group() as tg:
        tg.start_soon(a.run, lambda rev: changes.append(("a", rev, time.monotonic())))
        with anyio.fail_after(3):
            while not a.is_leader:
                await anyio.sleep(0.01)
        tg.start_soon(b.run, lambda rev: changes.append(("b", rev, time.monotonic())))
        await anyio.sleep(2.5 * TTL)  # several renewals: b stays standby the whole time
        assert a.valid() and not b.is_leader
        term_a = a.revision

        crashed_at = time.monotonic()
        await nc_a.close()  # the leader dies: no more renewals, no release
        a_deadline = 0.0
        with anyio.fail_after(3 * TTL):
            while not b.is_leader:
                a_deadline = max(a_deadline, a._deadline)  # noqa: SLF001 - zeroed when a steps down
                await anyio.sleep(0.005)
        took_over_s = time.monotonic() - crashed_at
        b_won_at = next(t for who, rev, t in changes if who == "b" and rev)
        # the old leader's own clock had declared it invalid before b could win
        assert not a.valid()
        assert 0 < a_deadline <= b_won_at
        assert b.revision > term_a  # fencing token grows
        tg.cancel_scope.cancel()

    print(f"\ntakeover after {took_over_s:.2f}s (TTL {TTL}s)")
    assert took_over_s < 2 * TTL
    assert ("a", 0) in [(w, r) for w, r, _ in changes]  # a stepped down (deadline passed)
    await nc_b.close()


async def test_stale_revision_cas_fails_and_steps_down(nats_url: str) -> None:
    nc = await _connect(nats_url)
    kv = await _kv(nc, "lease_cas")
    a = LeaderLease(kv, ttl_s=TTL, holder="a")
    b = LeaderLease(kv, ttl_s=TTL, holder="b")
    assert await a.try_acquire() and a.valid()
    assert not await b.try_acquire()
    first = a._rev  # noqa: SLF001
    assert await a.renew()
    with pytest.raises(KeyWrongLastSequenceError):
        await kv.update("leader", b"stale", last=first)  # a stale leader's write is refused

    # someone else took the key (e.g. a's deadline passed during a long pause and b won)
    await kv.delete("leader")
    assert await b.try_acquire()
    assert b.revision > a.revision
    assert not await a.renew()  # CAS fails: a steps down at once
    assert not a.valid() and a.revision == 0 and b.valid()
    await b.release()
    assert not b.is_leader
    assert await a.try_acquire()  # released: free at once, no TTL wait
    await a.release()
    await nc.close()


async def test_clean_release_hands_over_at_the_next_try(nats_url: str) -> None:
    nc = await _connect(nats_url)
    kv = await _kv(nc, "lease_release")
    a, b = LeaderLease(kv, ttl_s=TTL, holder="a"), LeaderLease(kv, ttl_s=TTL, holder="b")
    async with anyio.create_task_group() as tg:
        tg.start_soon(a.run, lambda rev: None)
        with anyio.fail_after(2):
            while not a.is_leader:
                await anyio.sleep(0.01)
        tg.start_soon(b.run, lambda rev: None)
        await anyio.sleep(0.1)
        tg.cancel_scope.cancel()  # stops both; a releases on the way out
    assert not a.is_leader
    start = time.monotonic()
    assert await b.try_acquire()
    assert time.monotonic() - start < TTL / 2
    await b.release()
    await nc.close()


async def test_valid_is_a_local_monotonic_deadline(nats_url: str) -> None:
    nc = await _connect(nats_url)
    now = [100.0]
    lease = LeaderLease(await _kv(nc, "lease_clock"), ttl_s=3.0, holder="a", clock=lambda: now[0])
    assert not lease.valid()
    assert await lease.try_acquire()
    now[0] = 102.69
    assert lease.valid()
    now[0] = 102.71  # TTL * (1 - safety) after the write started
    assert not lease.valid()
    assert not await lease.renew()  # past the deadline: no write, stepped down
    assert lease.revision == 0
    await nc.close()


async def test_bucket_ttl_mismatch_is_refused(nats_url: str) -> None:
    nc = await _connect(nats_url)
    await lease_bucket(nc.jetstream(), ttl_s=TTL, bucket="lease_mismatch")
    with pytest.raises(ValueError):
        await lease_bucket(nc.jetstream(), ttl_s=2 * TTL, bucket="lease_mismatch")
    await nc.close()


async def test_a_stuck_renewal_steps_down_at_the_deadline(tmp_path) -> None:
    """A renewal that gets no answer (here: the server is frozen with SIGSTOP; in production, a lease
    stream electing a leader for seconds) must not keep the leader deciding past its deadline: the
    step-down (``on_change(0)``) comes at the deadline, before the key can expire on the server and a
    standby take it - not when the request times out (20 s here)."""
    ttl = 6.0
    server = NatsServer(tmp_path / "nats")
    server.start()
    try:
        nc = await _connect(server.url)
        kv = await lease_bucket(nc.jetstream(timeout=20.0), ttl_s=ttl, bucket="lease_stuck")
        lease = LeaderLease(kv, ttl_s=ttl, holder="a")
        changes: list[tuple[int, float]] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(lease.run, lambda rev: changes.append((rev, time.monotonic())))
            with anyio.fail_after(5):
                while not lease.is_leader:
                    await anyio.sleep(0.01)
            await anyio.sleep(ttl / 2)  # renewals go through
            assert server.proc is not None
            server.proc.send_signal(signal.SIGSTOP)
            frozen_at = time.monotonic()
            deadline = lease._deadline  # noqa: SLF001 - the last renewal's deadline, before the freeze
            try:
                with anyio.fail_after(3 * ttl):
                    while not any(rev == 0 for rev, _ in changes):
                        await anyio.sleep(0.05)
            finally:
                server.proc.send_signal(signal.SIGCONT)
            tg.cancel_scope.cancel()
        lost_at = next(t for rev, t in changes if rev == 0)
        print(f"\nfrozen {frozen_at:.2f}, deadline {deadline:.2f}, stepped down {lost_at:.2f}")
        # the key expires on the server no earlier than ttl after the last renewal started
        # (deadline = that start + 0.9 ttl): stepping down before that is what fencing needs
        assert deadline <= lost_at < deadline + 0.1 * ttl
        await nc.close()
    finally:
        server.stop()
