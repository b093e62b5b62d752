"""``[daemon] boot_estimate_s`` and ``terminate_billing_s`` reach the core's budget estimates; ``[metrics]
refresh_s`` sets how often the state gauges are recomputed.

A budget keeps the boot of a new node and a termination tail at the worst price in reserve; both were
fixed at 240 s and 60 s, which is what a cloud VM shows but not a local node (seconds to boot, nothing
billed after a kill). Left at their defaults they leave the core's config as before (the persisted meta
record keeps its bytes).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from orchestrator.core import CoreConfig
from orchestrator.daemon.coreapi import default_core
from orchestrator.settings import SettingsError, load_settings


def _config(tmp_path: Path, daemon: str) -> CoreConfig:
    path = tmp_path / "orchd.toml"
    path.write_text(f"[daemon]\n{daemon}\n")
    return default_core(load_settings(path, env={})).empty_state().meta.config


def test_the_settings_reach_the_core(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "boot_estimate_s = 10.0\nterminate_billing_s = 2.0")
    assert (cfg.boot_s_estimate, cfg.terminate_s) == (10.0, 2.0)


def test_defaults_leave_the_core_config_as_it_was(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "")
    assert (cfg.boot_s_estimate, cfg.terminate_s) == (CoreConfig().boot_s_estimate, CoreConfig().terminate_s)
    plain = default_core(load_settings(None, env={})).empty_state().meta.config
    assert msgspec.json.encode(cfg) == msgspec.json.encode(plain)


def test_bad_values_are_listed_together(tmp_path: Path) -> None:
    path = tmp_path / "orchd.toml"
    path.write_text("[daemon]\nboot_estimate_s = 0\nterminate_billing_s = -1\n")
    with pytest.raises(SettingsError) as err:
        load_settings(path, env={})
    assert "daemon.boot_estimate_s" in str(err.value) and "daemon.terminate_billing_s" in str(err.value)


def test_the_gauge_refresh_is_a_setting(tmp_path: Path) -> None:
    """``[metrics] refresh_s``: how often the state gauges are recomputed (10 s unless set; the drill's
    1 s scrapes need 0.5 s); a non-positive value is refused with its key."""
    path = tmp_path / "orchd.toml"
    path.write_text("[metrics]\nrefresh_s = 0.5\n")
    assert load_settings(path, env={}).metrics.refresh_s == 0.5
    assert load_settings(None, env={}).metrics.refresh_s == 10.0
    path.write_text("[metrics]\nrefresh_s = 0\n")
    with pytest.raises(SettingsError, match="metrics.refresh_s"):
        load_settings(path, env={})
