"""A node event that the trust gate refuses as ahead of the state (``bad_generation``: a generation newer
than its node's record) is not termed at once: after a crash between a batch's outbox and its records,
orchd re-executes the outbox's commands from an older state, and an agent can start the generation they
order - and report it - before the redelivered message that decided it brings the state there (found by
the chaos drill's zone-wide burst with kill -9: the report was termed, the job waited in STARTING until
its start timeout). It comes back ``retry_s`` x its deliveries later, counted once, and is termed
at the delivery before the one that would park it. One behind the state (``stale_generation``) is termed
at once. Real nats-server and JetStream consumer, the real core and gate."""

from __future__ import annotations

import nats
import pytest

import wire as ev
from orchestrator import bus
from orchestrator.core import State
from orchestrator.core.inputs import JobSubmitted
from orchestrator.core.model import CoreConfig
from orchestrator.daemon import pipeline, records
from orchestrator.daemon.coreapi import default_core
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.records import Batch
from orchestrator.settings import Settings
from tests.core.harness import Driver, price, spec
from tests.core.test_price_confirm import A_OD, A
from wire import GenerationStarted

pytestmark = pytest.mark.anyio
DEAD_AFTER = 5


def _started_node() -> tuple[State, str]:
    """A job whose one node was told to start generation 1 (its record at generation 1)."""
    drv = Driver(State.empty(CoreConfig(price_confirm_s=0.0)))
    drv(price(A, 10.0))
    drv(price(A_OD, 30.0, None))
    ids = drv.launched(drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_min=1, nodes_max=1, total_steps=1000))))
    drv.register(ids)
    assert drv.state.nodes[ids[0]].generation == 1
    return drv.state, ids[0]


def _refused(metrics: Metrics, reason: str) -> float:
    return metrics.rejected.labels("GenerationStarted", reason)._value.get()


async def test_an_event_ahead_of_the_state_comes_back_later_counted_once(nats_server) -> None:
    state, node = _started_node()
    core, metrics = default_core(Settings()), Metrics()
    nc = await nats.connect(nats_server.url)
    try:
        await bus.ensure_topology(nc)
        js = nc.jetstream()
        sub = await js.pull_subscribe(ev.subject_node_event(node), durable="ahead-test", stream=bus.STREAM_EVENTS)
        ahead = GenerationStarted(id="g2", node_id=node, job_id="j1", generation=2, first_step=1, ts=1.0)
        await js.publish(ev.subject_node_event(node), ev.encode(ahead))

        async def decide_one() -> tuple[records.Decided, object]:
            (msg,) = await sub.fetch(1, timeout=20)
            decider = pipeline.Decider(core, state, metrics=metrics, on_decision=lambda e, d: None)
            decided = pipeline.decide_batch(Batch([("events", msg)], [], []), decider, dead_after=DEAD_AFTER,
                                            retry_s=1.0)  # back after 1, 2, 3 s
            await pipeline.acknowledge(decided)
            return decided, msg

        for delivery in range(1, DEAD_AFTER - 1):  # 1..3: naked, back later, counted once
            decided, msg = await decide_one()
            assert bus.num_delivered(msg) == delivery
            assert decided.to_retry == [(msg, 1.0 * delivery)] and not decided.to_term and not decided.to_ack
            assert _refused(metrics, "bad_generation") == 1
            if delivery == 1:
                with pytest.raises(nats.errors.TimeoutError):
                    await sub.fetch(1, timeout=0.5)  # not before its delay (1 s)
        decided, msg = await decide_one()  # delivery 4: the last retry is over, termed (never parked)
        assert bus.num_delivered(msg) == DEAD_AFTER - 1 and decided.to_term == [msg] and not decided.to_retry
        with pytest.raises(nats.errors.TimeoutError):
            await sub.fetch(1, timeout=2.0)  # not redelivered any more

        behind = GenerationStarted(id="g0", node_id=node, job_id="j1", generation=0, first_step=1, ts=1.0)
        await js.publish(ev.subject_node_event(node), ev.encode(behind))
        decided, msg = await decide_one()
        assert decided.to_term == [msg] and not decided.to_retry  # behind the state: never right later
        assert _refused(metrics, "stale_generation") == 1
    finally:
        await nc.close()


@pytest.mark.parametrize("ttl", [2.0, 6.0, 20.0, 30.0])
def test_the_retries_outlast_the_ack_wait_at_any_lease_ttl(ttl: float) -> None:
    """The report must still be there when the message that decided its generation is redelivered, one
    ack wait (``bus.ack_wait_s``, which grows with the lease TTL) after it reached the daemon that crashed."""
    dead_after = Settings().daemon.dead_after_deliveries
    ack_wait = bus.ack_wait_s(ttl)
    window = sum(pipeline.retry_ahead_s(ack_wait) * n for n in range(1, dead_after - 1))
    assert window > ack_wait
