"""HA on a 3-server NATS cluster on loopback (JetStream, lease bucket with 3 replicas).

Two lease contenders; first a NATS server is killed (-9): the R3 bucket keeps its quorum (2 of 3) and
a lease holder exists again within 2x TTL; then the leading contender dies (no renewals, no
release): the other takes over within 2x TTL with a greater fencing token. Throughout, the two are
never both ``valid()`` at the same time."""

from __future__ import annotations

import time

import anyio
import nats
import nats.errors
import nats.js.errors
import pytest

from orchestrator.daemon.lease import LeaderLease, lease_bucket
from tests.ha_cluster import connect, nats_cluster

pytestmark = pytest.mark.anyio
TTL = 6.0  # the production default (DaemonSettings.lease_ttl_s): a stream leader election takes ~5 s


@pytest.fixture
def cluster(tmp_path):
    with nats_cluster(tmp_path) as servers:
        yield servers


async def _bucket(nc):
    """JetStream needs a meta leader first: retry while the cluster forms."""
    with anyio.fail_after(20):
        while True:
            try:
                # JetStream API timeout well below TTL/3, so a write stuck in an election cannot hold up
                # the lease loop (nats-py's default is 5 s)
                return await lease_bucket(nc.jetstream(timeout=1.0), ttl_s=TTL, replicas=3, bucket="orch_lease")
            except (nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError, nats.js.errors.APIError):
                await anyio.sleep(0.2)


async def test_lease_fails_over_across_a_3_server_cluster(cluster) -> None:
    s1, s2, s3 = cluster
    nc_a = await connect([s1.url])  # a learns the other servers from s1 and fails over to them
    nc_b = await connect([s2.url, s3.url])
    kv_a = await _bucket(nc_a)
    assert (await kv_a.status()).stream_info.config.num_replicas == 3
    a = LeaderLease(kv_a, ttl_s=TTL, holder="orchd-a")
    b = LeaderLease(await _bucket(nc_b), ttl_s=TTL, holder="orchd-b")
    won: dict[str, list[float]] = {"a": [], "b": []}
    both_valid: list[float] = []

    def note(who: str):
        return lambda rev: won[who].append(time.monotonic()) if rev else None

    async def never_two_leaders() -> None:
        while True:
            if a.valid() and b.valid():
                both_valid.append(time.monotonic())
            await anyio.sleep(0.005)

    async with anyio.create_task_group() as tg:
        tg.start_soon(never_two_leaders)
        tg.start_soon(a.run, note("a"))
        with anyio.fail_after(5):
            while not a.is_leader:
                await anyio.sleep(0.02)
        tg.start_soon(b.run, note("b"))
        await anyio.sleep(TTL / 2)
        assert a.valid() and not b.is_leader

        # 1. a NATS server dies (possibly the lease stream's leader): a lease holder exists again
        #    within 2x TTL (a after reconnecting, or b if a's deadline passed during the election)
        last_write = max(a._rev, b._rev)  # noqa: SLF001
        killed_at = time.monotonic()
        s1.kill()
        with anyio.fail_after(2 * TTL):  # a lease write accepted by the surviving majority
            while not any(c.valid() and c._rev > last_write for c in (a, b)):  # noqa: SLF001
                await anyio.sleep(0.01)
        held_again_s = time.monotonic() - killed_at

        # 2. the leader orchd dies (no renewals, no release): the other one takes over within 2x TTL
        leader, leader_nc, standby = (a, nc_a, b) if a.valid() else (b, nc_b, a)
        term = leader.revision
        crashed_at = time.monotonic()
        await leader_nc.close()
        leader_deadline = 0.0
        with anyio.fail_after(2 * TTL + 1):
            while not standby.is_leader:
                leader_deadline = max(leader_deadline, leader._deadline)  # noqa: SLF001
                await anyio.sleep(0.005)
        took_over_s = time.monotonic() - crashed_at
        won_at = won["a" if standby is a else "b"][-1]
        assert not leader.valid() and 0 < leader_deadline <= won_at
        assert standby.revision > term  # fencing token grows
        tg.cancel_scope.cancel()

    print(f"\nafter killing a server: lease renewed/acquired again in {held_again_s:.2f}s; "
          f"after killing the leader: taken over in {took_over_s:.2f}s (TTL {TTL}s)")
    assert both_valid == [], "two contenders were valid leaders at the same time"
    assert took_over_s < 2 * TTL
    for nc in (nc_a, nc_b):
        if not nc.is_closed:
            await nc.close()
