"""The import graph of our own packages, read from the source: every import statement, at module level,
inside functions and under ``TYPE_CHECKING`` alike (``lint-imports`` sees only what Python runs at import
time with its defaults; a function-level or type-only import can close a circle all the same).

``graph()`` maps each module to the modules of ours it imports; ``cycles(graph)`` lists the strongly
connected components with more than one module (each one a circle).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("wire", "orchestrator", "providers", "agent", "trainer", "simulations")


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of our packages: dotted name -> file (a package is its ``__init__``)."""
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: Mapping[str, Path]) -> Iterator[str]:
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_pkg else name.split(".")[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join([*here, base] if base else here)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield sub if sub in known else base


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of ours it imports (the nearest enclosing known module of each import)."""
    known = modules(root)
    out: dict[str, set[str]] = {}
    for name, path in known.items():
        deps: set[str] = set()
        for target in _imports(name, path, known):
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                deps.add(target)
        out[name] = deps
    return out


def cycles(g: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``g`` with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(g):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(g[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp: list[str] = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found
