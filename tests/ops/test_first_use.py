"""What a new user meets first, as a user meets it (real subprocesses where it is a command line):
``orch-sweep --version``; an out-of-range ``--notice`` is a usage error; every ``orchctl`` command the
docs name exists; a sweep whose deadline passed is submitted with a warning."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "ORCH_SERVER": "", "PYTHONUNBUFFERED": "1"}


def _py(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=60, env=ENV)


def test_orch_sweep_answers_version() -> None:
    p = _py("-c", "import sys; from orchestrator.cli.main import sweep_service_main as m; sys.exit(m())",
            "--version")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"orch-sweep {importlib.metadata.version('spot-orchestrator')}"


@pytest.mark.parametrize("notice", ["99999", "-1", "nan", "soon"])
def test_an_out_of_range_notice_is_a_usage_error(notice: str) -> None:
    p = _py("-m", "orchestrator.cli", "nodes", "preempt", "demo-n1", "--notice", notice)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "--notice" in p.stderr and ("0 .. 3600 seconds" in p.stderr or "not a number" in p.stderr), p.stderr


def _commands(parser) -> dict[str, object]:
    import argparse

    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(subs[0].choices) if subs else {}


def test_every_orchctl_command_the_docs_name_exists() -> None:
    from orchestrator.cli.main import build_parser

    root = build_parser()
    wrong = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for span in re.findall(r"`(orchctl [^`]+)`", doc.read_text()):
            words = span.split()[1:]
            parser, path = root, ["orchctl"]
            while words and not words[0].startswith("-") and _commands(parser):
                word = words.pop(0)
                if re.fullmatch(r"[a-z][a-z-]*", word) is None:  # a placeholder, a pipe: not a command word
                    break
                choices = _commands(parser)
                if word not in choices:
                    wrong.append(f"{doc.name}: `{span}`: {' '.join(path)} has no command {word!r}")
                    break
                parser, path = choices[word], [*path, word]
    assert wrong == [], "\n".join(wrong)


def test_a_sweep_whose_deadline_passed_is_submitted_with_a_warning(tmp_path: Path) -> None:
    pytest.importorskip("optuna")
    from simulations.sweeps import sweep_file

    past = time.time() - 3600
    f = tmp_path / "late.toml"
    f.write_text(sweep_file(trials=1, parallelism=1, nodes=1, total_steps=10, pruner="none", seed=1,
                            checkpoint_root=f"file://{tmp_path / 'ckpt'}", every=5).replace(
        "parallelism = 1\n", f"parallelism = 1\ndeadline_ts = {past:.0f}\n", 1))
    storage = f"sqlite:///{tmp_path / 'sweeps.db'}"
    p = _py("-m", "orchestrator.cli", "sweep", "submit", str(f), "--storage", storage, "--id", "late")
    assert p.returncode == 0, p.stderr
    assert "warning: the sweep's deadline" in p.stderr and "has passed: no trial will start" in p.stderr, p.stderr
    again = _py("-m", "orchestrator.cli", "sweep", "submit", str(f), "--storage", storage, "--id", "late")
    assert again.returncode == 0 and "warning" not in again.stderr  # the idempotent resubmit changes nothing
