"""The one validator of a job spec (``orchestrator.jobspec.spec_problems``): the built-in trainer's arguments.

A spec without ``trainer.command`` runs ``python -m trainer``, whose arguments are checked at submit
against ``trainer.contract.TRAINER_ARGS`` (torch-free). The schema is kept in step with the trainer
itself (``trainer.gpt.TrainerArgs`` and ``trainer.model.SIZES``, read from their source so that no torch
is needed), and where torch is installed, the trainer's own parser refuses what the schema refuses.
orchd's admin submit path (same function) is exercised in tests/ops/test_shipped_config.py.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.jobspec import SPEC_CHECKS, JobSpecError, parse_jobspec, spec_problems
from trainer.contract import ENV_TRAINER_ARGS, TRAINER_ARGS, TRAINER_SIZES, trainer_args_problems
from wire import CheckpointPolicy, JobSpec, TrainerSpec

TRAINER = Path(__file__).resolve().parents[2] / "trainer"
OLD_DEMO = 'name = "d"\ntotal_steps = 0\ngpu_type = "cpu"\n[trainer]\nargs = { model = "tiny", batch_size = 8 }\n' \
           '[checkpoint]\nurl = "file:///tmp/ck"\n'


def _class_fields(path: Path, name: str) -> dict[str, ast.expr | None]:
    (cls,) = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef) and n.name == name]
    return {s.target.id: s.value for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def _trainer_defaults() -> dict[str, Any]:
    out = {}
    for key, value in _class_fields(TRAINER / "gpt.py", "TrainerArgs").items():
        try:
            out[key] = ast.literal_eval(value) if value is not None else None
        except ValueError:  # field(default_factory=...)
            continue
    return out


def test_schema_names_exactly_the_trainers_arguments_and_sizes() -> None:
    assert sorted(_class_fields(TRAINER / "gpt.py", "TrainerArgs")) == sorted(TRAINER_ARGS)
    (sizes,) = [n.value for n in ast.walk(ast.parse((TRAINER / "model.py").read_text()))
                if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "SIZES"]
    assert isinstance(sizes, ast.Dict)
    assert tuple(ast.literal_eval(k) for k in sizes.keys if k is not None) == TRAINER_SIZES


def test_the_trainers_own_defaults_are_accepted() -> None:
    defaults = {k: v for k, v in _trainer_defaults().items() if v is not None or k in ("bf16", "total_steps")}
    assert len(defaults) > 20
    assert trainer_args_problems(defaults) == []


def test_every_problem_of_a_spec_at_once() -> None:
    with pytest.raises(JobSpecError) as e:
        parse_jobspec(OLD_DEMO, source="old-demo.toml")
    assert [p.split(":")[0] for p in e.value.problems] == [
        "total_steps", "trainer.args.batch_size", "trainer.args.model"]
    assert "not an argument of the built-in trainer" in e.value.problems[1]
    # the same rules on a spec that arrives over the wire (orchd's submit path)
    wire = JobSpec(name="d", total_steps=10, gpu_type="cpu", checkpoint=CheckpointPolicy(url="file:///tmp/ck"),
                   trainer=TrainerSpec(args={"size": "huge", "global_batch": 0, "mode": "tp", "compile": "yes"}))
    problems = spec_problems(wire)
    assert [p.split(":")[0] for p in problems] == ["trainer.args.compile", "trainer.args.global_batch",
                                                    "trainer.args.mode", "trainer.args.size"], problems
    assert "'huge' is not one of tiny, mini" in problems[3]


def test_a_custom_command_owns_its_arguments() -> None:
    spec = JobSpec(name="c", total_steps=10, gpu_type="cpu", checkpoint=CheckpointPolicy(url="file:///tmp/ck"),
                   trainer=TrainerSpec(command=("python", "train.py"), args={"model": "tiny", "batch_size": 8}))
    assert spec_problems(spec) == []


def test_trainer_config_names_its_reason() -> None:
    text = 'name = "g"\ntotal_steps = 5\ngpu_type = "A100"\n[trainer]\nconfig = "gpt.toml"\n' \
           '[checkpoint]\nurl = "s3://b/ck"\n'
    with pytest.raises(JobSpecError) as e:
        parse_jobspec(text)
    (problem,) = e.value.problems
    assert problem.startswith("trainer.config: the built-in trainer reads no config file")


def test_every_check_runs() -> None:
    names = [c.__name__ for c in SPEC_CHECKS]
    assert "_trainer_problems" in names and "_field_problems" in names


@pytest.mark.parametrize("args", [{"model": "tiny"}, {"size": "huge"}, {"mode": "tp"}])
def test_the_trainer_refuses_what_the_schema_refuses(args: dict[str, Any]) -> None:
    pytest.importorskip("torch")
    from trainer.gpt import parse_args

    assert trainer_args_problems(args)
    with pytest.raises(SystemExit):
        parse_args([], env={ENV_TRAINER_ARGS: json.dumps(args)})
    good = {"size": "tiny", "global_batch": 4, "micro_batch": 2, "mode": "ddp", "compile": False}
    assert trainer_args_problems(good) == []
    assert parse_args([], env={ENV_TRAINER_ARGS: json.dumps(good)}).size == "tiny"
