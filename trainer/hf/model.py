"""A Hugging Face causal LM for the built-in trainer: loading, FSDP2 per decoder layer, FLOP accounting.

Role: ``trainer.args.model`` -> an ``nn.Module`` whose forward(input_ids) gives ``.logits``. Sources (see
``trainer.hf.source``): a ``save_pretrained`` directory (local or fsspec URL; weights from safetensors only),
a hub id, or a ``config.json`` (fresh weights from ``seed``, identical on every rank). Never
``trust_remote_code``: a config naming remote code (``auto_map``) is refused. Parameters are kept in fp32
(the bf16 policy on GPU casts them for compute, reduces in fp32).

Sharding: ``fully_shard`` every module whose class is in the model's own ``_no_split_modules`` (the decoder
layers for Llama, Qwen, Mistral, GPT-2 ...), then the root; the same mixed precision and CPU offload
policies as the GPT (``trainer.dist.wrap_fsdp``). DDP wraps it whole.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainer.hf.source import MODEL_FILES, Source, SourceError, classify, fetch


@dataclass(frozen=True, slots=True)
class HFModelInfo:
    """What the trainer reports about the model (``Built.cfg``): parameter count and training FLOPs per token."""

    model_type: str
    params: int
    matmul_params: int
    n_layer: int
    d_model: int
    seq_len: int
    config: dict[str, Any]  # the model's config as JSON data: kept in every checkpoint (the export rebuilds from it)

    def n_params(self) -> int:
        return self.params

    def flops_per_token(self) -> float:
        """6N (N = parameters in matmuls: all but embeddings and norms) + 12 * layers * d_model * seq_len."""
        return 6.0 * self.matmul_params + 12.0 * self.n_layer * self.d_model * self.seq_len


def config_from_json(path: str) -> Any:
    """A transformers config from a ``config.json`` (``model_type`` must be one transformers knows)."""

    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SourceError(f"trainer.args.model: {path}: not a readable config.json: {e}") from e
    return config_from_dict(data, path)


def config_from_dict(data: Any, where: str) -> Any:
    from transformers import AutoConfig

    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise SourceError(f"trainer.args.model: {where}: a config.json needs a model_type")
    if data.get("auto_map"):
        raise SourceError(f"trainer.args.model: {where}: names remote code (auto_map); remote code is never run")
    data = {k: v for k, v in data.items() if k not in ("transformers_version", "architectures")}
    try:
        return AutoConfig.for_model(data.pop("model_type"), **data)
    except (ValueError, KeyError) as e:
        raise SourceError(f"trainer.args.model: {where}: {e}") from e


def resolve_model(value: str, storage_options: dict[str, Any] | None) -> tuple[Source, str]:
    """(source, local path or hub id): a local copy for URLs; a ``.json`` file is a config, else a directory."""
    src = classify("model", value)
    if src.kind == "hub":
        return src, src.location
    local = fetch(src, storage_options, only=MODEL_FILES)
    if os.path.isdir(local) and not os.path.exists(os.path.join(local, "config.json")):
        raise SourceError(f"trainer.args.model: {value}: no config.json (not a save_pretrained directory)")
    return src, local


def load_model(value: str, *, seed: int, storage_options: dict[str, Any] | None = None) -> tuple[nn.Module, str]:
    """(model in fp32 on CPU, in train mode, no KV cache; the local path or hub id it came from)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one progress line per rank and load: noise in the job's log
    _, where = resolve_model(value, storage_options)
    torch.manual_seed(seed)  # fresh weights from a config: identical on every rank
    if os.path.isfile(where):
        model = AutoModelForCausalLM.from_config(config_from_json(where), dtype=torch.float32)
    else:
        cfg_path = os.path.join(where, "config.json")
        if os.path.isfile(cfg_path):
            config_from_json(cfg_path)  # refuses remote code before transformers reads it
        try:
            model = AutoModelForCausalLM.from_pretrained(where, use_safetensors=True, trust_remote_code=False,
                                                         dtype=torch.float32)
        except OSError as e:
            raise SourceError(f"trainer.args.model: {value}: cannot load safetensors weights: {e}") from e
    model.config.use_cache = False
    model.train()
    return model, where


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP shards one by one: those whose class the model lists in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if not names:
        raise SourceError(f"{type(model).__name__} lists no _no_split_modules: cannot find its decoder layers")
    layers = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if not layers:
        raise SourceError(f"{type(model).__name__}: no module of class {sorted(names)} found")
    return layers


def model_info(model: nn.Module, seq_len: int) -> HFModelInfo:
    cfg: Any = model.config
    params = sum(p.numel() for p in model.parameters())
    embed = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
    n_layer = int(getattr(cfg, "num_hidden_layers", 0) or getattr(cfg, "n_layer", 0) or 0)
    d_model = int(getattr(cfg, "hidden_size", 0) or getattr(cfg, "n_embd", 0) or 0)
    data = json.loads(cfg.to_json_string(use_diff=False))
    return HFModelInfo(cfg.model_type, params, params - embed, n_layer, d_model, seq_len, data)


def prepare(model: nn.Module, *, activation_checkpointing: bool, compile: bool) -> None:
    """Before wrapping: per-layer activation checkpointing (non-reentrant) and ``torch.compile`` per layer."""
    if activation_checkpointing:
        model.gradient_checkpointing_enable(  # type: ignore[operator]
            gradient_checkpointing_kwargs={"use_reentrant": False})
    if compile:
        for layer in decoder_layers(model):
            layer.compile()
