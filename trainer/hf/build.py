"""The built-in trainer's Hugging Face path: model, sharding and token stream from ``TrainerArgs``.

``trainer.gpt.build`` calls :func:`build_model` and :func:`load_stream` when ``args.model`` is set; the rest
of the trainer (micro-batches, loss scaling, agreement, OOM retry, DCP checkpoints, exactly-once sampler) is
the GPT's own. Problems with the model, tokenizer or dataset raise :class:`trainer.hf.source.SourceError`,
which the trainer turns into exit 1 with ``spec_error: ...`` (the restart hold does not retry it).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torch import nn

from trainer import dist as tdist
from trainer.hf import data as hfdata
from trainer.hf import model as hfmodel
from trainer.hf.source import SourceError


def build_model(args: Any, sess: Any, bf16: bool) -> tuple[hfmodel.HFModelInfo, nn.Module, str]:
    """(info, wrapped model, where it came from): FSDP2 per decoder layer then the root, or DDP."""
    model, where = hfmodel.load_model(args.model, seed=args.seed, storage_options=args.storage_options)
    info = hfmodel.model_info(model, args.seq_len)
    max_pos = info.config.get("max_position_embeddings") or info.config.get("n_positions")
    if isinstance(max_pos, int) and args.seq_len > max_pos:
        raise SourceError(f"trainer.args.seq_len: {args.seq_len} is longer than the model's {max_pos} positions")
    hfmodel.prepare(model, activation_checkpointing=args.activation_checkpointing, compile=args.compile)
    model = model.to(sess.device)
    if args.mode == "ddp":
        return info, tdist.wrap_ddp(model, sess.info), where
    layers = hfmodel.decoder_layers(model)
    return info, tdist.wrap_fsdp(model, sess.info, bf16=bf16, cpu_offload=args.cpu_offload, blocks=layers), where


def load_stream(args: Any, model_where: str, vocab_size: int) -> np.ndarray:
    """The packed token stream of ``dataset`` (its ``text_column``) or of ``corpus`` (a text file, or the
    synthetic text), tokenized with ``tokenizer`` (default: the model's)."""
    tok = hfdata.load_tokenizer(args.tokenizer, model_where, args.storage_options)
    if args.dataset:
        rows = hfdata.texts(args.dataset, args.text_column, args.storage_options)
    else:
        rows = hfdata.corpus_text_rows(args.corpus)
    return hfdata.pack(rows, tok, vocab_size)
