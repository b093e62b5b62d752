"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.natsserver import NatsServer


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NatsServer]:
    """A real nats-server with JetStream on loopback, on free ports, stopped after the test."""
    s = NatsServer(tmp_path / "nats").start()
    yield s
    s.cleanup()
