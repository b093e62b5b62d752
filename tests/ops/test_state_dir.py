"""A throwaway command's state directory belongs to one run: ``orchctl demo --state-dir`` (a real
subprocess) refuses a directory that is not empty unless ``--resume`` or ``--fresh``, and the rule
itself (``orchestrator.cli.statedir``) on real directories."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.cli import statedir

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "ORCH_SERVER": "", "PYTHONUNBUFFERED": "1"}
OPTS = {"steps": 200, "notice_s": 20.0, "spike": True, "prices": "fixed"}


def _demo(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "demo", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=ENV)


def _earlier_run(d: Path, *, ended: str | None = None, options: dict | None = None) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "orchd").mkdir()
    (d / "orchd" / "state.bin").write_bytes(b"x")
    marker = {"command": "orchctl demo", "options": options or OPTS, "started": 1.0e9, "ended": ended}
    (d / statedir.MARKER).write_text(json.dumps(marker))


def test_demo_refuses_a_state_dir_that_holds_an_earlier_run(tmp_path: Path) -> None:
    d = tmp_path / "demo"
    _earlier_run(d)
    p = _demo("--state-dir", str(d))
    assert p.returncode == 2, p.stderr
    assert f"{d} holds an earlier run: orchctl demo (" in p.stderr and "--resume" in p.stderr and "--fresh" in p.stderr
    assert (d / "orchd" / "state.bin").exists()
    # --resume with other options: refused, naming them (a 90-step run must not continue a 200-step job)
    p = _demo("--state-dir", str(d), "--resume", "--fast")
    assert p.returncode == 2 and "'steps': 200" in p.stderr and "'steps': 90" in p.stderr, p.stderr
    assert _demo("--state-dir", str(d), "--resume", "--fresh").returncode == 2  # they exclude each other


def test_demo_does_not_resume_an_ended_run_nor_clear_foreign_files(tmp_path: Path) -> None:
    d = tmp_path / "ended"
    _earlier_run(d, ended="job succeeded")
    p = _demo("--state-dir", str(d), "--resume")
    assert p.returncode == 2 and "has ended (job succeeded), nothing to resume" in p.stderr, p.stderr
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    for flag in ("--fresh", "--resume"):
        p = _demo("--state-dir", str(home), flag)
        assert p.returncode == 2 and "neither uses nor clears it" in p.stderr and "notes.txt" in p.stderr, p.stderr
    assert (home / "notes.txt").read_text() == "mine"
    f = tmp_path / "a-file"
    f.write_text("")
    p = _demo("--state-dir", str(f))
    assert p.returncode == 2 and "is not a directory" in p.stderr


def test_claim_new_resume_fresh(tmp_path: Path) -> None:
    d = tmp_path / "run"
    c = statedir.claim(d, command="orchctl demo", options=OPTS)
    assert c.resumed is None and statedir.read_marker(d)["ended"] is None  # type: ignore[index]
    (d / "nodes").mkdir()
    c = statedir.claim(d, command="orchctl demo", options=OPTS, resume=True)
    assert c.resumed is not None and "resuming the run in" in c.message and "steps 200" in c.message
    with pytest.raises(statedir.StateDirError, match="holds a run of orchctl demo"):
        statedir.claim(d, command="python -m simulations.chaos", options={}, fresh=True)
    statedir.finish(d, "job succeeded")
    c = statedir.claim(d, command="orchctl demo", options=OPTS, fresh=True)
    assert "cleared" in c.message and "ended: job succeeded" in c.message
    assert sorted(p.name for p in d.iterdir()) == [statedir.MARKER]
    with pytest.raises(statedir.StateDirError, match="holds no earlier run"):
        statedir.claim(tmp_path / "empty", command="orchctl demo", options=OPTS, resume=True)


def test_chaos_workdir_follows_the_same_rule(tmp_path: Path) -> None:
    d = tmp_path / "chaos"
    statedir.claim(d, command="python -m simulations.chaos", options={"seed": 1})
    (d / "nats").mkdir()
    p = subprocess.run([sys.executable, "-m", "simulations.chaos", "--workdir", str(d), "--adversarial", "5"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, env=ENV)
    assert p.returncode == 2 and "holds an earlier run" in p.stderr and "--fresh" in p.stderr, p.stderr
    assert "--resume" not in p.stderr and (d / "nats").is_dir()
