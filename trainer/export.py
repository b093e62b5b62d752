"""``python -m trainer.export CHECKPOINT OUT``: a Hugging Face job's checkpoint as a ``save_pretrained`` directory.

CHECKPOINT is a committed checkpoint directory (``.../step_000000120``) or a job's checkpoint root (its
newest committed checkpoint); any fsspec URL the trainer reads (``file://``, ``s3://``, ``gs://``, ``az://``).
OUT gets ``config.json``, ``model.safetensors`` and the job's tokenizer. Needs the ``[hf]`` extra.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="a checkpoint directory or a job's checkpoint root (URL or path)")
    p.add_argument("out", help="the directory to write (save_pretrained layout)")
    p.add_argument("--storage-options", type=json.loads, default=None, help="fsspec options (JSON), as the job's")
    p.add_argument("--tokenizer", default=None, help="tokenizer to save beside it (default: the job's)")
    a = p.parse_args(argv)
    from trainer.hf import require_hf

    require_hf()
    from trainer.hf.export import ExportError, export

    try:
        used = export(a.checkpoint, a.out, storage_options=a.storage_options, tokenizer=a.tokenizer)
    except ExportError as e:
        print(f"export failed: {e}", file=sys.stderr)
        return 1
    print(f"exported {used} -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
