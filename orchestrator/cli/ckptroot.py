"""``orchctl checkpoint owner URL`` and ``orchctl checkpoint take-over URL --job J --cluster C --reason R``:
who owns a checkpoint root, and giving it to another job (``trainer/rootowner.py``, docs/trainer.md).
``orchctl checkpoint export URL OUT``: a Hugging Face job's checkpoint as a ``save_pretrained`` directory
(``python -m trainer.export``; needs the [hf] extra on this host, and says so when it is missing).

A root is claimed at the storage by its job's first write (``OWNER.json``: job, cluster, when); no other job
or cluster may write there. After a lost state (a wiped orchd, a new cluster), the root's job carries on
under a new cluster identity only when an operator says so: ``take-over`` rewrites the marker with the new
owner and keeps the previous one, the operator, when and why in its history (the audit lives with the data).
Runs on the operator's host with its own storage credentials; orchd is not involved.
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
from typing import Any

from orchestrator.cli.common import EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("checkpoint", help="who owns a checkpoint root; an operator's take-over")
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    o = verbs.add_parser("owner", parents=[common], help="the owner marker of a checkpoint root")
    o.add_argument("url")
    t = verbs.add_parser("take-over", parents=[common], help="give a checkpoint root to another job or cluster")
    t.add_argument("url")
    t.add_argument("--job", required=True, help="the job that takes the root over")
    t.add_argument("--cluster", required=True, help="its cluster's identity (orchctl status: cluster_id)")
    t.add_argument("--reason", required=True, help="why (kept in the marker's history)")
    t.add_argument("--operator", default=None, help="who (default: this user)")
    e = verbs.add_parser("export", parents=[common],
                         help="a Hugging Face job's checkpoint (or root: its newest) as a save_pretrained directory")
    e.add_argument("url", help="a committed checkpoint directory or a job's checkpoint root")
    e.add_argument("out", help="the directory to write")
    e.add_argument("--tokenizer", default=None, help="tokenizer to save beside it (default: the job's)")
    for parser in (o, t, e):
        parser.add_argument("--storage-options", default=None, help="JSON fsspec options (endpoints)")
        parser.set_defaults(run=run)


def export(args: argparse.Namespace) -> int:
    """``python -m trainer.export`` in a child process (orchctl itself never imports torch)."""
    import subprocess

    from orchestrator.cli.extras import missing

    need = missing("orchctl checkpoint export", hf=True)
    if need is not None:
        sys.stderr.write(f"orchctl: {need}")
        return EXIT_USAGE
    argv = [sys.executable, "-m", "trainer.export", args.url, args.out]
    argv += ["--storage-options", args.storage_options] if args.storage_options else []
    argv += ["--tokenizer", args.tokenizer] if args.tokenizer else []
    return subprocess.call(argv)


def run(args: argparse.Namespace) -> int:
    if args.verb == "export":
        return export(args)
    from trainer import rootowner, storage

    try:
        opts = json.loads(args.storage_options) if args.storage_options else None
    except json.JSONDecodeError as e:
        print(f"orchctl: --storage-options: not JSON: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.verb == "owner":
            owner = rootowner.read_owner(args.url, opts)
            if owner is None:
                print(f"orchctl: checkpoint root {args.url} has no owner marker", file=sys.stderr)
                return EXIT_NOT_FOUND
            print(owner.body().decode())
            return EXIT_OK
        operator = args.operator or getpass.getuser()
        owner = rootowner.take_over(args.url, args.job, args.cluster, opts, operator=operator, reason=args.reason)
    except (ValueError, storage.StoreConfigError) as e:
        print(f"orchctl: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(owner.body().decode())
    return EXIT_OK
