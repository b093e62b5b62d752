"""Shared helpers for provider tests: requests to build, and a before-call hook that injects AWS errors."""

from __future__ import annotations

import uuid
from typing import Any

from providers.base import LaunchRequest, NodeBootstrap
from wire import Market, NodeId, PoolKey


def request(pool: PoolKey, n: int, *, cluster: str, job: str = "job-1", token: str | None = None,
            bootstrap: bool = True) -> LaunchRequest:
    nodes = tuple(NodeId(f"{job}-n{i}") for i in range(n))
    return LaunchRequest(
        pool=pool,
        node_ids=nodes,
        idempotency_token=token or uuid.uuid4().hex,
        cluster_id=cluster,
        job_id=job,
        bootstrap=NodeBootstrap(nats_urls=("nats://10.0.0.1:4222",),
                                node_credentials={n: f"enrol-{n}" for n in nodes}) if bootstrap else None,
    )


def pool(cloud: str, region: str, zone: str, itype: str, market: Market = Market.SPOT) -> PoolKey:
    return PoolKey(cloud=cloud, region=region, zone=zone, instance_type=itype, market=market)


class _HttpStatus:
    def __init__(self, status: int) -> None:
        self.status_code = status
        self.headers: dict[str, str] = {}
        self.content = b""


class AwsErrorInjector:
    """A botocore ``before-call`` handler: lets ``after`` calls through, then answers with an error.

    This is the SDK's own event hook (the same mechanism botocore's Stubber uses), so everything above
    the HTTP layer - parsing into ClientError, the provider's mapping - is the real code."""

    def __init__(self, code: str, *, status: int = 400, after: int = 0, times: int | None = None) -> None:
        self.code, self.status, self.after, self.times = code, status, after, times
        self.calls = 0
        self.injected = 0

    def __call__(self, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls <= self.after or (self.times is not None and self.injected >= self.times):
            return None
        self.injected += 1
        return (_HttpStatus(self.status),
                {"Error": {"Code": self.code, "Message": "injected by test"},
                 "ResponseMetadata": {"HTTPStatusCode": self.status}})
