"""The command blocks of docs/operations.md work as written.

Every fenced block carries a tag after its language (the doc's "Command blocks" paragraph): ``fresh``
blocks run here, from the repository root, ``bash`` ones with ``bash -e`` and ``toml`` ones loaded as
orchd settings; ``needs-host`` (root with systemd as PID 1, a cluster, a cloud) and ``illustration``
blocks are only counted. A block without a known tag fails the first test. The environment is a scratch
one: a state directory under the test's directory, a free metrics port, and - as systemd would give
orchd - a credentials directory holding the secrets the documented settings leave out.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "operations.md"
TAGS = ("fresh", "needs-host", "illustration")
FENCE = re.compile(r"^```(\S*)[ \t]*(.*?)\n(.*?)^```[ \t]*$", re.M | re.S)


def _blocks() -> list[tuple[str, str, str, int]]:
    """(language, tag, body, line) of every fenced block."""
    text = DOC.read_text()
    return [(m.group(1), m.group(2).strip(), m.group(3), text[:m.start()].count("\n") + 1)
            for m in FENCE.finditer(text)]


def test_every_block_is_tagged() -> None:
    blocks = _blocks()
    assert blocks
    untagged = [(lang, tag, line) for lang, tag, _, line in blocks if tag not in TAGS]
    assert untagged == [], f"docs/operations.md blocks without a tag of {TAGS}: {untagged}"
    assert any(tag == "fresh" and lang == "bash" for lang, tag, _, _ in blocks)


def _env(tmp: Path, *, credentials: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_") and k != "CREDENTIALS_DIRECTORY"}
    bin_dir = str(Path(sys.executable).parent)  # orchd, orchctl and python of this installation
    env.update(PATH=f"{bin_dir}:{env.get('PATH', '')}", ORCH_DAEMON__STATE_DIR=str(tmp / "state"),
               ORCH_METRICS__PORT="0")
    if credentials:  # what systemd gives orchd.service on a host with these credentials
        creds = tmp / "credentials"
        creds.mkdir(exist_ok=True)
        for name, text in (("nats.password", "pw"), ("callout-issuer.seed", "SA..."), ("callout-auth.password", "pw")):
            (creds / name).write_text(text + "\n")
        env["CREDENTIALS_DIRECTORY"] = str(creds)
    return env


@pytest.mark.parametrize("line", [line for lang, tag, _, line in _blocks() if tag == "fresh" and lang == "bash"])
def test_fresh_bash_block_runs(line: int, tmp_path: Path) -> None:
    (body,) = [b for _, _, b, ln in _blocks() if ln == line]
    res = subprocess.run(["bash", "-e", "-c", body], cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, f"docs/operations.md:{line}\n{body}\n{res.stdout}\n{res.stderr}"


@pytest.mark.parametrize("line", [line for lang, tag, _, line in _blocks() if tag == "fresh" and lang == "toml"])
def test_fresh_toml_block_loads_as_settings(line: int, tmp_path: Path) -> None:
    (body,) = [b for _, _, b, ln in _blocks() if ln == line]
    path = tmp_path / "orchd.toml"
    path.write_text(body)
    settings = load_settings(path, env=_env(tmp_path, credentials=True))  # SettingsError lists every problem
    assert settings.nats.user and settings.nats.password == "pw"  # the password came from the directory


def test_a_failing_block_fails(tmp_path: Path) -> None:
    """The runner can fail: a documented command with a broken config exits 2 under bash -e."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[daemon]\ntick_s = -1\n")
    res = subprocess.run(["bash", "-e", "-c", f"orchd --config {bad} --check"], cwd=ROOT, env=_env(tmp_path),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "daemon.tick_s" in res.stderr
