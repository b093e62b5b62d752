"""Build hook (all metadata is in pyproject.toml): the wheel carries the example configs.

``config/`` (orchd, clouds, jobs, NATS, Prometheus rules, Grafana dashboard and provisioning) and
``systemd/`` (units, environment file) of the source tree are copied into the built package as
``orchestrator/examples/config/...`` and ``orchestrator/examples/systemd/...``; ``orchctl examples DIR``
writes them out of an installed wheel. ``config/`` stays where it is in the repository (the tests read
it); an editable install reads it there. The sdist carries both directories (MANIFEST.in).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
EXAMPLE_DIRS = ("config", "systemd")
SKIP_PARTS = {"__pycache__"}
SKIP_NAMES = {"build.py"}  # config/grafana/build.py generates the dashboard: a dev tool, not an example


def example_files(root: Path = HERE) -> list[Path]:
    """The files shipped as examples, relative to ``root``."""
    out = []
    for top in EXAMPLE_DIRS:
        for src in sorted((root / top).rglob("*")):
            rel = src.relative_to(root)
            if src.is_file() and not SKIP_PARTS & set(rel.parts) and src.name not in SKIP_NAMES \
                    and src.suffix != ".pyc":
                out.append(rel)
    return out


class BuildPyWithExamples(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # editable: orchctl examples reads the checkout's config/ and systemd/
        target = Path(self.build_lib) / "orchestrator" / "examples"
        for rel in example_files():
            dst = target / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(HERE / rel, dst)


setup(cmdclass={"build_py": BuildPyWithExamples})
