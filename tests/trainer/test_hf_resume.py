"""A Hugging Face model (2-layer Llama from save_pretrained, BPE tokenizer trained here) on a jsonl dataset,
real gloo ranks (forked from one preloaded process: tests/trainer/forked.py) under FSDP2: noticed mid-epoch,
resumed on 2 ranks (bitwise) and on 1 (resharded, 1e-4), and the export loads with from_pretrained and gives
the trained model's logits."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.extras import needs
from tests.trainer import hf_fixtures
from tests.trainer.forked import ForkedGeneration, call
from tests.trainer.helpers import GPT_CMD, step_records, trainer_env
from trainer import contract

# real multi-process generations (run in CI too)
pytestmark = [pytest.mark.slow, needs("transformers")]

TOTAL = 8


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("hf")
    return {"model": call(hf_fixtures.save_llama, d / "model"), "data": hf_fixtures.write_jsonl(d / "data.jsonl")}


def _args(files: dict[str, Path]) -> dict:
    return {"model": str(files["model"]), "dataset": str(files["data"]), "seq_len": 32, "global_batch": 6,
            "micro_batch": 2, "lr": 3e-3, "warmup_steps": 2, "seed": 3, "ckpt_every": 2}


def _losses(d: Path) -> dict[int, float]:
    return {r.step: r.loss for r in step_records(d / "steps.jsonl") if r.rank == 0}


def test_hf_model_resume_bitwise_reshard_and_export(tmp_path: Path, files: dict[str, Path]) -> None:
    args = _args(files)
    ref, run, one = tmp_path / "ref", tmp_path / "run", tmp_path / "one"
    for d in (ref, run, one):
        d.mkdir()
    g_ref = ForkedGeneration(GPT_CMD, 2, trainer_env(ref, total_steps=TOTAL, args=args))
    g = ForkedGeneration(GPT_CMD, 2, trainer_env(run, total_steps=TOTAL, args=args))
    g.wait_step(3, timeout=120)
    g.request_checkpoint(run / "control0")
    assert g.wait() == [contract.EXIT_PREEMPTED] * 2, g.log()
    stop = next(r.step for r in g.reports(contract.CheckpointReport) if r.emergency)
    assert 3 <= stop < TOTAL
    assert g_ref.wait() == [0, 0], g_ref.log()

    # the same checkpoint, resumed on 2 ranks (in place) and on 1 rank (a copy of the root)
    shutil.copytree(run / "ckpt", one / "ckpt")
    shutil.copy(run / "steps.jsonl", one / "steps.jsonl")
    g2 = ForkedGeneration(GPT_CMD, 2, trainer_env(run, total_steps=TOTAL, args=args, resume="latest", generation=1))
    g1 = ForkedGeneration(GPT_CMD, 1, trainer_env(one, total_steps=TOTAL, args=args, resume="latest", generation=1))
    assert g2.wait() == [0, 0], g2.log()
    assert g1.wait() == [0], g1.log()
    assert any(f"step={stop} saved_world_size=2 world_size=1" in line for line in g1.ranks[0].lines), g1.log()

    want = _losses(ref)
    assert sorted(want) == list(range(1, TOTAL + 1))
    got2 = [(r.step, r.loss) for r in step_records(run / "steps.jsonl") if r.rank == 0]
    assert [s for s, _ in got2] == list(range(1, TOTAL + 1))  # no step twice, none skipped
    assert all(want[s] == loss for s, loss in got2), (got2, want)  # bitwise at the same world size
    got1 = _losses(one)
    assert all(abs(want[s] - got1[s]) <= 1e-4 for s in range(stop + 1, TOTAL + 1)), (got1, want)
    assert len({r.loss for r in step_records(ref / "steps.jsonl")}) > 3  # it trains, not a constant

    call(hf_fixtures.check_export, run / "ckpt" / f"step_{TOTAL:09d}", tmp_path, files["model"])

