"""The decision core stays pure: the import-linter contract holds, and every module of the core
imports only what that contract's allowlist (pyproject.toml) names - wire.messages, msgspec,
immutables, pure stdlib - or orchestrator.core itself."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "orchestrator" / "core"
CONTRACT = "The decision core is pure"


def _allowlist() -> list[str]:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["name"].startswith(CONTRACT)]
    assert contract["type"] == "allowlist" and contract["source_modules"] == ["orchestrator.core"]
    return [str(m) for m in contract["allowed_modules"]]


def test_import_linter_contract_kept() -> None:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    if not Path(exe).exists():
        pytest.fail("lint-imports (import-linter) is not installed")
    proc = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    flat = " ".join(out.split())  # lint-imports wraps long contract names over lines
    verdicts = re.findall(re.escape(CONTRACT) + r".*? (KEPT|BROKEN)\b", flat)
    assert verdicts, out  # the contract must exist and have been checked
    assert verdicts == ["KEPT"], out


def _imports(path: Path) -> set[str]:
    mods: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module)
    return mods


def test_core_imports_only_allowed_modules() -> None:
    allowed = [*_allowlist(), "orchestrator.core"]
    assert "wire.messages" in allowed and "wire" not in allowed  # the core sees the messages, not the codec
    files = sorted(CORE.glob("*.py"))
    assert len(files) >= 8
    for f in files:
        for mod in _imports(f):
            ok = any(mod == a or mod.startswith(a + ".") for a in allowed)
            assert ok, f"{f.name} imports {mod}"
