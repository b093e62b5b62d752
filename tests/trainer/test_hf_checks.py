"""Checks of Hugging Face jobs: at submit (torch-free schema, every problem at once), at generation start (a
missing model or a dataset without the column fails with ``spec_error``, which the agent reports and orchd
does not retry), and the shipped example spec (config/jobs/llama-spot.toml) trains."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.ranks import classify
from orchestrator.jobspec import JobSpecError, load_jobspec, parse_jobspec
from tests.extras import needs
from tests.trainer import hf_fixtures
from tests.trainer.forked import ForkedGeneration
from tests.trainer.helpers import GPT_CMD, REPO, trainer_env
from trainer import contract
from trainer.contract import trainer_args_problems

pytestmark = needs("transformers")


def test_submit_lists_every_hf_problem_at_once() -> None:
    got = trainer_args_problems({"model": "m", "size": "tiny", "dataset": "d", "corpus": "c", "text_column": "",
                                 "tokenizer": 3})
    assert any(p.startswith("trainer.args.size: give either size") for p in got), got
    assert any(p.startswith("trainer.args.corpus: give either dataset or corpus") for p in got), got
    assert any(p.startswith("trainer.args.text_column:") for p in got), got
    assert any(p.startswith("trainer.args.tokenizer:") for p in got), got
    assert trainer_args_problems({"dataset": "d"}) == ["trainer.args.dataset: needs trainer.args.model (a Hugging "
                                                       "Face model and its tokenizer)"]
    assert trainer_args_problems({"model": "s3://b/m", "dataset": "s3://b/d.jsonl", "text_column": "body"}) == []


def test_integration_needs_a_command_and_reaches_the_ranks() -> None:
    base = 'name = "j"\ntotal_steps = 10\ngpu_type = "cpu"\n[checkpoint]\nurl = "file:///tmp/j"\n'
    with pytest.raises(JobSpecError) as e:
        parse_jobspec(base + '[trainer]\nintegration = "hf"\n', fmt="toml")
    assert "trainer.integration: needs trainer.command" in str(e.value)
    with pytest.raises(JobSpecError) as e:
        parse_jobspec(base + '[trainer]\ncommand = ["python", "train.py"]\nintegration = "tf"\n', fmt="toml")
    assert "trainer.integration" in str(e.value)
    spec = parse_jobspec(base + '[trainer]\ncommand = ["python", "train.py"]\nintegration = "hf"\n', fmt="toml")
    assert spec.trainer.env[contract.ENV_INTEGRATION] == "hf"
    assert load_jobspec(REPO / "config" / "jobs" / "llama-spot.toml").trainer.args["model"] == "builtin://llama-tiny"


def test_agent_reports_spec_error() -> None:
    assert classify([1, 0], spec_error=True) == (contract.SPEC_ERROR_REASON, 1)
    assert classify([1, 77], spec_error=True)[0] == "peer_lost"


def test_dataset_without_the_column_is_a_spec_error(tmp_path: Path) -> None:
    from trainer.hf.data import texts
    from trainer.hf.source import SourceError

    data = hf_fixtures.write_jsonl(tmp_path / "d.jsonl", n=5)
    with pytest.raises(SourceError, match=r"no column 'body' \(has \['id', 'text'\]\)"):
        texts(str(data), "body", None)
    with pytest.raises(SourceError, match="does not exist"):
        texts(str(tmp_path / "nope.jsonl"), "text", None)


@pytest.mark.slow
def test_generation_start_fails_with_spec_error_and_the_example_spec_trains(tmp_path: Path) -> None:
    (tmp_path / "bad").mkdir()
    bad_args = {"model": str(tmp_path / "none")}
    bad = ForkedGeneration(GPT_CMD, 1, trainer_env(tmp_path / "bad", total_steps=3, args=bad_args))
    spec = load_jobspec(REPO / "config" / "jobs" / "llama-spot.toml")
    (tmp_path / "ok").mkdir()
    ok = ForkedGeneration(GPT_CMD, 1, trainer_env(tmp_path / "ok", total_steps=3, args=dict(spec.trainer.args)))
    assert bad.wait() == [1], bad.log()
    (exit_report,) = bad.reports(contract.ExitReport)
    assert exit_report.reason.startswith(f"{contract.SPEC_ERROR_REASON}: trainer.args.model: "), exit_report
    assert "does not exist" in exit_report.reason
    assert ok.wait() == [0], ok.log()
    losses = [r.loss for r in ok.reports(contract.StepReport)]
    assert len(losses) == 3 and all(x == x for x in losses)
