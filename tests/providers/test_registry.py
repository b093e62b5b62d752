"""build_providers from Settings: enabled clouds only, every problem listed, SDK absence named."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from orchestrator.daemon.registry import build_providers, feed_plan
from orchestrator.settings import Settings, SettingsError, load_settings
from providers.aws import AwsProvider
from providers.azure import AzureProvider
from providers.gcp import GcpProvider
from simulations.fakecloud import FakeCloud

CONFIG = Path(__file__).resolve().parents[2] / "config" / "clouds"


def _settings(tmp_path: Path, text: str) -> Settings:
    f = tmp_path / "orchd.toml"
    f.write_text(textwrap.dedent(text))
    return load_settings(f, env={})


def test_builds_enabled_providers_only(tmp_path: Path) -> None:
    s = _settings(tmp_path, """
        [providers]
        enabled = ["aws", "gcp", "azure", "fake"]
        [providers.aws]
        zones = ["us-east-1a"]
        instance_types = ["g5.xlarge"]
        images = { "us-east-1" = "ami-0123" }
        [providers.gcp]
        project = "p"
        zones = ["us-central1-a"]
        [providers.azure]
        subscription_id = "s"
        resource_group = "rg"
        [providers.feeds.aws]
        interval_s = 120
        [providers.feeds.azure]
        enabled = false
    """)
    ps = build_providers(s)
    assert isinstance(ps["aws"], AwsProvider) and isinstance(ps["gcp"], GcpProvider)
    assert isinstance(ps["azure"], AzureProvider) and isinstance(ps["fake"], FakeCloud)
    plan = {f.cloud: f.interval_s for f in feed_plan(s, ps)}
    assert plan == {"aws": 120.0, "gcp": 3600.0}


def test_orchestrator_registry_finds_module_entry_points(tmp_path: Path) -> None:
    """The daemon's own registry (orchestrator/registry.py) imports providers.<name>.from_settings."""
    import importlib

    for name, cls in (("aws", AwsProvider), ("gcp", GcpProvider), ("azure", AzureProvider)):
        mod = importlib.import_module(f"providers.{name}")
        raw = {"aws": {}, "gcp": {"project": "p"}, "azure": {"subscription_id": "s", "resource_group": "r"}}[name]
        assert isinstance(mod.from_settings(raw), cls)


def test_every_problem_in_one_error(tmp_path: Path) -> None:
    s = _settings(tmp_path, """
        [providers]
        enabled = ["aws", "gcp", "azure", "fake"]
        [providers.aws]
        zones = ["eu-west-1a"]
        bogus = 1
        [providers.gcp]
        zones = ["central"]
        [providers.azure]
        eviction_policy = "Never"
        [providers.fake]
        colour = "red"
    """)
    with pytest.raises(SettingsError) as e:
        build_providers(s)
    text = str(e.value)
    for needle in ("providers.aws.bogus", "providers.gcp.project", "providers.gcp.zones",
                   "providers.azure.subscription_id", "providers.azure.eviction_policy", "providers.fake.colour"):
        assert needle in text


@pytest.mark.parametrize("name", ["aws.toml", "gcp.toml", "azure.toml"])
def test_example_configs_load(name: str) -> None:
    s = load_settings(CONFIG / name, env={})
    ps = build_providers(s)
    assert set(ps) == set(s.providers.enabled)


def test_control_host_without_sdks(tmp_path: Path) -> None:
    """With the cloud SDKs hidden, a fake-only config builds and an aws config names the extra to install."""
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("boto3", "botocore", "google", "azure"):
                    raise ModuleNotFoundError(name)
                return None
        sys.meta_path.insert(0, Block())
        from orchestrator.settings import load_settings
        from orchestrator.daemon.registry import build_providers
        import tomllib, pathlib
        ok = build_providers(load_settings(sys.argv[1], env={}))
        assert list(ok) == ["fake"], ok
        try:
            build_providers(load_settings(sys.argv[2], env={}))
        except Exception as e:
            print(e)
        for m in ("boto3", "google.cloud.compute_v1", "azure.mgmt.compute"):
            assert m not in sys.modules, m
    """)
    fake = tmp_path / "fake.toml"
    fake.write_text('[providers]\nenabled = ["fake"]\n')
    aws = tmp_path / "aws.toml"
    aws.write_text('[providers]\nenabled = ["aws"]\n')
    r = subprocess.run([sys.executable, "-c", code, str(fake), str(aws)], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[2], timeout=60)
    assert r.returncode == 0, r.stderr
    assert "pip install 'spot-orchestrator[aws]'" in r.stdout
