"""Formatting helpers and the run loop behind ``python -m simulations`` (thin: parse, call, format)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from simulations.replay import Summary


def format_table(results: dict[str, Summary]) -> str:
    cols = ("cost_ratio", "deadline_met", "preemptions", "lost_hours", "goodput")
    rows: list[tuple[str, ...]] = [("policy", *cols)]
    for name, s in results.items():
        d = s.as_dict()
        rows.append((name,) + tuple("-" if d[c] is None else f"{d[c]:.3f}" for c in cols))
    w = [max(len(r[i]) for r in rows) for i in range(len(cols) + 1)]
    return "\n".join("  ".join(c.rjust(w[i]) if i else c.ljust(w[i]) for i, c in enumerate(r)) for r in rows)


def to_json(results: dict[str, Summary], **meta) -> str:
    return json.dumps({**meta, "policies": {k: v.as_dict() for k, v in results.items()}}, indent=2, allow_nan=False,
                      default=str)


@contextmanager
def progress_bar(total: int, label: str, enabled: bool | None = None) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr (only on a TTY unless forced); yields advance(n)."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    with Progress(
        "[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        console=Console(stderr=True), transient=True,
    ) as p:
        task = p.add_task(label, total=total)
        yield lambda n: p.advance(task, n)
