"""orchctl names the extra to install when a command needs what this host lacks: ``orchctl demo`` without
torch ([trainer]), ``orchctl demo --model llama-tiny`` and ``orchctl checkpoint export`` without transformers
([hf]). The module is made unimportable in a real subprocess (a ``sitecustomize`` that blocks it, as if it
were not installed); orchctl itself imports neither torch nor transformers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN = ("import sys; from orchestrator.cli.main import main; code = main(sys.argv[1:]); "
       "assert not {'torch', 'transformers'} & set(m for m in sys.modules if sys.modules[m] is not None), "
       "'orchctl imported torch or transformers'; sys.exit(code)")


def _orchctl(tmp: Path, blocked: list[str], *argv: str) -> subprocess.CompletedProcess[str]:
    site = tmp / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text("import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in blocked))
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}"}
    return subprocess.run([sys.executable, "-c", RUN, *argv], env=env, cwd=tmp, text=True, capture_output=True,
                          timeout=60)


@pytest.mark.parametrize(("blocked", "argv", "extra", "names"), [
    (["transformers"], ["demo", "--model", "llama-tiny"], "[hf]", "transformers"),
    (["transformers"], ["checkpoint", "export", "file:///nowhere/ckpt", "out"], "[hf]", "transformers"),
    (["torch"], ["demo"], "[trainer]", "torch"),
])
def test_orchctl_names_the_missing_extra(tmp_path: Path, blocked: list[str], argv: list[str], extra: str,
                                         names: str) -> None:
    r = _orchctl(tmp_path, blocked, *argv)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert f"install the {extra} extra" in r.stderr and f"missing here: {names}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
