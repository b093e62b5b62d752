"""Ops tests run their async parts on anyio's asyncio backend (nats-py is asyncio only)."""

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
