"""Job spec files -> wire.JobSpec through the one configuration loader: every problem in one error."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import yaml

from orchestrator.jobspec import JobSpecError, load_jobspec, parse_jobspec, spec_problems
from wire import CheckpointPolicy, JobSpec, MarketPolicy
from wire.config import SettingsError

JOBS = Path(__file__).resolve().parents[2] / "config" / "jobs"
BASE = 'name = "j"\ntotal_steps = 10\ngpu_type = "A100"\n[checkpoint]\nurl = "file:///ckpt"\n'


def test_shipped_specs_load() -> None:
    now = 1_900_000_000.0  # the submission time: the example's relative deadline never expires
    specs = {p.name: load_jobspec(p, now=now) for p in sorted(JOBS.iterdir())}
    assert set(specs) == {"custom-command.yaml", "gpt-small-spot.toml", "llama-spot.toml", "local-demo.toml"}
    llama = specs["llama-spot.toml"]
    assert llama.trainer.args["model"] == "builtin://llama-tiny" and "size" not in llama.trainer.args
    gpt = specs["gpt-small-spot.toml"]
    assert gpt.deadline_ts == now + 72 * 3600  # deadline_in = "72h"
    assert gpt.trainer.args["size"] == "small" and gpt.trainer.command == ()
    assert (gpt.nodes, gpt.nodes_min, gpt.nodes_max, gpt.market) == (4, 2, 4, MarketPolicy.SPOT_WITH_FALLBACK)
    assert gpt.checkpoint == CheckpointPolicy(url="s3://my-bucket/ckpt/gpt-small", interval_s=900.0, keep=3)
    custom = specs["custom-command.yaml"]
    assert custom.trainer.command[:3] == ("python", "-m", "my_project.train")
    assert custom.trainer.env == {"HF_HOME": "/mnt/cache/hf"} and custom.budget_usd == 800.0
    assert custom.market is MarketPolicy.ON_DEMAND and custom.zones == ("us-west-2a", "us-west-2b")
    demo = specs["local-demo.toml"]
    assert demo.trainer.args["size"] == "tiny" and demo.clouds == ("local", "fake")
    assert all(spec_problems(s) == [] for s in specs.values())


def test_defaults_are_the_wire_defaults() -> None:
    spec = parse_jobspec(BASE)
    assert spec == JobSpec(name="j", total_steps=10, gpu_type="A100", checkpoint=CheckpointPolicy(url="file:///ckpt"))


@pytest.mark.parametrize(("extra", "want"), [
    ("", (1, 1, 1)),
    ("nodes = 3\n", (3, 3, 3)),
    ("nodes = 3\nnodes_max = 5\n", (3, 3, 5)),
    ("nodes = 3\nnodes_min = 2\n", (3, 2, 3)),
    ("nodes_max = 4\n", (1, 1, 4)),
])
def test_node_range_defaults(extra: str, want: tuple[int, int, int]) -> None:
    s = parse_jobspec(extra + BASE)
    assert (s.nodes, s.nodes_min, s.nodes_max) == want


@pytest.mark.parametrize(("line", "ts"), [
    ("deadline = 2026-01-01T10:00:00Z", 1767261600.0),
    ("deadline = 2026-01-01T10:00:00", 1767261600.0),  # no zone: UTC, never local time
    ('deadline = "2026-01-01T12:00:00+02:00"', 1767261600.0),
    ("deadline = 2026-01-01", 1767225600.0),
    ("deadline_ts = 1767261600", 1767261600.0),
])
def test_deadline_forms(line: str, ts: float) -> None:
    assert parse_jobspec(line + "\n" + BASE).deadline_ts == ts


def test_yaml_and_toml_give_the_same_spec() -> None:
    yaml_text = """
name: j
total_steps: 10
gpu_type: A100
deadline: 2026-01-01T10:00:00Z
trainer: {args: {lr: 0.5, compile: true}}
checkpoint: {url: "file:///ckpt", keep: 2}
"""
    toml_text = ('deadline = 2026-01-01T10:00:00Z\n' + BASE + 'keep = 2\n'
                 '[trainer]\nargs = { lr = 0.5, compile = true }\n')
    assert parse_jobspec(yaml_text, fmt="yaml") == parse_jobspec(toml_text)
    assert parse_jobspec(toml_text).trainer.args == {"lr": 0.5, "compile": True}


def test_three_different_errors_are_all_reported() -> None:
    text = 'name = "j"\ntotal_steps = "many"\ngpu_type = "A100"\nmarket = "cheap"\ncolour = "red"\n'
    with pytest.raises(JobSpecError) as err:
        parse_jobspec(text, source="three.toml")
    assert err.value.problems == [
        "colour: unknown key (known: best_effort, budget_usd, checkpoint, clouds, deadline, deadline_in, deadline_ts, "
        "gpu_type, "
        "gpus_per_node, instance_types, market, name, nodes, nodes_max, nodes_min, price, regions, "
        "step_time_s_estimate, total_steps, tracking, trainer, zones)",
        "total_steps: expected an integer, got 'many'",
        "market: 'cheap' is not one of spot, on_demand, spot_with_fallback",
        "checkpoint: required",
    ]
    assert str(err.value).startswith("invalid three.toml (4 problems):")
    assert isinstance(err.value, SettingsError)  # the one loader's error, as orchd's settings raise it


def test_layout_and_cross_field_problems_in_one_error() -> None:
    text = """
name = " "
total_steps = 0
gpu_type = 5
clouds = ["aws", "ibm"]
nodes = 5
nodes_max = 2
deadline = "soon"
[trainer]
command = ["run"]
config = "c.toml"
args = { a = [1] }
[checkpoint]
url = "http://x"
keep = 0
[price]
resume_below_ratio = 2
bogus = 1
"""
    with pytest.raises(JobSpecError) as err:
        parse_jobspec(text)
    assert sorted(err.value.problems) == sorted([
        "total_steps: must be > 0, got 0",
        "gpu_type: expected a string, got 5",
        "clouds[1]: 'ibm' is not one of aws, gcp, azure, local, fake",
        "deadline: not an ISO-8601 date-time: 'soon'",
        "trainer.args.a: expected str | int | float | bool, got [1]",
        "checkpoint.keep: must be >= 1, got 0",
        "price.bogus: unknown key (known: migrate_min_saving, pause_above_ratio, resume_below_ratio)",
        # the cross-field rules ran on the valid part:
        "name: must not be empty",
        "nodes: need nodes_min <= nodes <= nodes_max, got 2 <= 5 <= 2",
        "trainer: give either command or config, not both",
        "checkpoint.url: must start with one of file://, s3://, gs://, az://, abfs://, got 'http://x'",
        "price: need 0 < resume_below_ratio <= pause_above_ratio",
    ])


def test_rules_on_stand_ins_are_not_reported() -> None:
    text = ('nodes = 4\nnodes_max = "x"\ndeadline_ts = "soon"\ndeadline = 2026-01-01\n'
            'trainer = { command = "python train.py" }\n'
            '[price]\npause_above_ratio = "hi"\nresume_below_ratio = 0.99\n[checkpoint]\ninterval_s = 0\n')
    with pytest.raises(JobSpecError) as err:
        parse_jobspec(text)
    assert sorted(err.value.problems) == sorted([
        "name: required", "total_steps: required", "gpu_type: required", "checkpoint.url: required",
        "nodes_max: expected an integer, got 'x'",  # no "nodes: need ..." about the default nodes_max
        "deadline_ts: expected a number, got 'soon'",  # no "give either deadline or deadline_ts"
        "trainer.command: expected a list of arguments, got 'python train.py'",
        "checkpoint.interval_s: must be > 0, got 0.0",
        "price.pause_above_ratio: expected a number, got 'hi'",  # no "price: need ..." about the default
    ])


def test_file_bounds_agree_with_the_wire_rules() -> None:
    """A bound checked while loading a file names the same key as spec_problems does on a wire spec."""
    cases = {"total_steps": 0, "gpus_per_node": 0, "nodes_min": 0, "step_time_s_estimate": 0.0, "budget_usd": -1.0}
    good = {"name": "j", "total_steps": 10, "gpu_type": "A100", "checkpoint": {"url": "file:///ckpt"}}
    for key, bad in cases.items():
        with pytest.raises(JobSpecError) as err:
            parse_jobspec(yaml.safe_dump(good | {key: bad, "nodes": 1, "nodes_max": 1}), fmt="yaml")
        assert [p.split(":")[0] for p in err.value.problems] == [key]
        wire = msgspec.to_builtins(parse_jobspec(yaml.safe_dump(good), fmt="yaml")) | {key: bad}
        assert [p.split(":")[0] for p in spec_problems(msgspec.convert(wire, JobSpec))] == [key]


def test_spec_problems_on_a_wire_spec() -> None:
    spec = JobSpec(name="", total_steps=-1, gpu_type="A100", clouds=("ibm",), nodes=3, nodes_max=2,
                   checkpoint=CheckpointPolicy(url="ftp://x", keep=0))
    assert [p.split(":")[0] for p in spec_problems(spec)] == [
        "name", "total_steps", "nodes", "clouds[0]", "checkpoint.url", "checkpoint.keep"]


def test_bad_syntax_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(JobSpecError, match="not valid TOML"):
        parse_jobspec("name = ")
    with pytest.raises(JobSpecError, match="not valid YAML"):
        parse_jobspec("a: [", fmt="yaml")
    with pytest.raises(JobSpecError, match="expected a table at the top level, got list"):
        parse_jobspec("- 1", fmt="yaml")
    with pytest.raises(JobSpecError, match="cannot read"):
        load_jobspec(tmp_path / "missing.toml")
    with pytest.raises(JobSpecError, match=r"trainer.env: key 1 is not a string"):
        parse_jobspec("trainer: {env: {1: x}}\n" + "name: j\ntotal_steps: 1\ngpu_type: g\ncheckpoint: {url: file:///c}",
                      fmt="yaml")


def test_start_from_is_read_from_the_checkpoint_table_and_checked() -> None:
    spec = parse_jobspec(BASE + 'start_from = "file:///other/step_000000200"\n')
    assert spec.checkpoint.start_from == "file:///other/step_000000200"
    assert parse_jobspec(BASE).checkpoint.start_from is msgspec.UNSET  # omitted: not encoded at all
    yml = yaml.safe_dump({"name": "j", "total_steps": 10, "gpu_type": "A100",
                          "checkpoint": {"url": "s3://b/new", "start_from": "s3://b/old/step_000000010"}})
    assert parse_jobspec(yml, fmt="yaml").checkpoint.start_from == "s3://b/old/step_000000010"
    with pytest.raises(JobSpecError) as e:
        parse_jobspec(BASE + 'start_from = "http://x/step_1"\n')
    assert e.value.problems == [
        "checkpoint.start_from: must start with one of file://, s3://, gs://, az://, abfs://, got 'http://x/step_1'"]
    with pytest.raises(JobSpecError) as e:  # inside its own root: its own rotation would delete it
        parse_jobspec(BASE + 'start_from = "file:///ckpt/./step_000000200/"\n')
    assert [p.split(":")[0] for p in e.value.problems] == ["checkpoint.start_from"]
    assert "must lie outside checkpoint.url" in e.value.problems[0]


def test_file_checkpoint_urls_must_be_absolute() -> None:
    with pytest.raises(JobSpecError) as e:
        parse_jobspec(BASE.replace("file:///ckpt", "file://ckpt/rel") + 'start_from = "file://localhost/x"\n')
    assert e.value.problems == [
        "checkpoint.url: a file:// path must be absolute (file:///path), got 'file://ckpt/rel'",
        "checkpoint.start_from: a file:// path must be absolute (file:///path), got 'file://localhost/x'"]


@pytest.mark.parametrize(("path", "value"), [
    ("deadline_ts", -1e308), ("step_time_s_estimate", 5e-324), ("checkpoint.interval_s", 1e308),
    ("gpus_per_node", 2**64), ("total_steps", 2**60), ("budget_usd", float("inf")),
    ("checkpoint.save_s_estimate", 5e-324),  # found by the adversarial drill: an admin submit was accepted
])
def test_a_wire_spec_with_an_absurd_magnitude_is_refused(path: str, value: float) -> None:
    """What the adversarial fuzzer submitted through the admin API: every such value is a problem."""
    good = msgspec.to_builtins(parse_jobspec(
        'name = "j"\ntotal_steps = 10\ngpu_type = "A100"\n[checkpoint]\nurl = "file:///ckpt"\n'))
    node = good
    *parents, leaf = path.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = value
    spec = msgspec.convert(good, JobSpec, strict=False)
    assert [p.split(":")[0] for p in spec_problems(spec)] == [path]


def test_a_relative_deadline_is_resolved_once_with_the_callers_now() -> None:
    spec = parse_jobspec(BASE.replace("[checkpoint]", 'deadline_in = "1d12h"\n[checkpoint]'), now=1_800_000_000.0)
    assert spec.deadline_ts == 1_800_000_000.0 + 36 * 3600
    with pytest.raises(JobSpecError, match="deadline_in: a relative deadline is resolved at submission"):
        parse_jobspec(BASE.replace("[checkpoint]", 'deadline_in = "72h"\n[checkpoint]'))
    for bad, why in (("72", "not a duration, got .72."), ("3 weeks", "not a duration"), ("0s", ".0s. is out of range"),
                     ("400d", ".400d. is out of range")):
        with pytest.raises(JobSpecError, match=f"deadline_in: {why}"):
            parse_jobspec(BASE.replace("[checkpoint]", f'deadline_in = "{bad}"\n[checkpoint]'), now=1e9)
    with pytest.raises(JobSpecError, match="deadline: give one of deadline, deadline_ts, deadline_in, got deadline_ts, "
                                           "deadline_in"):
        parse_jobspec(BASE.replace("[checkpoint]", 'deadline_ts = 1900000000\ndeadline_in = "2h"\n[checkpoint]'),
                      now=1e9)


def test_replicas_are_refused_for_a_trainer_script_and_bounded() -> None:
    """A Hugging Face Trainer script resumes from the durable checkpoint only (spot_train): replicas for it
    are refused at submit, by orchctl and by orchd alike; a Session script or the built-in trainer keep them."""
    hf = '[trainer]\ncommand = ["python", "train.py"]\nintegration = "hf"\n'
    with pytest.raises(JobSpecError) as e:
        parse_jobspec(BASE + "replica_every = 1\n" + hf)
    assert [p.split(":")[0] for p in e.value.problems] == ["checkpoint.replica_every"]
    assert parse_jobspec(BASE + hf).checkpoint.replica_every is msgspec.UNSET
    own = '[trainer]\ncommand = ["python", "my_session_script.py"]\n'
    assert parse_jobspec(BASE + "replica_every = 2\n" + own).checkpoint.replica_every == 2
    wire = msgspec.structs.replace(parse_jobspec(BASE), checkpoint=CheckpointPolicy(url="file:///c", replica_every=-1))
    assert [p.split(":")[0] for p in spec_problems(wire)] == ["checkpoint.replica_every"]
