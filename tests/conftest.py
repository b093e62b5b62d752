"""Shared fixtures: a real nats-server per test module, free ports, CI strictness, the async backend.

Services a test needs are started here on loopback with free ports and stopped after. Async tests are
``async def`` functions marked ``pytest.mark.anyio`` (usually a module's ``pytestmark``); they run on the
``anyio_backend`` defined here, once for the whole suite.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

from orchestrator.natsserver import NatsServer

if TYPE_CHECKING:
    from tests.storage_emulators import Store

IN_CI = os.environ.get("ORCH_CI") == "1"

# A suite started in the background (a shell runs asynchronous commands with SIGINT ignored) would hand the
# ignore on to every process a test starts, and the Ctrl-C tests would see it ignored: the processes of
# the suite get SIGINT as a terminal sends it (a handler here is reset to the default in a child).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def require_tool(name: str) -> str:
    """Path of an external tool; skip where it is missing, except in CI (.ci/run sets ORCH_CI=1)."""
    path = shutil.which(name)
    if path is None:
        if IN_CI:
            pytest.fail(f"{name} is required in CI but not installed (.ci/run should install it)")
        pytest.skip(f"{name} not installed")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def anyio_backend() -> str:
    """Async tests (``pytest.mark.anyio``) run on anyio's asyncio backend: nats-py is asyncio-only."""
    return "asyncio"


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A real nats-server with JetStream, one per test module."""
    server = NatsServer(tmp_path_factory.mktemp("nats"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
def object_stores() -> Iterator[Callable[[str], Store]]:
    """``get(kind)``: the s3 (moto), gs (gcp-storage-emulator) or az (Azurite) store, started on first use
    on loopback and kept for the session; skipped where the emulator is missing, except in CI."""
    from tests import storage_emulators

    started: dict[str, Store] = {}

    def get(kind: str) -> Store:
        if kind not in started:
            try:
                started[kind] = storage_emulators.start(kind)
            except FileNotFoundError as e:
                if IN_CI:
                    pytest.fail(f"the {kind} emulator ({e}) is required in CI but not installed (.ci/run installs it)")
                pytest.skip(f"the {kind} emulator is not installed: {e}")
        return started[kind]

    try:
        yield get
    finally:
        for store in started.values():
            store.stop()
