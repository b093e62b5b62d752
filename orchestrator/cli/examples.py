"""``orchctl examples DIR [--force] | --list``: write the shipped example files into DIR.

Role: the wheel carries the repository's ``config/`` and ``systemd/`` as package data under
``orchestrator/examples/`` (copied at build by setup.py): the orchd config, cloud and job examples,
the NATS server/users configs, the Prometheus alert rules and their tests, the Grafana dashboard and
provisioning, and the systemd units. This command copies them out, keeping their relative paths
(``config/orchd.example.toml``, ``systemd/orchd.service``, ...). In a checkout (editable install) it
reads ``config/`` and ``systemd/`` of the checkout itself.

Existing files are not overwritten without ``--force`` (exit 2, naming them).
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import yaml

from orchestrator.cli.common import EXIT_OK, EXIT_USAGE

EXAMPLE_DIRS = ("config", "systemd")


def examples_root() -> Traversable | Path:
    """Where the examples are: the installed package data, else the checkout this module runs from."""
    packaged = files("orchestrator").joinpath("examples")
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2]


def example_files(root: Traversable | Path | None = None) -> dict[str, Traversable | Path]:
    """Relative path -> file, for every shipped example."""
    root = root if root is not None else examples_root()
    out: dict[str, Traversable | Path] = {}

    def walk(node: Traversable | Path, rel: str) -> None:
        for child in sorted(node.iterdir(), key=lambda c: c.name):
            path = f"{rel}/{child.name}"
            if child.name == "__pycache__" or child.name.endswith(".pyc") or child.name == "build.py":
                continue
            if child.is_dir():
                walk(child, path)
            else:
                out[path] = child

    for top in EXAMPLE_DIRS:
        node = root.joinpath(top)
        if node.is_dir():
            walk(node, top)
    return out


def write_examples(target: Path, *, force: bool = False) -> list[str]:
    """Copy every example under ``target``; FileExistsError (naming them) for existing files unless ``force``."""
    found = example_files()
    if not found:
        raise FileNotFoundError("no example files in this installation (orchestrator/examples is missing)")
    clash = sorted(rel for rel in found if (target / rel).exists())
    if clash and not force:
        raise FileExistsError(", ".join(clash[:5]) + (f" and {len(clash) - 5} more" if len(clash) > 5 else ""))
    for rel, src in found.items():
        dst = target / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(src.read_bytes())
    return sorted(found)


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("examples", parents=[common],
                       help="write the example configs, systemd units, alert rules and dashboard")
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("dir", nargs="?", help="where to write them (created if missing)")
    g.add_argument("--list", action="store_true", help="only list them")
    s.add_argument("--force", action="store_true", help="overwrite existing files")
    s.set_defaults(run=run)


def _emit(fmt: str, data: dict[str, Any], table: str) -> None:
    if fmt == "json":
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    elif fmt == "yaml":
        sys.stdout.write(yaml.safe_dump(data, sort_keys=False))
    else:
        sys.stdout.write(table)


def run(args: argparse.Namespace) -> int:
    fmt = getattr(args, "output", "table")
    if args.list:
        files_ = sorted(example_files())
        _emit(fmt, {"files": files_}, "".join(f"{rel}\n" for rel in files_))
        return EXIT_OK
    try:
        written = write_examples(Path(args.dir), force=args.force)
    except FileExistsError as e:
        sys.stderr.write(f"orchctl: would overwrite {e} (give --force)\n")
        return EXIT_USAGE
    except FileNotFoundError as e:
        sys.stderr.write(f"orchctl: {e}\n")
        return EXIT_USAGE
    _emit(fmt, {"dir": str(args.dir), "files": written}, f"wrote {len(written)} files under {args.dir}\n")
    return EXIT_OK
