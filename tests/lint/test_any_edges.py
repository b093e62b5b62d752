"""``Any`` in orchd's shell's signatures stays at the edges it cannot be typed past: the JSON summaries the
admin API answers with, WSGI, nats.micro handlers, Prometheus, the provider tables and the MLflow client.
A new ``Any`` elsewhere in a signature fails here (raise the count only with a reason in this file)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {  # module -> annotations naming Any in its function signatures
    "admin.py": 4,  # nats.micro handler dispatch, the local provider's fault-injection hooks
    "feeds.py": 2,  # a provider's raw quote rows
    "metrics.py": 2,  # prometheus_client collectors
    "metrics_http.py": 6,  # WSGI environ and start_response
    "registry.py": 2,  # provider tables from TOML
    "run.py": 2,  # the embedding caller's keyword options
    "startup.py": 1,  # the auth callout's credential store
    "summaries.py": 8,  # JSON shapes of the admin replies
    "tracking.py": 2,  # the MLflow client
}


def any_in_signatures(path: Path) -> int:
    n = 0
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            anns = [x.annotation for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg)
                    if x is not None and x.annotation is not None]
            anns += [node.returns] if node.returns is not None else []
            n += sum(isinstance(x, ast.Name) and x.id == "Any" for ann in anns for x in ast.walk(ann))
    return n


def test_any_in_the_daemons_signatures_only_at_its_edges() -> None:
    found = {p.name: n for p in sorted((ROOT / "orchestrator" / "daemon").glob("*.py"))
             if (n := any_in_signatures(p))}
    over = {m: (n, ALLOWED.get(m, 0)) for m, n in found.items() if n > ALLOWED.get(m, 0)}
    assert not over, f"Any in signatures beyond the edges (module: found, allowed): {over}"


def test_the_count_sees_every_place_of_a_signature(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("from typing import Any\ndef f(a: Any, *b: Any, c: list[Any], **d: Any) -> Any: ...\n"
                 "async def g(x: int) -> dict[str, Any]: ...\n")
    assert any_in_signatures(f) == 6
