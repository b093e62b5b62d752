"""A 3-server NATS cluster on loopback (JetStream on each, routes between them) for the HA tests.

Used by ``tests/ops/test_ha_cluster.py`` (two lease contenders) and
``tests/integration/test_ha_cluster_orchd.py`` (two orchd processes)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import nats
import nats.errors
import nats.js.errors
from nats.js.api import StreamConfig

from orchestrator.natsserver import NatsServer
from orchestrator.security.nats_auth import render_server_config
from tests.conftest import free_port

JS_NOT_READY = (nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError, nats.js.errors.APIError,
                nats.errors.NoRespondersError)


@contextmanager
def nats_cluster(tmp_path: Path, n: int = 3, auth_include: str | None = None) -> Iterator[list[NatsServer]]:
    """n nats-servers (nats-1..nats-n) clustered on loopback; stopped and removed on exit.
    ``auth_include``: an authorization file in ``tmp_path`` every server includes (None: no auth)."""
    cports = [free_port() for _ in range(n)]
    routes = [f"nats-route://127.0.0.1:{p}" for p in cports]
    servers = []
    try:
        for i, cport in enumerate(cports, start=1):
            conf = tmp_path / f"cluster-{i}.conf"
            conf.write_text(render_server_config(
                auth_include=auth_include, host="127.0.0.1", port=-1, store_dir=None, http_port=None,
                server_name=f"nats-{i}", cluster={"name": "orch", "host": "127.0.0.1", "port": cport,
                                                  "routes": routes}))
            servers.append(NatsServer(tmp_path / f"s{i}", config_file=str(conf), name=f"nats-{i}"))
        for s in servers:
            s.start()
        yield servers
    finally:
        for s in servers:
            s.cleanup()


async def connect(urls: list[str]):
    """A test client that reconnects forever and keeps quiet about the servers killed on purpose."""

    async def quiet(_e: Exception) -> None:
        return None

    return await nats.connect(servers=urls, error_cb=quiet, max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                              connect_timeout=1)


async def wait_jetstream(nc, replicas: int = 3, timeout_s: float = 20.0) -> None:
    """Until the cluster has a JetStream meta leader and can place an R``replicas`` stream."""
    js = nc.jetstream(timeout=1.0)
    with anyio.fail_after(timeout_s):
        while True:
            try:
                await js.add_stream(StreamConfig(name="ha_probe", subjects=["ha.probe"], num_replicas=replicas))
                await js.delete_stream("ha_probe")
                return
            except JS_NOT_READY:
                await anyio.sleep(0.2)
