"""A state directory belongs to one run of a throwaway command unless the user asks otherwise.

Role: the rule that ``orchctl demo --state-dir`` and ``python -m simulations.chaos --workdir`` follow.
A command writes a marker (``.orch-run.json``: the command, the options that shape the run, when it
started, how it ended) into the directory it uses. Given a directory that is not empty, it refuses to
start unless told ``--resume`` (continue that run: the marker must be the same command with the same
options, and the run must not have ended) or ``--fresh`` (clear it first: only a directory that holds
such a marker is cleared, never one the command did not make). orchd and orch-agent do not use this:
they resume their state on every start (a systemd restart). Plain files, no concurrency.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKER = ".orch-run.json"


class StateDirError(Exception):
    """The directory cannot be used as asked; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class Claim:
    """A directory this run may use; ``resumed`` is the previous run's marker when it continues one."""

    path: Path
    resumed: dict[str, Any] | None
    message: str


def describe(marker: dict[str, Any]) -> str:
    """One line about a previous run: its options, when it started, how it ended."""
    opts = ", ".join(f"{k} {v}" for k, v in sorted(marker.get("options", {}).items()))
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(marker.get("started", 0))))
    ended = marker.get("ended")
    return f"{marker.get('command', '?')} ({opts}), started {started}, " + (
        f"ended: {ended}" if ended else "not ended (interrupted or still running)")


def read_marker(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads((path / MARKER).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise StateDirError(f"{path / MARKER} cannot be read ({e}): remove the directory or pick another") from None
    return doc if isinstance(doc, dict) else None


def _write(path: Path, marker: dict[str, Any]) -> None:
    tmp = path / (MARKER + ".tmp")
    tmp.write_text(json.dumps(marker, sort_keys=True) + "\n")
    tmp.replace(path / MARKER)


def claim(path: Path, *, command: str, options: dict[str, Any], resume: bool = False,
          fresh: bool = False, resumable: bool = True) -> Claim:
    """Make ``path`` this run's directory, or raise StateDirError naming the problem and the way out."""
    path = Path(path).expanduser().resolve()
    if resume and fresh:
        raise StateDirError("--resume and --fresh exclude each other")
    if path.exists() and not path.is_dir():
        raise StateDirError(f"{path} is not a directory")
    entries = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    new = {"command": command, "options": options, "started": time.time(), "ended": None}
    if not entries:
        if resume:
            raise StateDirError(f"--resume: {path} holds no earlier run of {command} to resume")
        path.mkdir(parents=True, exist_ok=True)
        _write(path, new)
        return Claim(path, None, f"{command}: state in {path}")
    marker = read_marker(path)
    if marker is None or marker.get("command") != command:
        what = f"a run of {marker.get('command')}" if marker else f"files not written by {command} ({entries[0]}, ...)"
        raise StateDirError(f"{path} is not empty: it holds {what}, so {command} neither uses nor clears it; "
                            "pass an empty or new directory")
    if fresh:
        for p in path.iterdir():
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        _write(path, new)
        return Claim(path, None, f"{command}: cleared {path} (it held {describe(marker)})")
    if not resume:
        again = "--resume to continue it, " if resumable else ""
        raise StateDirError(f"{path} holds an earlier run: {describe(marker)}. Pass {again}--fresh to clear it "
                            "and start again, or another directory")
    if marker.get("ended"):
        raise StateDirError(f"--resume: the run in {path} has ended ({marker['ended']}), nothing to resume; "
                            "--fresh starts again")
    if marker.get("options") != options:
        raise StateDirError(f"--resume: the run in {path} was started with {marker.get('options')}, not {options}: "
                            "resume it with the same options, or --fresh to start again")
    return Claim(path, marker, f"{command}: resuming the run in {path}: {describe(marker)}")


def finish(path: Path, ended: str) -> None:
    """Record how the run ended (a run that never gets here stays resumable)."""
    marker = read_marker(path)
    if marker is not None:
        marker["ended"] = ended
        _write(path, marker)
