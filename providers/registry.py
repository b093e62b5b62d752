"""Build the enabled providers from Settings, importing cloud SDK modules only for enabled clouds.

Role: the one place orchd turns ``[providers]`` into ``CloudProvider`` objects. A control host installed
without the ``[aws]``/``[gcp]``/``[azure]`` extras works as long as those clouds are not enabled; an
enabled cloud whose SDK is missing is a configuration error that names the extra to install. Every
problem of every enabled provider is reported in one ``SettingsError``.

Also ``feed_plan``: which price feeds to run and at what interval (``[providers.feeds.<cloud>]``).

Contract for a provider module (aws, gcp, azure, and ``providers.local`` owned by the local-provider
work): a class with ``from_settings(raw: Mapping) -> CloudProvider`` that validates its table.

Pure start-up code: no network calls (SDK clients are created on first use).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator.settings import FeedSettings, Settings, SettingsError
from providers.base import CloudProvider

# name -> (module, class, modules that must be importable, pip extra)
PROVIDERS: dict[str, tuple[str, str, tuple[str, ...], str]] = {
    "aws": ("providers.aws", "AwsProvider", ("boto3", "botocore"), "aws"),
    "gcp": ("providers.gcp", "GcpProvider", ("google.cloud.compute_v1", "google.cloud.billing_v1"), "gcp"),
    "azure": ("providers.azure", "AzureProvider", ("azure.mgmt.compute", "azure.identity", "requests"), "azure"),
    "local": ("providers.local", "LocalProvider", (), ""),
}
DEFAULT_FEED_INTERVAL_S = {"aws": 300.0, "gcp": 3600.0, "azure": 3600.0}
"""AWS spot prices move hourly at most; GCP and Azure list prices change rarely (monthly)."""


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def build_providers(settings: Settings) -> dict[str, CloudProvider]:
    """The enabled providers by name. Raises SettingsError listing every problem."""
    out: dict[str, CloudProvider] = {}
    problems: list[str] = []
    for name in settings.providers.enabled:
        raw: Mapping[str, Any] = getattr(settings.providers, name)
        if name == "fake":
            out[name] = _fake(raw, problems)
            continue
        module_name, cls_name, needs, extra = PROVIDERS[name]
        missing = [m for m in needs if not _importable(m)]
        if missing:
            problems.append(f"providers.{name}: SDK not installed ({', '.join(missing)}): "
                            f"pip install 'spot-orchestrator[{extra}]'")
            continue
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            problems.append(f"providers.{name}: cannot import {module_name}: {e}")
            continue
        cls = getattr(module, cls_name, None)
        factory = getattr(cls, "from_settings", None) or getattr(module, "from_settings", None)
        if factory is None:
            problems.append(f"providers.{name}: {module_name} has no from_settings()")
            continue
        try:
            provider = factory(raw)
        except SettingsError as e:
            problems += e.problems
            continue
        if not isinstance(provider, CloudProvider):
            problems.append(f"providers.{name}: {module_name}.from_settings did not return a CloudProvider")
            continue
        out[name] = provider
    if problems:
        raise SettingsError(problems, "providers")
    return out


def _fake(raw: Mapping[str, Any], problems: list[str]) -> CloudProvider:
    from providers.fake import FakeCloud

    known = {"gpu_type": str, "gpus_per_node": int}
    kw = {}
    for k, v in raw.items():
        if k not in known:
            problems.append(f"providers.fake.{k}: unknown key (known: {', '.join(sorted(known))})")
        elif not isinstance(v, known[k]):
            problems.append(f"providers.fake.{k}: expected {known[k].__name__}, got {v!r}")
        else:
            kw[k] = v
    return FakeCloud("fake", **kw)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class FeedPlan:
    cloud: str
    provider: CloudProvider
    interval_s: float


def feed_plan(settings: Settings, providers: Mapping[str, CloudProvider]) -> list[FeedPlan]:
    """One price feed per enabled cloud provider, unless ``[providers.feeds.<cloud>] enabled = false``."""
    out = []
    for name, provider in providers.items():
        if name in ("local", "fake") and name not in settings.providers.feeds:
            continue  # no market to watch unless asked
        fs = settings.providers.feeds.get(name) or FeedSettings(interval_s=DEFAULT_FEED_INTERVAL_S.get(name, 300.0))
        if fs.enabled:
            out.append(FeedPlan(name, provider, fs.interval_s))
    return out
