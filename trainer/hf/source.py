"""Where a model, tokenizer or dataset comes from: a local path, an fsspec URL, or a Hugging Face hub id.

Role: one resolver for ``trainer.args.model``, ``tokenizer`` and ``dataset``. A local path (or ``file://``) is
used in place; ``s3://``, ``gs://``, ``az://`` (and any fsspec scheme the node allows) are copied into a
local directory first, through the same fsspec stores as checkpoints (``trainer.storage``, with the job's
``storage_options``); a hub id (``org/name``) is handed to transformers / datasets where the hub is
reachable. Only the schemes in ``ORCH_MODEL_SCHEMES`` are accepted: orchd sets it on every generation from its
configuration (``[trainer] model_schemes``, default ``file,s3,gs,az,hub,builtin``; a job cannot set it), and
refuses at submit a job whose source shows a scheme outside it (``trainer.contract.model_scheme_problems``).
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any

from trainer import storage
from trainer.contract import ENV_MODEL_SCHEMES, MODEL_SCHEMES, scheme_names, source_scheme

BUILTIN = "builtin://"  # builtin://NAME: a model config shipped in trainer/hf/configs (NAME.json), e.g. llama-tiny
CONFIGS = os.path.join(os.path.dirname(__file__), "configs")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# what a save_pretrained directory holds that loading needs (weights: safetensors only, never pickles)
MODEL_FILES = re.compile(r"^(config\.json|generation_config\.json|.*\.safetensors|model\.safetensors\.index\.json|"
                         r"tokenizer.*|special_tokens_map\.json|vocab\.(json|txt)|merges\.txt|chat_template.*)$")


class SourceError(ValueError):
    """A model, tokenizer or dataset source that cannot be used; the text names it and why."""


@dataclass(frozen=True, slots=True)
class Source:
    kind: str  # "local" | "url" | "hub"
    location: str  # local path, URL, or hub id
    scheme: str  # "file", "s3", ..., or "hub"


def allowed_schemes(env: dict[str, str] | None = None) -> tuple[str, ...]:
    """orchd's list, as the agent passed it (``ORCH_MODEL_SCHEMES``); unset: every scheme (``MODEL_SCHEMES``)."""
    raw = (os.environ if env is None else env).get(ENV_MODEL_SCHEMES)
    return scheme_names(raw.split(",")) if raw else MODEL_SCHEMES


def classify(what: str, value: str, *, env: dict[str, str] | None = None) -> Source:
    """The kind of ``value`` (for ``trainer.args.<what>``), refused when its scheme is not allowed."""
    if not value:
        raise SourceError(f"trainer.args.{what}: empty")
    if value.startswith(BUILTIN):
        name = value[len(BUILTIN):]
        names = sorted(n[:-5] for n in os.listdir(CONFIGS) if n.endswith(".json"))
        if name not in names:
            raise SourceError(f"trainer.args.{what}: no built-in config {name!r} (have: {', '.join(names)})")
        src = Source("local", os.path.join(CONFIGS, name + ".json"), "builtin")
    elif "://" in value:
        scheme = source_scheme(value) or ""
        src = Source("local", storage.local_path(value), "file") if scheme == "file" else Source("url", value, scheme)
    elif os.path.exists(os.path.expanduser(value)) or value.startswith(("/", ".", "~")):
        src = Source("local", os.path.expanduser(value), "file")
    elif _HUB_ID.match(value):
        src = Source("hub", value, "hub")
    else:
        raise SourceError(f"trainer.args.{what}: {value!r} is neither an existing path, a URL nor a hub id")
    allowed = allowed_schemes(env)
    if src.scheme not in allowed:
        raise SourceError(f"trainer.args.{what}: scheme {src.scheme!r} of {value!r} is not allowed by orchd's "
                          f"configuration ([trainer] model_schemes = {', '.join(allowed)})")
    if src.kind == "local" and not os.path.exists(src.location):
        raise SourceError(f"trainer.args.{what}: {src.location} does not exist")
    return src


def fetch(src: Source, storage_options: dict[str, Any] | None, *, only: re.Pattern[str] | None = None) -> str:
    """A local path for ``src``: itself when local; else a copy of the URL's file or directory (only the
    names ``only`` matches, for a directory) in a fresh temporary directory."""
    if src.kind == "local":
        return src.location
    if src.kind != "url":
        raise SourceError(f"{src.location}: a hub id has no local copy here")
    try:
        fs = storage.filesystem(src.location, storage_options)
        path = storage.path_of(src.location)
        dest = tempfile.mkdtemp(prefix="orch-hf-")
        if not fs.isdir(path):
            local = os.path.join(dest, os.path.basename(path.rstrip("/")))
            fs.get(path, local)
            return local
        names = [n.rsplit("/", 1)[-1] for n in storage.listing(fs, path)]
        picked = [n for n in names if only is None or only.match(n)]
        if not picked:
            raise SourceError(f"{src.location}: no usable files (found {sorted(names)[:10]})")
        for n in picked:
            fs.get(f"{path.rstrip('/')}/{n}", os.path.join(dest, n))
        return dest
    except SourceError:
        raise
    except Exception as e:  # a store's own error: say which source and what happened
        raise SourceError(f"{src.location}: cannot be read: {storage.explain(src.location, e)}") from e
