"""Packaging: a wheel built from the tree carries the license, the dependency metadata and the examples.

The wheel is built (``pip wheel --no-deps``, offline with the installed setuptools when it is 77 or newer)
from a copy of the source tree, then inspected and installed into a scratch directory: ``orchctl examples``
must write the example configs, systemd units, alert rules and dashboard out of it. And a base install
without the ``[sim]`` extra's packages gets an error naming the extra from ``python -m simulations``.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXPECTED_EXAMPLES = ("config/orchd.example.toml", "config/clouds/aws.toml", "config/jobs/gpt-small-spot.toml",
                     "config/nats/auth.conf.example", "config/prometheus/alerts.yml",
                     "config/grafana/dashboards/orchd.json", "systemd/orchd.service", "systemd/orch-agent.service")
_SKIP = shutil.ignore_patterns(".git", ".venv*", "tests", "__pycache__", "*.pyc", "build", "dist", "*.egg-info",
                               ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis", "var", "out")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=_SKIP)
    # offline with the installed setuptools when it is new enough (torch requires >=77.0.3), else pip
    # fetches pyproject's build requirement into an isolated environment
    local = int(importlib.metadata.version("setuptools").split(".")[0]) >= 77
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *(["--no-build-isolation"] if local else []),
                        "-q", "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (whl,) = (tmp / "dist").glob("spot_orchestrator-*.whl")
    return whl


def test_wheel_metadata_license_and_dependencies(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = z.read(meta_name).decode()
        license_name = next((n for n in names if n.endswith(".dist-info/licenses/LICENSE")), None)
        assert license_name is not None, [n for n in names if "dist-info" in n]
        assert "Apache License" in z.read(license_name).decode()
    assert "License-Expression: Apache-2.0" in meta
    assert "Requires-Dist: nats-py[nkeys]" in meta
    assert "Requires-Dist: shtab" in meta
    assert "Provides-Extra: sim" in meta
    assert (ROOT / "LICENSE").read_text().startswith("\n                                 Apache License")


def test_wheel_ships_the_examples_and_orchctl_writes_them(wheel: Path, tmp_path: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    for rel in EXPECTED_EXAMPLES:
        assert f"orchestrator/examples/{rel}" in names, rel
    assert not any(n.endswith(".pyc") or "__pycache__" in n for n in names)
    site = tmp_path / "site"
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = tmp_path / "etc"
    p = subprocess.run([sys.executable, "-c", "import orchestrator, sys; print(orchestrator.__file__); "
                        "from orchestrator.cli.main import main; sys.exit(main(['examples', sys.argv[1]]))", str(out)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(str(site)), p.stdout  # the installed wheel, not the checkout
    for rel in EXPECTED_EXAMPLES:
        assert (out / rel).read_bytes() == (ROOT / rel).read_bytes(), rel


def test_simulations_without_the_sim_extra_names_it() -> None:
    block = ("import runpy, sys\n"
             "class Block:\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name.split('.')[0] in ('numpy', 'matplotlib'):\n"
             "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
             "sys.meta_path.insert(0, Block())\n"
             "sys.argv = ['simulations', 'table']\n"
             "runpy.run_module('simulations', run_name='__main__', alter_sys=True)\n")
    p = subprocess.run([sys.executable, "-c", block], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "spot-orchestrator[sim]" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_extras_and_the_documented_boto3_window() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert set(extras["sim"]) >= {"numpy>=1.26", "matplotlib>=3.8"}
    assert "sim" in extras["all"][0]
    (s3_boto,) = [r for r in extras["s3"] if r.startswith("boto3")]
    assert s3_boto == "boto3>=1.36.0,<1.43.118"  # aiobotocore 2.19.0 .. 3.10.0, see docs/dependencies.md
    assert "`boto3>=1.36.0,<1.43.118`" in (ROOT / "docs" / "dependencies.md").read_text()
    assert project["license"] == "Apache-2.0"
