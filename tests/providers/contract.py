"""The ``CloudProvider`` contract (providers/base.py), checked through a provider's public methods only.

Each provider's test module drives its provider against that cloud's fake endpoint (moto for AWS, the
wire-level fakes in tests/providers/fakes for GCP and Azure, the in-memory FakeCloud) and calls
``check_cloud_provider_contract``: launch is idempotent and tags every instance with the cluster id,
list_instances and describe show exactly those instances, terminate removes them (unknown or already
terminated ids are not an error), terminate never touches an instance created outside orchd (no cluster
tag, or another cluster's: refused, reported as ForeignInstanceError, left running) while it still
terminates the cluster's own ids of the same call, and prices quotes only the configured pools.

``foreign(tags)`` creates an instance directly on the fake endpoint (not through the provider), carrying
exactly ``tags``, and returns its instance id as the provider names it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import pytest

from providers.base import (
    TAG_CLUSTER,
    TAG_JOB,
    TAG_NODE,
    TAG_TOKEN,
    CloudProvider,
    ForeignInstanceError,
    Instance,
    PriceQuote,
)
from tests.providers.helpers import request
from wire import InstanceId, PoolKey

Foreign = Callable[[Mapping[str, str]], InstanceId]


def check_cloud_provider_contract(provider: CloudProvider, pool: PoolKey, cluster: str, *, unknown_id: str,
                                  configured: Sequence[PoolKey], priced: Sequence[PoolKey],
                                  foreign: Foreign) -> None:
    """``pool`` must have room for three nodes and ``cluster`` must be unused. ``prices()`` must quote every
    pool of ``priced`` (the fake has a price for them) and no pool outside ``configured``."""
    assert isinstance(provider, CloudProvider)
    assert provider.cloud == pool.cloud
    ids = _launch_is_tagged_and_idempotent(provider, pool, cluster)
    _listed_and_described(provider, cluster, ids)
    _terminate_removes(provider, cluster, ids, unknown_id)
    check_terminate_spares_foreign(provider, pool, cluster, foreign)
    _prices_for_configured_pools(provider, pool, configured, priced)


def _launch_is_tagged_and_idempotent(provider: CloudProvider, pool: PoolKey, cluster: str) -> list[InstanceId]:
    req = request(pool, 2, cluster=cluster, job="contract")
    res = provider.launch(req)
    assert (res.missing, res.failure, len(res.instances)) == (0, None, 2)
    assert {i.node_id for i in res.instances} == set(req.node_ids)
    for inst in res.instances:
        _assert_ours(inst, pool, cluster)
        assert inst.tags[TAG_TOKEN] == req.idempotency_token and inst.tags[TAG_JOB] == "contract"
    again = provider.launch(req)  # the same token: the first call's instances, no new ones
    assert sorted(i.instance_id for i in again.instances) == sorted(i.instance_id for i in res.instances)
    return [i.instance_id for i in res.instances]


def _listed_and_described(provider: CloudProvider, cluster: str, ids: list[InstanceId]) -> None:
    listed = provider.list_instances(cluster)
    assert sorted(i.instance_id for i in listed) == sorted(ids)
    assert all(i.tags[TAG_CLUSTER] == cluster and i.alive for i in listed)
    assert provider.list_instances(cluster + "-nobody") == []  # scoped to the cluster id
    described = provider.describe(ids)
    assert sorted(i.instance_id for i in described) == sorted(ids)
    assert {i.instance_id: i.node_id for i in described} == {i.instance_id: i.node_id for i in listed}


def _terminate_removes(provider: CloudProvider, cluster: str, ids: list[InstanceId], unknown_id: str) -> None:
    victim, survivor = ids
    provider.terminate([victim, InstanceId(unknown_id)], cluster)  # an unknown id is not an error
    assert [i.instance_id for i in provider.list_instances(cluster)] == [survivor]
    assert all(not i.alive for i in provider.describe([victim]))  # gone, or known as terminated
    assert provider.describe([InstanceId(unknown_id)]) == []
    provider.terminate(ids, cluster)  # one already terminated: not an error either
    assert provider.list_instances(cluster) == []


def check_terminate_spares_foreign(provider: CloudProvider, pool: PoolKey, cluster: str, foreign: Foreign) -> None:
    """Instances created outside orchd (untagged; tagged for another cluster) in the same account are
    refused by ``terminate`` even when asked for together with one of ours: ours goes, they stay."""
    res = provider.launch(request(pool, 1, cluster=cluster, job="contract-foreign"))
    (ours,) = [i.instance_id for i in res.instances]
    untagged = foreign({})
    other = foreign({TAG_CLUSTER: cluster + "-other", TAG_NODE: "contract-foreign-n0"})
    assert {i.instance_id for i in provider.list_instances(cluster)} == {ours}  # not listed as ours either
    with pytest.raises(ForeignInstanceError) as refused:
        provider.terminate([untagged, ours, other], cluster)
    assert sorted(refused.value.instance_ids) == sorted([untagged, other])
    assert not refused.value.retryable
    assert provider.list_instances(cluster) == []  # ours was terminated all the same
    assert all(not i.alive for i in provider.describe([ours]))
    spared = provider.describe([untagged, other])
    assert sorted(i.instance_id for i in spared) == sorted([untagged, other])
    assert all(i.alive for i in spared)  # the other workload is untouched
    with pytest.raises(ForeignInstanceError):  # alone, and again: still refused, still there
        provider.terminate([other], cluster)
    assert all(i.alive for i in provider.describe([untagged, other]))
    provider.terminate([ours], cluster)  # ours, already terminated: not an error


def _prices_for_configured_pools(provider: CloudProvider, pool: PoolKey, configured: Sequence[PoolKey],
                                 priced: Sequence[PoolKey]) -> None:
    quotes = provider.prices()
    assert all(isinstance(q, PriceQuote) for q in quotes)
    quoted = [q.pool for q in quotes]
    assert len(set(quoted)) == len(quoted)  # one quote per pool
    assert set(priced) <= set(quoted) <= set(configured)
    for q in quotes:
        assert q.price_usd_h > 0 and q.gpus_per_node >= 1 and q.gpu_type and q.ts > 0
        assert q.on_demand_usd_h is None or q.on_demand_usd_h > 0
    if pool in priced:
        (only,) = provider.prices([pool])  # asked for one pool: that pool's quote alone
        assert only.pool == pool


def _assert_ours(inst: Instance, pool: PoolKey, cluster: str) -> None:
    assert inst.alive and inst.pool == pool
    assert inst.tags[TAG_CLUSTER] == cluster and inst.tags[TAG_NODE] == inst.node_id
