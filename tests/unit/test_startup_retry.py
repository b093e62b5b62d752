"""orchd's JetStream set-up at start (``startup.retrying``) waits out a cluster that is still forming: a
replicated stream that cannot be placed yet ("no suitable peers for placement", JetStream error 10005) is
retried like a timeout; any other JetStream error is raised at once. Found by the partition drills: an
orchd started just after its 3 servers exited with 10005 while creating its R3 KV bucket."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import nats.js.errors
import pytest

from orchestrator.daemon.startup import JS_NO_SUITABLE_PEERS, retrying

pytestmark = pytest.mark.anyio


def _failing(errors: list[Exception]) -> tuple[list[int], Callable[[], Awaitable[str]]]:
    calls: list[int] = []

    async def call() -> str:
        calls.append(1)
        if errors:
            raise errors.pop(0)
        return "created"

    return calls, call


async def test_no_suitable_peers_is_retried() -> None:
    no_peers = nats.js.errors.BadRequestError(code=400, err_code=JS_NO_SUITABLE_PEERS,
                                              description="no suitable peers for placement, peer offline")
    calls, call = _failing([no_peers, no_peers])
    with anyio.fail_after(10):
        assert await retrying(lambda: False, "ensure_topology", call) == "created"
    assert len(calls) == 3


async def test_other_jetstream_errors_are_raised_at_once() -> None:
    changed = nats.js.errors.BadRequestError(code=400, err_code=10058, description="stream name already in use")
    calls, call = _failing([changed])
    with pytest.raises(nats.js.errors.BadRequestError):
        await retrying(lambda: False, "ensure_topology", call)
    assert len(calls) == 1


async def test_no_suitable_peers_gives_up_when_stopping() -> None:
    no_peers = nats.js.errors.BadRequestError(code=400, err_code=JS_NO_SUITABLE_PEERS, description="no peers")
    calls, call = _failing([no_peers])
    with pytest.raises(nats.js.errors.BadRequestError):
        await retrying(lambda: True, "ensure_topology", call)
    assert len(calls) == 1
