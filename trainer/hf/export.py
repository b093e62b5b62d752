"""A committed checkpoint of a Hugging Face job -> a ``save_pretrained`` directory (safetensors).

Role: the way out of the trainer for a model trained from ``trainer.args.model``. The checkpoint is
verified first (commit marker, every file's size and CRC32C), the model is rebuilt from the config the
trainer kept in its extra state (``config.hf_config``), its weights are read from the DCP shards on this
one process (any world size wrote them), and written with ``save_pretrained`` (safetensors), with the
job's tokenizer when it had one. ``AutoModelForCausalLM.from_pretrained(out)`` then gives the trained
model's logits. Optimizer state is not exported.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from trainer import extra_state, store


class ExportError(Exception):
    """The checkpoint cannot be exported; the text says why."""


def pick_checkpoint(url: str, storage_options: dict[str, Any] | None) -> str:
    """``url`` itself when it is a committed checkpoint directory, else the newest committed one under it."""
    if store.step_of(url.rstrip("/").rsplit("/", 1)[-1]) is not None:
        return url
    committed = [d for _, d, ok in store.list_checkpoints(url, storage_options) if ok]
    if not committed:
        raise ExportError(f"{url}: no committed checkpoint")
    return committed[-1]


def read_extra(dir_url: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    fs = store.filesystem(dir_url, storage_options)
    with fs.open(store.join(store._path(dir_url), "__extra_0.pt"), "rb") as f:
        return extra_state.decode("__extra_0.pt", f.read())


def export(ckpt_url: str, out: str, *, storage_options: dict[str, Any] | None = None,
           tokenizer: str | None = None) -> str:
    """Write the model of ``ckpt_url`` (a checkpoint directory or a job's root) to ``out``; returns the
    checkpoint directory used."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from trainer.hf.model import config_from_dict

    hf_logging.disable_progress_bar()

    dir_url = pick_checkpoint(ckpt_url, storage_options)
    if (problem := store.verify(dir_url, storage_options)) is not None:
        raise ExportError(f"{dir_url}: not a usable checkpoint: {problem}")
    extra = read_extra(dir_url, storage_options)
    config = extra.get("config") or {}
    hf_config = config.get("hf_config")
    if not isinstance(hf_config, dict):
        raise ExportError(f"{dir_url}: not a Hugging Face job's checkpoint (its config has no hf_config; "
                          "the built-in GPT has no Hugging Face export)")
    model = AutoModelForCausalLM.from_config(config_from_dict(dict(hf_config), dir_url), dtype=torch.float32)
    state = model.state_dict()
    dcp.load({"model": state}, storage_reader=store.make_reader(dir_url, storage_options),
             no_dist=True)
    model.load_state_dict(state)
    model.config.use_cache = True
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    _save_tokenizer(tokenizer if tokenizer is not None else str(config.get("tokenizer") or config.get("model") or ""),
                    out, storage_options)
    return dir_url


def _save_tokenizer(value: str, out: str, storage_options: dict[str, Any] | None) -> None:
    """The job's tokenizer beside the weights, when it had a loadable one (not ``bytes``, not a bare config)."""
    from trainer.hf.data import BYTES, HFTokenizer
    from trainer.hf.source import SourceError, classify, fetch

    if not value or value == BYTES or value.endswith(".json"):
        return
    try:
        HFTokenizer(fetch(classify("tokenizer", value), storage_options)).tok.save_pretrained(out)
    except SourceError as e:
        print(f"export: tokenizer not written: {e}", flush=True)
