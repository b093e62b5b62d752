"""Fixtures of the trainer's tests: ``backend``, each checkpoint store the trainer writes (local files, and
s3, gs and az against their emulators: ``tests/conftest.py`` ``object_stores``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.storage_emulators import Store

KINDS = ["file", "s3", "gs", "az"]


@pytest.fixture(params=KINDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path, object_stores: Callable[[str], Store]) -> Store:
    if request.param == "file":
        return Store("file", str(tmp_path), {}, None, lambda: None)
    return object_stores(request.param)
