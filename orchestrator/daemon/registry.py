"""Build the enabled providers from Settings: the one place orchd turns ``[providers]`` into
``CloudProvider`` objects, and ``feed_plan``, which price feeds to run and how often.

Cloud SDK modules are imported only for enabled clouds: a control host installed without the
``[aws]``/``[gcp]``/``[azure]`` extras works as long as those clouds are not enabled; an enabled cloud
whose SDK is missing is a configuration error that names the extra to install. Every problem of every
enabled provider is reported in one ``SettingsError``.

A provider module (``providers.aws``, ``providers.gcp``, ``providers.azure``, ``providers.local``, and
the plugin ``simulations.fakecloud`` behind the name ``fake``) has ``from_settings(table) ->
CloudProvider``, which validates its own table and raises SettingsError. Plugins are imported by name,
so no production package imports them. Embedders (tests, the demo) may skip this and pass their own
registry to ``run_daemon``.

Start-up code: no network calls (SDK clients are created on first use).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator.settings import FeedSettings, ProvidersSettings, Settings, SettingsError
from providers.base import CloudProvider
from wire.names import BadName, check_pool_key

PROVIDERS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "aws": ("providers.aws", ("boto3", "botocore"), "aws"),
    "gcp": ("providers.gcp", ("google.cloud.compute_v1", "google.cloud.billing_v1"), "gcp"),
    "azure": ("providers.azure", ("azure.mgmt.compute", "azure.identity", "requests"), "azure"),
    "local": ("providers.local", (), ""),
    "fake": ("simulations.fakecloud", (), ""),
}
"""name -> (module with ``from_settings``, modules that must be importable, pip extra)."""
DEFAULT_FEED_INTERVAL_S = {"aws": 300.0, "gcp": 3600.0, "azure": 3600.0}
"""AWS spot prices move hourly at most; GCP and Azure list prices change rarely (monthly)."""


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def build_providers(settings: Settings | ProvidersSettings) -> dict[str, CloudProvider]:
    """The enabled providers by name. Raises SettingsError listing every problem."""
    out, problems = providers_and_problems(settings)
    if problems:
        raise SettingsError(problems, "providers")
    return out


def providers_and_problems(settings: Settings | ProvidersSettings) -> tuple[dict[str, CloudProvider], list[str]]:
    """(the providers that could be built, every problem of every enabled provider's table): orchd's start
    joins these to the settings' own problems in one report."""
    section = settings.providers if isinstance(settings, Settings) else settings
    out: dict[str, CloudProvider] = {}
    problems: list[str] = []
    for name in section.enabled:
        provider = _build_one(name, getattr(section, name), problems)
        if provider is not None:
            out[name] = provider
    return out, problems


def _build_one(name: str, table: Mapping[str, Any], problems: list[str]) -> CloudProvider | None:
    module_name, needs, extra = PROVIDERS[name]
    missing = [m for m in needs if not _importable(m)]
    if missing:
        problems.append(f"providers.{name}: SDK not installed ({', '.join(missing)}): "
                        f"pip install 'spot-orchestrator[{extra}]'")
        return None
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        problems.append(f"providers.{name}: cannot import {module_name}: {e}")
        return None
    factory = getattr(module, "from_settings", None)
    if factory is None:
        problems.append(f"providers.{name}: {module_name} has no from_settings()")
        return None
    try:
        provider = factory(table)
    except SettingsError as e:
        problems += e.problems
        return None
    except (ValueError, TypeError, OSError, LookupError) as e:  # a provider that checks late: still one line
        text = str(e)
        problems.append(text if text.startswith(f"providers.{name}") else f"providers.{name}: {text}")
        return None
    if not isinstance(provider, CloudProvider):
        problems.append(f"providers.{name}: {module_name}.from_settings did not return a CloudProvider")
        return None
    return provider


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


def listed_pools(provider: CloudProvider) -> list[Any] | None:
    """The pools a provider declares (``pools()``, its catalog and configuration; for a plugin, what its
    table lists), or None when it declares none."""
    pools = getattr(provider, "pools", None) or getattr(getattr(provider, "config", None), "pools", None)
    return list(pools()) if callable(pools) else None


def pool_problems(providers: Mapping[str, CloudProvider]) -> list[str]:
    """Every problem of the providers' pool lists, for orchd's start-up report: a provider that declares
    none (its pools would never be launch targets), a pool of another cloud, a name that is no token /
    dotted key (``wire.names``)."""
    out: list[str] = []
    for name, provider in providers.items():
        pools = listed_pools(provider)
        if pools is None:
            out.append(f"providers.{name}: declares no pools (no pools() and no configured list): none of its "
                       "instance types is ever a launch target; list them in its table")
            continue
        for i, pool in enumerate(pools):
            try:
                check_pool_key(f"providers.{name}.pools[{i}]", pool)
            except BadName as e:
                out.append(str(e))
                continue
            if pool.cloud != provider.cloud:
                out.append(f"providers.{name}.pools[{i}]: cloud {pool.cloud!r} is not the provider's "
                           f"({provider.cloud!r})")
    return out


def known_instance_types(providers: Mapping[str, CloudProvider]) -> tuple[str, ...]:
    """The "cloud/instance_type" entries these providers can launch (``CoreConfig.known_instance_types``):
    exactly the pools each provider declares (``listed_pools``) whose names are valid and of its own cloud.
    A provider that declares none contributes nothing - never a wildcard: a pool nobody listed is never a
    launch target (``pool_problems`` says so at start-up); without providers, nothing is. orchd's core
    always runs with this list: the core's default without one (every quoted pool) is for its own tests."""
    out: set[str] = set()
    for provider in providers.values():
        for pool in listed_pools(provider) or ():
            try:
                check_pool_key("pool", pool)
            except BadName:
                continue
            if pool.cloud == provider.cloud:
                out.add(f"{pool.cloud}/{pool.instance_type}")
    return tuple(sorted(out))
