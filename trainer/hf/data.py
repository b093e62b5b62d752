"""A text column of a dataset, tokenized with the model's tokenizer and packed into one token stream.

Role: ``trainer.args.dataset`` (+ ``text_column``, ``tokenizer``) -> a 1-D int array for
``trainer.data.Corpus``, whose non-overlapping ``seq_len + 1`` windows and ``ExactlyOnceSampler`` give the
same exactly-once order, checkpointed position and resharding as the built-in corpus. Deterministic:
rows are read in file order (files of a directory sorted by name), each row's text is tokenized on its
own (no special tokens) and followed by the tokenizer's EOS token; the same files and tokenizer give the
same stream on every rank and in every generation (the checkpoint's ``num_samples`` check refuses a
resume on a dataset of another size).

Formats by extension: ``.jsonl`` / ``.json`` (one JSON object per line), ``.parquet``, ``.arrow`` (Arrow IPC,
file or stream: what ``datasets`` writes), ``.txt`` / ``.text`` (a row per line, column ``text``). A directory
means all such files in it. A hub id goes through ``datasets.load_dataset(id, split="train")``.
Tokenizers: a tokenizer directory (``save_pretrained``), the model's directory (the default), or
``bytes`` (UTF-8 bytes are the ids; EOS = newline; the model's vocabulary must hold 256).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from trainer.hf.source import SourceError, classify, fetch

EXTENSIONS = (".jsonl", ".json", ".parquet", ".arrow", ".txt", ".text")
BYTES = "bytes"


class ByteTokenizer:
    """UTF-8 bytes as token ids: a tokenizer that needs no files (and no download)."""

    eos_token_id = 10  # "\n"
    vocab_size = 256

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]


class HFTokenizer:
    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        try:
            self.tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        except (OSError, ValueError) as e:
            raise SourceError(f"trainer.args.tokenizer: no tokenizer in {path}: {e}") from e
        self.eos_token_id = self.tok.eos_token_id
        self.vocab_size = len(self.tok)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return list(self.tok(texts, add_special_tokens=False)["input_ids"])


def load_tokenizer(value: str, model_where: str, storage_options: dict[str, Any] | None) -> Any:
    """``bytes``, a tokenizer directory or URL, or ("" ) the model's own directory (or the config's)."""
    if value == BYTES:
        return ByteTokenizer()
    if value:
        return HFTokenizer(fetch(classify("tokenizer", value), storage_options))
    if os.path.isfile(model_where):  # a config.json: its directory may hold a tokenizer
        model_where = os.path.dirname(model_where) or "."
        if not any(n.startswith("tokenizer") for n in os.listdir(model_where)):
            raise SourceError("trainer.args.tokenizer: the model is a config.json with no tokenizer beside it; give "
                              "trainer.args.tokenizer (a tokenizer directory, or \"bytes\")")
    return HFTokenizer(model_where)


def _files(path: str) -> list[str]:
    if os.path.isdir(path):
        files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(EXTENSIONS))
        if not files:
            raise SourceError(f"trainer.args.dataset: {path} holds no {'/'.join(EXTENSIONS)} files")
        return files
    if not path.endswith(EXTENSIONS):
        raise SourceError(f"trainer.args.dataset: {path}: unknown format (expected one of {', '.join(EXTENSIONS)})")
    return [path]


def _arrow_table(path: str) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.endswith(".parquet"):
        return pq.read_table(path)
    with open(path, "rb") as f:
        head = f.read(6)
    with pa.memory_map(path) as src:
        return (pa.ipc.open_file(src) if head == b"ARROW1" else pa.ipc.open_stream(src)).read_all()


def _rows(path: str, column: str) -> Iterator[str]:
    if path.endswith((".txt", ".text")):
        if column != "text":
            raise SourceError(f"trainer.args.dataset: {path}: a text file has one column, 'text', not {column!r}")
        with open(path, encoding="utf-8") as f:
            yield from (line.rstrip("\n") for line in f if line.strip())
        return
    if path.endswith((".jsonl", ".json")):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SourceError(f"trainer.args.dataset: {path}:{n}: not JSON: {e}") from e
                if not isinstance(row, dict) or column not in row:
                    keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                    raise SourceError(f"trainer.args.dataset: {path}:{n}: no column {column!r} (has {keys})")
                yield str(row[column])
        return
    table = _arrow_table(path)
    if column not in table.column_names:
        raise SourceError(f"trainer.args.dataset: {path}: no column {column!r} (columns: {table.column_names})")
    yield from (str(v) for v in table.column(column).to_pylist())


def texts(value: str, column: str, storage_options: dict[str, Any] | None) -> Iterable[str]:
    """The rows' texts of ``column``, in a fixed order; the column is checked before any tokenizing."""
    src = classify("dataset", value)
    if src.kind == "hub":
        import datasets

        ds = datasets.load_dataset(src.location, split="train")
        if column not in ds.column_names:
            raise SourceError(f"trainer.args.dataset: {value}: no column {column!r} (columns: {ds.column_names})")
        return (str(t) for t in ds[column])
    local = fetch(src, storage_options)
    files = _files(local)
    for f in files:  # fail at start (generation start) with the column problem, not mid-stream
        next(iter(_rows(f, column)), None)
    return (t for f in files for t in _rows(f, column))


def pack(rows: Iterable[str], tokenizer: Any, vocab_size: int, batch: int = 512) -> np.ndarray:
    """One stream: each row's ids followed by EOS; int32. Ids at or above the model's vocabulary are refused."""
    chunks: list[np.ndarray] = []
    buf: list[str] = []
    eos = tokenizer.eos_token_id

    def flush() -> None:
        for ids in tokenizer.encode_batch(buf):
            chunks.append(np.asarray([*ids, eos] if eos is not None else ids, dtype=np.int32))
        buf.clear()

    for text in rows:
        buf.append(text)
        if len(buf) >= batch:
            flush()
    flush()
    if not chunks:
        raise SourceError("trainer.args.dataset: no rows")
    stream = np.concatenate(chunks)
    top = int(stream.max())
    if top >= vocab_size:
        raise SourceError(f"trainer.args.tokenizer: token id {top} does not fit the model's vocabulary ({vocab_size})")
    return stream


def corpus_text_rows(path: str) -> Iterable[str]:
    """``corpus`` for a Hugging Face model: a local text file (a row per line) or "" (the built-in synthetic text)."""
    from trainer.data import synthetic_corpus

    if not path:
        text = synthetic_corpus().decode()
        return (s + "." for s in text.split(". ") if s)
    with open(os.path.expanduser(path), encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f if line.strip()]
