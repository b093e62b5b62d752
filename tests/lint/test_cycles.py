"""No circle among our own modules, counting every import: module level, inside functions and under
``TYPE_CHECKING`` (``tests/lint/imports.py`` reads them from the source). Lazy imports of optional
third-party packages are not ours and do not count."""

from __future__ import annotations

from pathlib import Path

from tests.lint.imports import cycles, graph, modules


def test_no_import_cycle_among_our_modules() -> None:
    found = cycles(graph())
    assert not found, "import circles (function-level and TYPE_CHECKING imports included):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_the_reader_sees_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    """The check cannot pass by not looking: a circle closed only by a function-level import, one closed
    only under TYPE_CHECKING, and one through a relative import are each found."""
    pkg = tmp_path / "agent"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from agent import b\n")
    (pkg / "b.py").write_text("def f():\n    from agent.a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from agent.d import D\n")
    (pkg / "d.py").write_text("import agent.c\n")
    (pkg / "e.py").write_text("from . import f\n")
    (pkg / "f.py").write_text("from .e import g\nimport numpy\n")
    assert set(modules(tmp_path)) == {"agent", "agent.a", "agent.b", "agent.c", "agent.d", "agent.e", "agent.f"}
    assert sorted(cycles(graph(tmp_path))) == [["agent.a", "agent.b"], ["agent.c", "agent.d"], ["agent.e", "agent.f"]]
