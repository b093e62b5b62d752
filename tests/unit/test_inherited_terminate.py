"""A Terminate that a new leader inherits from the outbox (decided, maybe executed, by the previous
leader, which could not record it) asks the provider first: an instance already going is not terminated a
second time by a second daemon. So does a Terminate of an instance the state does not own. Any other
Terminate decided by this daemon calls terminate at once."""

from __future__ import annotations

import anyio
import pytest

import wire as ev
from orchestrator.core.commands import Terminate
from orchestrator.core.inputs import NodeGone
from orchestrator.daemon.executor import Executor
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.records import Result
from orchestrator.settings import Settings
from providers.base import TAG_CLUSTER, InstanceState
from simulations.fakecloud import FakeCloud

pytestmark = pytest.mark.anyio
POOL = ev.PoolKey(cloud="fake", region="r1", zone="r1a", instance_type="gpu.x1", market=ev.Market.SPOT)


async def _terminate(cloud: FakeCloud, instance_id: ev.InstanceId, *, inherited: bool, reason: str = "") -> tuple:
    settings = Settings()
    results: list[Result] = []
    executor = Executor(settings, {"fake": cloud}, None, results.append, Metrics(),  # type: ignore[arg-type]
                        nats_urls=("nats://127.0.0.1:4222",))
    async with anyio.create_task_group() as tg:
        await tg.start(executor.run)
        executor.submit("t", Terminate(node_id=ev.NodeId("n1"), instance_id=instance_id, pool=POOL, reason=reason),
                        inherited=inherited)
        with anyio.fail_after(5):
            while not results:
                await anyio.sleep(0.02)
        tg.cancel_scope.cancel()
    return results[0].events


@pytest.mark.parametrize("inherited", [True, False])
async def test_an_instance_already_terminated(inherited: bool) -> None:
    cloud = FakeCloud()
    inst = cloud.add_instance(POOL, tags={TAG_CLUSTER: Settings().daemon.cluster_id})
    cloud.preempt(inst.instance_id)  # the previous leader's terminate went through
    events = await _terminate(cloud, inst.instance_id, inherited=inherited)
    assert events == (NodeGone(node_id=ev.NodeId("n1"), instance_id=inst.instance_id, reason="terminated_by_us"),)
    assert cloud.terminate_calls == (0 if inherited else 1)


async def test_an_inherited_terminate_of_a_running_instance_terminates_it() -> None:
    cloud = FakeCloud()
    inst = cloud.add_instance(POOL, tags={TAG_CLUSTER: Settings().daemon.cluster_id})
    events = await _terminate(cloud, inst.instance_id, inherited=True)
    assert [e.reason for e in events] == ["terminated_by_us"]
    assert cloud.terminate_calls == 1
    assert cloud.describe([inst.instance_id])[0].state == InstanceState.TERMINATED


@pytest.mark.parametrize("reason", ["unknown_node", "other_launch_token", "second_instance"])
async def test_an_unowned_instance_already_terminated(reason: str) -> None:
    """A launch re-executed by a new leader returns an instance the previous leader had already terminated:
    the core decides a Terminate of an instance it does not own, and the executor asks the provider first
    (found by the partition drill ``asymmetric_in``: the cloud counted one instance terminated by both)."""
    cloud = FakeCloud()
    inst = cloud.add_instance(POOL, tags={TAG_CLUSTER: Settings().daemon.cluster_id})
    cloud.preempt(inst.instance_id)
    events = await _terminate(cloud, inst.instance_id, inherited=False, reason=reason)
    assert [e.reason for e in events] == ["terminated_by_us"]
    assert cloud.terminate_calls == 0
