"""Integration tests of the shell run on anyio's asyncio backend (nats-py is asyncio-only)."""

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
