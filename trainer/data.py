"""Byte tokenizer, local corpus, and the deterministic, exactly-once global sample order.

Role: everything about *which* samples a step consumes. The order is a pure function of
(seed, number of samples): a permutation per epoch. A global batch of B samples per step is cut
from that stream, so step s (1-based) consumes global positions [(s-1)*B, s*B) whatever the world
size; each rank takes a contiguous, balanced slice of it. The position (next global index) is saved in
every checkpoint, so a resume at any world size continues at the next unconsumed sample: every sample is
consumed exactly once across preemptions and resharding.

A sample id is its global stream position (unique for the whole run, also across epochs); the
corpus window it reads is ``order.corpus_index(id)``. No threads, no I/O after construction.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

VOCAB_SIZE = 256  # byte-level tokenizer


def encode(text: str | bytes) -> np.ndarray:
    """Byte-level tokenizer: one token per UTF-8 byte."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, dtype=np.uint8).copy()


def decode(tokens: np.ndarray | list[int]) -> str:
    return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


_WORDS = [
    "the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not", "he",
    "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "they", "you", "were", "her", "she",
    "there", "been", "one", "all", "we", "their", "has", "would", "when", "if", "so", "no", "will", "more", "out",
    "ship", "sea", "wind", "sail", "harbour", "storm", "light", "night", "morning", "river", "stone", "field", "garden",
    "window", "letter", "road", "winter", "summer", "silver", "cloud", "mountain", "bridge", "lantern", "engine",
    "signal", "market",
]


@lru_cache(maxsize=4)
def synthetic_corpus(n_bytes: int = 1 << 20, seed: int = 1234) -> bytes:
    """Deterministic English-like text (no download): sentences of common words with punctuation."""
    rng = np.random.default_rng(seed)
    out: list[str] = []
    size = 0
    while size < n_bytes:
        n = int(rng.integers(5, 16))
        words = [_WORDS[i] for i in rng.integers(0, len(_WORDS), size=n)]
        sentence = " ".join(words).capitalize() + (". " if rng.random() < 0.8 else "? ")
        out.append(sentence)
        size += len(sentence)
    return "".join(out).encode()[:n_bytes]


def load_tokens(path: str | None) -> np.ndarray:
    """Tokens (uint8) of a local text file, or of the built-in synthetic corpus when ``path`` is empty."""
    if not path:
        return encode(synthetic_corpus())
    return np.memmap(os.path.expanduser(path), dtype=np.uint8, mode="r")  # bytes are the tokens; paged in lazily


class Corpus:
    """Non-overlapping windows of seq_len+1 tokens (inputs and shifted targets)."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens = tokens  # uint8 (or a memmap of the file): widened per window, not for the whole corpus
        self.seq_len = seq_len
        self.num_samples = (len(self.tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(f"corpus of {len(tokens)} tokens is too short for seq_len {seq_len}")

    def window(self, index: int) -> np.ndarray:
        start = index * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)


class GlobalOrder:
    """Deterministic order: epoch e is permutation(seed, e) of range(num_samples)."""

    def __init__(self, num_samples: int, seed: int) -> None:
        self.num_samples = num_samples
        self.seed = seed
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def corpus_index(self, sample_id: int) -> int:
        epoch, offset = divmod(sample_id, self.num_samples)
        if epoch != self._perm_epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._perm = rng.permutation(self.num_samples)
            self._perm_epoch = epoch
        return int(self._perm[offset])


def rank_slice(global_batch: int, world_size: int, rank: int) -> tuple[int, int]:
    """Balanced contiguous slice [lo, hi) of a global batch for one rank (sizes differ by at most 1)."""
    lo = rank * global_batch // world_size
    hi = (rank + 1) * global_batch // world_size
    return lo, hi


def micro_batch_plan(global_batch: int, world_size: int, rank: int, micro_batch: int) -> list[range]:
    """Split this rank's share into micro-batches. Every rank gets the same *number* of micro-batches
    (FSDP/DDP collectives run per forward/backward, so counts must match); a rank with fewer samples
    gets empty trailing ranges, which the trainer feeds as zero-weight padding."""
    lo, hi = rank_slice(global_batch, world_size, rank)
    max_share = math.ceil(global_batch / world_size)
    n_micro = max(1, math.ceil(max_share / micro_batch))
    return [range(min(lo + i * micro_batch, hi), min(lo + (i + 1) * micro_batch, hi)) for i in range(n_micro)]


@dataclass(slots=True)
class DataPosition:
    """Checkpointed data state: the next unconsumed global sample id, and what defines the order."""

    next_sample: int = 0
    seed: int = 0
    num_samples: int = 0
    global_batch: int = 0

    def state_dict(self) -> dict[str, int]:
        return {
            "next_sample": self.next_sample,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "global_batch": self.global_batch,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("seed", "num_samples", "global_batch"):
            if getattr(self, key) and state[key] != getattr(self, key):
                raise ValueError(f"checkpoint data {key}={state[key]} differs from this run's {getattr(self, key)}")
        self.next_sample = int(state["next_sample"])


class ExactlyOnceSampler:
    """The few-lines data API: which sample ids this rank feeds at the next step.

    >>> sampler = ExactlyOnceSampler(num_samples=len(ds), global_batch=64, seed=0)
    >>> ids = sampler.next_step(rank, world_size)      # [(sample_id, corpus_index), ...]
    The position advances by the global batch on every rank (all ranks hold the same position).
    """

    def __init__(self, num_samples: int, global_batch: int, seed: int) -> None:
        self.order = GlobalOrder(num_samples, seed)
        self.position = DataPosition(0, seed, num_samples, global_batch)

    @property
    def global_batch(self) -> int:
        return self.position.global_batch

    def step_ids(self, rank: int, world_size: int) -> list[int]:
        lo, hi = rank_slice(self.global_batch, world_size, rank)
        base = self.position.next_sample
        return list(range(base + lo, base + hi))

    def next_step(self, rank: int, world_size: int) -> list[tuple[int, int]]:
        ids = self.step_ids(rank, world_size)
        self.position.next_sample += self.global_batch
        return [(i, self.order.corpus_index(i)) for i in ids]

    def state_dict(self) -> dict[str, int]:
        return self.position.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position.load_state_dict(state)
