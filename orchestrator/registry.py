"""Provider registry of the ``orchd`` command: which CloudProvider serves which ``pool.cloud``.

Role: build ``dict[str, CloudProvider]`` from ``settings.providers``. Embedders (tests, the demo) skip
this and pass their own registry to ``run_daemon``.

    fake   ``providers.fake.FakeCloud``; with ``[providers.fake] state_file = "..."`` a FakeCloud whose
           instances and idempotency tokens are kept in that JSON file, so they survive a restart of
           orchd (used by the kill -9 tests: duplicates are counted on the cloud side, from the file).
           Optional ``prices = [{pool..., price_usd_h, on_demand_usd_h}]``.
    others ``providers.registry.build_providers`` (aws, gcp, azure, local; SDKs imported lazily), every
           problem reported at start in one error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from orchestrator.events import InstanceId, PoolKey
from orchestrator.settings import Settings, SettingsError
from providers.base import CloudProvider, Instance, LaunchRequest, LaunchResult
from providers.fake import FakeCloud


class ProviderConfigError(ValueError):
    pass


class FileFakeCloud(FakeCloud):
    """FakeCloud persisted to a JSON file after every change (and loaded at construction)."""

    def __init__(self, state_file: str | os.PathLike[str], cloud: str = "fake", **kw: Any) -> None:
        super().__init__(cloud, **kw)
        self.state_file = Path(state_file)
        self._file_lock = threading.Lock()
        if self.state_file.exists():
            data = json.loads(self.state_file.read_text())
            for raw in data.get("instances", []):
                inst = msgspec.convert(raw, Instance)
                self._instances[inst.instance_id] = inst
            self._by_token = {k: tuple(v) for k, v in data.get("tokens", {}).items()}
            self.launch_calls = data.get("launch_calls", 0)
            n = len(self._instances)
            import itertools

            self._ids = itertools.count(n + 1)

    def _save(self) -> None:
        with self._file_lock:  # one writer at a time; the snapshot is taken under the cloud's lock
            with self._lock:
                data = {
                    "instances": list(self._instances.values()),
                    "tokens": {k: list(v) for k, v in self._by_token.items()},
                    "launch_calls": self.launch_calls,
                }
            tmp = self.state_file.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(msgspec.json.encode(data))
            tmp.replace(self.state_file)

    def launch(self, request: LaunchRequest) -> LaunchResult:
        try:
            return super().launch(request)
        finally:
            self._save()

    def terminate(self, instance_ids: Sequence[InstanceId]) -> None:
        super().terminate(instance_ids)
        self._save()

    def preempt(self, instance_id: InstanceId) -> Instance:
        out = super().preempt(instance_id)
        self._save()
        return out


def read_fake_file(path: str | os.PathLike[str]) -> list[Instance]:
    """The instances a FileFakeCloud recorded (for tests counting launches on the cloud side)."""
    p = Path(path)
    if not p.exists():
        return []
    return [msgspec.convert(raw, Instance) for raw in json.loads(p.read_text()).get("instances", [])]


def _fake_from_table(table: Mapping[str, Any]) -> FakeCloud:
    known = {"state_file", "prices", "gpu_type", "gpus_per_node", "capacity"}
    bad = sorted(set(table) - known)
    if bad:
        raise ProviderConfigError(f"providers.fake: unknown keys {bad} (known: {sorted(known)})")
    kw = {k: table[k] for k in ("gpu_type", "gpus_per_node") if k in table}
    cloud: FakeCloud = FileFakeCloud(table["state_file"], **kw) if table.get("state_file") else FakeCloud(**kw)
    for i, row in enumerate(table.get("prices", [])):
        try:
            pool = msgspec.convert(row["pool"], PoolKey)
            cloud.set_price(pool, float(row["price_usd_h"]), row.get("on_demand_usd_h"))
        except (KeyError, TypeError, ValueError, msgspec.ValidationError) as e:
            raise ProviderConfigError(f"providers.fake.prices[{i}]: {e}") from None
    return cloud


def build_providers(settings: Settings) -> dict[str, CloudProvider]:
    """``providers.registry.build_providers`` (the cloud modules, one SettingsError listing every problem),
    except that ``fake`` with a ``state_file`` or ``prices`` table is built here (FileFakeCloud)."""
    from providers import registry

    fake_table = dict(settings.providers.fake or {})
    own_fake = "fake" in settings.providers.enabled and bool({"state_file", "prices", "capacity"} & set(fake_table))
    problems: list[str] = []
    out: dict[str, CloudProvider] = {}
    rest = settings
    if own_fake:
        try:
            out["fake"] = _fake_from_table(fake_table)
        except ProviderConfigError as e:
            problems.append(str(e))
        rest = dataclasses.replace(settings, providers=dataclasses.replace(
            settings.providers, enabled=tuple(n for n in settings.providers.enabled if n != "fake")))
    try:
        out.update(registry.build_providers(rest))
    except SettingsError as e:
        problems += e.problems
    if problems:
        raise ProviderConfigError("invalid provider configuration:\n" + "\n".join(f"  - {p}" for p in problems))
    return out
