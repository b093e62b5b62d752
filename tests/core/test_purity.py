"""The decision core stays pure: the import-linter contract holds, and the core imports nothing but
msgspec, immutables, math, typing-level stdlib and wire / orchestrator.core.*."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "orchestrator" / "core"
ALLOWED = {
    "__future__", "msgspec", "immutables", "math", "dataclasses", "enum", "typing", "collections.abc",
    "wire",
}
CONTRACT = "The decision core is pure"


def test_import_linter_contract_kept() -> None:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    if not Path(exe).exists():
        pytest.fail("lint-imports (import-linter) is not installed")
    proc = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    lines = [ln for ln in out.splitlines() if ln.startswith(CONTRACT)]
    assert lines, out  # the contract must exist and have been checked
    assert all(ln.rstrip().endswith("KEPT") for ln in lines), out


def _imports(path: Path) -> set[str]:
    mods: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module)
    return mods


def test_core_imports_only_allowed_modules() -> None:
    files = sorted(CORE.glob("*.py"))
    assert len(files) >= 8
    for f in files:
        for mod in _imports(f):
            ok = mod in ALLOWED or mod == "orchestrator.core" or mod.startswith("orchestrator.core.")
            assert ok, f"{f.name} imports {mod}"
