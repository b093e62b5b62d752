"""Pure unit tests: byte tokenizer, deterministic order, balanced shards, micro-batch plans, args."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trainer import contract
from trainer.data import (
    Corpus,
    ExactlyOnceSampler,
    GlobalOrder,
    decode,
    encode,
    micro_batch_plan,
    rank_slice,
    synthetic_corpus,
)
from trainer.gpt import TrainerArgs, parse_args
from trainer.model import SIZES, config_for


def test_byte_tokenizer_roundtrip() -> None:
    text = "Spot GPUs: naïve ✓"
    assert decode(encode(text)) == text
    assert encode(text).max() < 256


def test_synthetic_corpus_is_deterministic_text() -> None:
    a, b = synthetic_corpus(4096), synthetic_corpus(4096)
    assert a == b and len(a) == 4096 and a.decode().isprintable()


def test_order_is_a_permutation_per_epoch_and_depends_on_seed() -> None:
    order = GlobalOrder(50, seed=3)
    epoch0 = [order.corpus_index(i) for i in range(50)]
    epoch1 = [order.corpus_index(i) for i in range(50, 100)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(50))
    assert epoch0 != epoch1
    assert epoch0 != [GlobalOrder(50, seed=4).corpus_index(i) for i in range(50)]


@pytest.mark.parametrize("B,ws", [(6, 1), (6, 2), (6, 3), (7, 3), (2, 3), (64, 8)])
def test_rank_slices_partition_the_global_batch(B: int, ws: int) -> None:
    slices = [rank_slice(B, ws, r) for r in range(ws)]
    assert [i for lo, hi in slices for i in range(lo, hi)] == list(range(B))
    assert max(hi - lo for lo, hi in slices) - min(hi - lo for lo, hi in slices) <= 1


@pytest.mark.parametrize("B,ws,micro", [(6, 2, 2), (7, 3, 2), (2, 3, 4), (64, 8, 3)])
def test_micro_batch_plans_have_equal_counts_and_cover_each_share(B: int, ws: int, micro: int) -> None:
    plans = [micro_batch_plan(B, ws, r, micro) for r in range(ws)]
    assert len({len(p) for p in plans}) == 1
    for r, plan in enumerate(plans):
        lo, hi = rank_slice(B, ws, r)
        assert [i for rg in plan for i in rg] == list(range(lo, hi))
        assert all(len(rg) <= micro for rg in plan)


def test_sampler_resumes_exactly_at_another_world_size() -> None:
    seen: list[int] = []
    s = ExactlyOnceSampler(num_samples=40, global_batch=6, seed=1)
    for ws, steps in [(2, 3), (3, 4), (1, 2)]:
        state = s.state_dict()
        s = ExactlyOnceSampler(num_samples=40, global_batch=6, seed=1)
        s.load_state_dict(state)
        for _ in range(steps):
            base = s.position.next_sample
            for r in range(ws):
                ids = s.step_ids(r, ws)
                seen += ids
            s.position.next_sample = base + 6
    assert seen == list(range(9 * 6))
    with pytest.raises(ValueError):
        ExactlyOnceSampler(num_samples=40, global_batch=8, seed=1).load_state_dict(state)


def test_corpus_windows_overlap_by_one_target_token() -> None:
    c = Corpus(np.arange(101) % 256, seq_len=10)
    assert c.num_samples == 10
    assert list(c.window(1)) == list(range(10, 21))


def test_args_from_env_json_and_flags() -> None:
    env = {contract.ENV_TRAINER_ARGS: json.dumps({"size": "mini", "global_batch": 12, "lr": 1e-3})}
    a = parse_args(["--global-batch", "16", "--compile", "--storage-options", '{"anon": true}'], env)
    assert (a.size, a.global_batch, a.lr, a.compile, a.storage_options) == ("mini", 16, 1e-3, True, {"anon": True})
    assert parse_args([], {}) == TrainerArgs()
    with pytest.raises(SystemExit):
        parse_args([], {contract.ENV_TRAINER_ARGS: json.dumps({"bogus": 1})})


def test_model_sizes_span_tiny_to_1_3b() -> None:
    assert config_for("tiny", 64).n_params() < 100_000
    big = config_for("1.3b", 2048)
    assert 1.1e9 < big.n_params() < 1.4e9
    assert big.flops_per_token() > 6 * 1.1e9
    assert set(SIZES) >= {"tiny", "1.3b"}
