"""Skip marks for tests whose optional packages (an extra) are missing, decided without importing them.

``pytest.importorskip("transformers")`` imports the package into the test process to decide: seconds of CPU for
transformers or accelerate, in a process that does not use them when the ranks or the nodes a test starts do.
``needs(...)`` only looks the packages up (``importlib.util.find_spec``)."""

from __future__ import annotations

import importlib.util

import pytest


def needs(*modules: str) -> pytest.MarkDecorator:
    """Skip unless every module is installed."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"not installed: {', '.join(missing)} (the [hf] extra)")
