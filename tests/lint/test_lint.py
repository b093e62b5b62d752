"""The tree's static checks, as tests: import contracts, ruff, mypy, and size limits.

Each tool runs as a subprocess from the repo root with its configuration in pyproject.toml; a failure shows
the tool's own output. The tools are the ones installed beside this interpreter (the project's venv), else on
PATH; a missing one skips locally and fails in CI (``require_tool``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import require_tool

ROOT = Path(__file__).resolve().parents[2]
SOURCE_PACKAGES = ("wire", "orchestrator", "providers", "agent", "trainer", "simulations", "benchmarks")
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80

# Source files allowed over MAX_FILE_LINES, and functions ("path:qualified.name") allowed over
# MAX_FUNCTION_LINES, each with the reason it is allowed. Keep these empty: split the code instead.
FILE_EXCEPTIONS: dict[str, str] = {}
FUNCTION_EXCEPTIONS: dict[str, str] = {}


def _tool(name: str) -> str:
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else require_tool(name)


def _run(argv: list[str], timeout: float) -> None:
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        command = " ".join([Path(argv[0]).name, *argv[1:]])
        pytest.fail(f"`{command}` (from the repo root) exited {out.returncode}:\n{out.stdout}{out.stderr}",
                    pytrace=False)


def test_import_contracts() -> None:
    """The import-linter contracts of pyproject.toml (layers, the core's allowlist, the pure wire layer)."""
    _run([_tool("lint-imports")], timeout=120)


def test_ruff() -> None:
    _run([_tool("ruff"), "check", ".", "--output-format", "concise"], timeout=120)


@pytest.mark.timeout(900)
def test_mypy() -> None:
    """mypy over pyproject's ``files`` (about 1-2 min cold on 2 cores; incremental in .mypy_cache after)."""
    _run([_tool("mypy")], timeout=840)


def _source_files() -> list[Path]:
    return sorted(p for pkg in SOURCE_PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _long_functions(tree: ast.Module, limit: int) -> list[tuple[str, int]]:
    """(qualified name, lines from ``def`` to the last line of the body) of each function over ``limit``."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    length = (child.end_lineno or child.lineno) - child.lineno + 1
                    if length > limit:
                        found.append((name, length))
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def _lines(counts: dict[str, int]) -> str:
    return "\n".join(f"  {name}: {n} lines" for name, n in sorted(counts.items()))


def test_no_source_file_over_the_line_limit() -> None:
    too_long = {}
    for path in _source_files():
        rel = path.relative_to(ROOT).as_posix()
        n = len(path.read_text().splitlines())
        if n > MAX_FILE_LINES and rel not in FILE_EXCEPTIONS:
            too_long[rel] = n
    assert not too_long, f"source files over {MAX_FILE_LINES} lines (split them):\n{_lines(too_long)}"
    stale = [rel for rel in FILE_EXCEPTIONS
             if not (ROOT / rel).exists() or len((ROOT / rel).read_text().splitlines()) <= MAX_FILE_LINES]
    assert not stale, f"FILE_EXCEPTIONS no longer needed (remove them): {stale}"


def test_no_function_over_the_line_limit() -> None:
    too_long: dict[str, int] = {}
    seen = set()
    for path in _source_files():
        rel = path.relative_to(ROOT).as_posix()
        for name, n in _long_functions(ast.parse(path.read_text(), filename=rel), MAX_FUNCTION_LINES):
            key = f"{rel}:{name}"
            seen.add(key)
            if key not in FUNCTION_EXCEPTIONS:
                too_long[key] = n
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n{_lines(too_long)}"
    stale = sorted(set(FUNCTION_EXCEPTIONS) - seen)
    assert not stale, f"FUNCTION_EXCEPTIONS no longer needed (remove them): {stale}"


def test_the_function_measure() -> None:
    """A function's lines run from ``def`` to its last line; methods and nested functions are measured on
    their own (a nested one also counts in its parent) and named by their qualified names."""
    tree = ast.parse(textwrap.dedent("""\
        class C:
            def m(self):
                x = 1
                y = 2

                def inner():
                    pass
                return x + y


        async def f():
            return 1
        """))
    assert _long_functions(tree, 2) == [("C.m", 7)]
    assert _long_functions(tree, 1) == [("C.m", 7), ("C.m.inner", 2), ("f", 2)]
