"""Hugging Face models and datasets in the built-in trainer, and the Hugging Face ``Trainer`` as a spot job.

Needs the ``[hf]`` extra (transformers, datasets, tokenizers, safetensors). Nothing here is imported by
orchd, orchctl or the agent: the torch-free schema of the arguments is in ``trainer.contract``.

- ``trainer.hf.source``: where a model, tokenizer or dataset comes from (local path, fsspec URL, hub id) and
  the schemes orchd's configuration allows (``ORCH_MODEL_SCHEMES``).
- ``trainer.hf.model``: a causal LM from a ``save_pretrained`` directory (safetensors only, never remote
  code) or a ``config.json``; FSDP2 per decoder layer (the model's own ``_no_split_modules``), then the root.
- ``trainer.hf.data``: a text column of jsonl / parquet / text / arrow files (or a hub dataset),
  tokenized deterministically and packed into one token stream for ``trainer.data.Corpus``.
- ``trainer.hf.export``: a committed checkpoint -> a ``save_pretrained`` directory (``python -m trainer.export``).
- ``trainer.hf.callback``: ``spot_train(trainer)`` around an existing Hugging Face ``Trainer``.
- ``trainer.hf.accelerate``: ``SpotAccelerate`` for a plain Accelerate loop.
"""

MISSING_EXTRA = ("the Hugging Face integration needs the [hf] extra: pip install 'spot-orchestrator[hf]' "
                 "(transformers, datasets, tokenizers, safetensors)")


def require_hf() -> None:
    """Fail with the extra to install when transformers is missing (rather than an ImportError deep inside)."""
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise SystemExit(MISSING_EXTRA) from e
