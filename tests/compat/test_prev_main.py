"""State, configs and checkpoints written by the previous main (cdee5b1) still load with today's code.

The fixtures in tests/fixtures/prev_main/ were produced by the old tree itself (see README.txt there and
capture.py, which also holds the continuation events and the checkpoint digest procedure used here):

- state: the JetStream KV values of a stopped old orchd. They are loaded the way orchd loads them at
  start-up (``Store.load``: raw records, outbox entries through ``decode_command``; then
  ``CoreApi.restore`` = ``state_from_records`` + today's config), compared with what the old code read
  from them, re-encoded byte for byte, and decided on: today's core makes the same decisions from that
  state as the old core did.
- configs: config/orchd.example.toml, config/clouds/*.toml, config/jobs/*, config/sweeps/* of cdee5b1 and some ORCH_*
  overrides give the values the old loaders gave; the cloud tables build their providers.
- checkpoint: a committed 2-rank DCP checkpoint of the old GPT trainer verifies, loads with the same
  model digest, and today's trainer resumes it with the losses the old trainer computed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import msgspec
import pytest

import wire as ev
from orchestrator import bus
from orchestrator.core import decide, inputs, job_step, state_from_records, state_to_records
from orchestrator.core.commands import SendToAgent
from orchestrator.core.model import AuditEntry
from orchestrator.core.records import all_keys
from orchestrator.daemon.coreapi import default_core
from orchestrator.daemon.records import decode_command, encode_command, outbox_key
from orchestrator.daemon.registry import PROVIDERS, build_providers
from orchestrator.daemon.store import Store
from orchestrator.jobspec import load_jobspec
from orchestrator.settings import load_settings
from orchestrator.sweeps.spec import load_sweepspec

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures" / "prev_main"


def _capture_module() -> ModuleType:
    """capture.py (stdlib-only at import): the continuation events and the digest script it used."""
    spec = importlib.util.spec_from_file_location("prev_main_capture", FIX / "capture.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CAPTURE = _capture_module()


def _json(rel: str) -> Any:
    return json.loads((FIX / rel).read_text())


def _as_json(value: Any) -> Any:
    """``value`` as JSON reads it back (tuples become lists), for comparing with the expected files."""
    return json.loads(json.dumps(value))


def _kv(bucket: str) -> dict[str, bytes]:
    return {k: v.encode() for k, v in _json(f"state/kv_{bucket}.json").items()}


# --- state ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def expected_state() -> dict[str, Any]:
    return _json("state/expected.json")


def test_state_records_decode_to_what_the_old_code_read(expected_state: dict[str, Any]) -> None:
    state = state_from_records(_kv(bus.KV_STATE))
    assert sorted(state.jobs.keys()) == sorted(expected_state["jobs"])
    for job_id, want in expected_state["jobs"].items():
        assert _as_json(CAPTURE.job_view(state, state.jobs[job_id], job_step, msgspec.to_builtins)) == want, job_id
    assert sorted(state.nodes.keys()) == sorted(expected_state["nodes"])
    for node_id, want in expected_state["nodes"].items():
        assert CAPTURE.node_view(state.nodes[node_id]) == want, node_id
    assert {name: CAPTURE.pool_view(p) for name, p in state.pools.items()} == expected_state["pools"]
    meta = expected_state["meta"]
    assert (state.meta.fencing_token, state.meta.node_seq, state.meta.launch_seq) == (
        meta["fencing_token"], meta["node_seq"], meta["launch_seq"])
    assert list(state.meta.budget_jobs) == meta["budget_jobs"]
    assert _as_json(msgspec.to_builtins(state.meta.config)) == meta["config"]

    # the scenario the old orchd went through, spelled out
    job = state.jobs[CAPTURE.JOB_ID]
    assert (str(job.phase), job.committed_step, job_step(state, job.job_id)) == ("checkpointing", 200, 230)
    assert sorted(str(state.nodes[n].phase) for n in job.nodes) == ["booting", "noticed", "running"]
    assert str(state.jobs[CAPTURE.PENDING_JOB_ID].phase) == "pending"
    trials = sorted((j for j in state.jobs.values() if j.spec.sweep_id == CAPTURE.SWEEP_ID), key=lambda j: j.job_id)
    assert [j.job_id for j in trials] == [f"{CAPTURE.SWEEP_ID}-t{n:04d}" for n in range(CAPTURE.SWEEP_TRIALS)]
    assert all(j.spec.sweep_budget_usd == 5.0 and isinstance(j.spec.sweep_deadline_ts, float) for j in trials)
    tracked = state.jobs[CAPTURE.TRACKED_JOB_ID]
    assert isinstance(tracked.tracking_run_id, str) and tracked.tracking_run_id
    assert not isinstance(tracked.spec.tracking, msgspec.UnsetType) and tracked.spec.tracking.experiment == "compat"
    probing = [p for p in state.pools.values() if isinstance(p.probe_until, float)]
    assert [p.pool.instance_type for p in probing] == ["gpu.t4"] and probing[0].failures >= 2


def test_state_records_re_encode_to_the_same_bytes() -> None:
    records = _kv(bus.KV_STATE)
    state = state_from_records(records)
    assert sorted(all_keys(state)) == sorted(records)
    assert state_to_records(state) == records  # byte for byte: nothing is rewritten on the next persist
    assert state_from_records(state_to_records(state)) == state


def test_outbox_entries_decode_and_keep_their_keys(expected_state: dict[str, Any]) -> None:
    raw = _kv(bus.KV_OUTBOX)
    assert sorted(raw) == sorted(expected_state["outbox"]) and len(raw) == 2
    for key, data in raw.items():
        cmd = decode_command(data)
        want = expected_state["outbox"][key]
        assert isinstance(cmd, SendToAgent) and want["type"] == "SendToAgent"
        inner = cmd.command
        assert (type(inner).__name__, inner.node_id, inner.cmd_id, inner.fencing_token) == (
            want["inner"], want["node_id"], want["cmd_id"], want["fencing_token"])
        assert isinstance(inner, ev.CheckpointCmd) and inner.reason == "preemption_notice"
        assert encode_command(cmd) == data
        assert outbox_key(cmd) == key  # the result of the re-executed command deletes this very entry


def test_restore_applies_todays_settings_and_keeps_the_records() -> None:
    settings = load_settings(None, env={"ORCH_DAEMON__HEARTBEAT_TIMEOUT_S": "12", "ORCH_DAEMON__TICK_S": "0.25"})
    records = _kv(bus.KV_STATE)
    restored = default_core(settings).restore(records)
    assert (restored.config.heartbeat_timeout_s, restored.config.tick_s) == (12.0, 0.25)
    raw = state_from_records(records)
    assert (restored.jobs, restored.nodes, restored.pools) == (raw.jobs, raw.nodes, raw.pools)
    assert restored.meta.fencing_token == raw.meta.fencing_token


def test_todays_core_decides_like_the_old_core_from_the_old_state(expected_state: dict[str, Any]) -> None:
    state = state_from_records(_kv(bus.KV_STATE))
    now, events = CAPTURE.continuation_events(ev, inputs, state)
    got = _as_json(CAPTURE.run_continuation(decide, state_to_records, msgspec.to_builtins, state, now, events))
    want = expected_state["continuation"]
    assert [d["event"] for d in got] == [d["event"] for d in want]
    for g, w in zip(got, want, strict=True):
        # changed on purpose: a generation's rendezvous port has a fixed offset per job (two jobs whose
        # rank 0 share a host started on one port, lifecycle._port_offset), and a start names the cluster
        # (StartGenerationCmd.cluster_id: "" for a state that holds no identity yet); every other field is equal
        assert _without(_without(g, "master_port"), "cluster_id") == _without(w, "master_port"), g["event"]
    # the noticed node is terminated; the survivor starts generation 2 from the emergency checkpoint
    started = [c["command"] for d in got for c in d["commands"] if c["type"] == "send_to_agent"]
    assert [c["type"] for c in started] == ["start_generation"]
    assert started[0]["generation"] == 2 and started[0]["resume_from"].endswith("step_000000231")


def _without(value: Any, key: str) -> Any:
    """``value`` (JSON) with every ``key`` of every mapping in it removed."""
    if isinstance(value, dict):
        return {k: _without(v, key) for k, v in value.items() if k != key}
    if isinstance(value, list):
        return [_without(v, key) for v in value]
    return value


def test_audit_entries_decode_as_audit_entries() -> None:
    entries = _json("state/audit.json")
    decoded = [msgspec.convert(e, AuditEntry) for e in entries]
    assert {"submit", "launch", "start_generation", "checkpoint_committed", "checkpoint"} <= {
        e.action for e in decoded}
    assert _as_json([msgspec.to_builtins(e) for e in decoded]) == entries


def test_store_load_reads_the_old_buckets_from_jetstream(nats_server: Any) -> None:
    """The start-up path itself: the old values put into fresh buckets, ``Store.load``, ``restore``."""
    import nats

    state_kv, outbox_kv = _kv(bus.KV_STATE), _kv(bus.KV_OUTBOX)

    async def main() -> tuple[dict[str, bytes], dict[str, Any]]:
        nc = await nats.connect(nats_server.url)
        try:
            topo = await bus.ensure_topology(nc)  # this module's own server: the buckets are empty
            for key, value in state_kv.items():
                await topo.state_kv.put(key, value)
            for key, value in outbox_kv.items():
                await topo.outbox_kv.put(key, value)
            return await Store(topo).load()
        finally:
            await nc.close()

    records, outbox = anyio.run(main)
    assert records == state_kv
    assert {k: encode_command(c) for k, c in outbox.items()} == outbox_kv
    state = default_core(load_settings(None, env={})).restore(records)
    assert state.jobs[CAPTURE.JOB_ID].committed_step == 200
    assert len(state.nodes) == len(_json("state/expected.json")["nodes"])


# --- configs --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def expected_config() -> dict[str, Any]:
    return _json("config/expected.json")


def _fixture_path(rel: str) -> Path:
    return FIX / "config" / rel.removeprefix("config/")


def _subset(new: Any, old: Any, path: str = "") -> list[str]:
    """Where ``new`` differs from ``old`` on the keys ``old`` has (new sections/keys are allowed)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k, v in old.items():
            out += [f"{path}.{k}: missing"] if k not in new else _subset(new[k], v, f"{path}.{k}")
        return out
    return [] if new == old else [f"{path}: {new!r} != {old!r}"]


SETTINGS_FILES = [r for r in CAPTURE.CONFIG_FILES if not r.startswith(("config/jobs/", "config/sweeps/"))]


@pytest.mark.parametrize("rel", SETTINGS_FILES)
def test_settings_files_load_to_the_old_values(rel: str, expected_config: dict[str, Any]) -> None:
    settings = load_settings(_fixture_path(rel), env={})
    assert _subset(_as_json(dataclasses.asdict(settings)), expected_config["settings"][rel]) == []


@pytest.mark.parametrize("case", sorted(CAPTURE.ENV_CASES))
def test_env_overrides_load_to_the_old_values(case: str, expected_config: dict[str, Any]) -> None:
    want = expected_config["env"][case]
    settings = load_settings(_fixture_path("config/orchd.example.toml"), env=want["env"])
    assert _subset(_as_json(dataclasses.asdict(settings)), want["settings"]) == []


@pytest.mark.parametrize("rel", [r for r in CAPTURE.CONFIG_FILES if r.startswith("config/jobs/")])
def test_job_specs_load_to_the_old_values(rel: str, expected_config: dict[str, Any]) -> None:
    spec = load_jobspec(_fixture_path(rel))
    assert _subset(_as_json(msgspec.to_builtins(spec)), expected_config["jobs"][rel]) == []


@pytest.mark.parametrize("rel", [r for r in CAPTURE.CONFIG_FILES if r.startswith("config/sweeps/")])
def test_sweep_files_load_to_the_old_values(rel: str, expected_config: dict[str, Any]) -> None:
    spec, _text = load_sweepspec(_fixture_path(rel))
    assert _subset(_as_json(msgspec.to_builtins(spec)), expected_config["sweeps"][rel]) == []


@pytest.mark.parametrize("rel", SETTINGS_FILES)
def test_provider_tables_build_their_providers(rel: str) -> None:
    settings = load_settings(_fixture_path(rel), env={})
    missing = [name for name in settings.providers.enabled if not all(map(_installed, PROVIDERS[name][1]))]
    if missing:
        pytest.skip(f"SDK not installed for {missing}")
    providers = build_providers(settings)  # from_settings of every enabled table; no network
    assert sorted(providers) == sorted(settings.providers.enabled)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


# --- checkpoint -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def expected_ckpt() -> dict[str, Any]:
    return _json("checkpoint/expected.json")


@pytest.fixture
def ckpt_root(tmp_path: Path) -> Path:
    pytest.importorskip("torch")
    root = tmp_path / "ckpt"
    shutil.copytree(FIX / "checkpoint" / "ckpt", root)
    return root


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    from trainer.launch import free_port

    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1",
            "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **extra}


def test_checkpoint_is_intact_and_verifies(ckpt_root: Path, expected_ckpt: dict[str, Any]) -> None:
    from trainer import store

    step_dir = ckpt_root / expected_ckpt["step_dir"]
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in step_dir.iterdir()} == expected_ckpt["sha256"]
    url = f"file://{step_dir}"
    assert store.list_checkpoints(f"file://{ckpt_root}") == [(expected_ckpt["step"], url, True)]
    assert store.verify(url) is None
    marker = store.read_marker(url)
    assert marker is not None
    assert (marker["step"], marker["world_size"], sorted(marker["files"])) == (
        expected_ckpt["step"], expected_ckpt["saved_world_size"], expected_ckpt["files"])


@pytest.mark.slow
def test_checkpoint_loads_with_the_same_model_digest(ckpt_root: Path, expected_ckpt: dict[str, Any],
                                                      tmp_path: Path) -> None:
    step_url = f"file://{ckpt_root / expected_ckpt['step_dir']}"
    args = expected_ckpt["trainer_args"]
    run = subprocess.run([sys.executable, "-c", CAPTURE.DIGEST_SCRIPT, f"file://{ckpt_root}", step_url,
                          args["size"], str(args["seq_len"])],
                         env=_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    loaded = json.loads(run.stdout.strip().splitlines()[-1])
    assert loaded == {"chosen": step_url, "step": expected_ckpt["step"],
                      "world_size": expected_ckpt["saved_world_size"], "digest": expected_ckpt["model_digest"]}


@pytest.mark.slow
def test_trainer_resumes_it_with_the_old_losses(ckpt_root: Path, expected_ckpt: dict[str, Any],
                                                tmp_path: Path) -> None:
    from trainer import contract

    step_url = f"file://{ckpt_root / expected_ckpt['step_dir']}"
    (tmp_path / "control").mkdir()
    env = _env(tmp_path, **{
        contract.ENV_CKPT_URL: f"file://{ckpt_root}", contract.ENV_RESUME_FROM: step_url,
        contract.ENV_TOTAL_STEPS: str(expected_ckpt["continue_to"]),
        contract.ENV_CONTROL_DIR: str(tmp_path / "control"),
        contract.ENV_STEP_LOG: str(tmp_path / "steps.jsonl"), contract.ENV_GENERATION: "1",
        contract.ENV_COLLECTIVE_TIMEOUT_S: "60", contract.ENV_TRAINER_ARGS: json.dumps(expected_ckpt["trainer_args"]),
    })
    run = subprocess.run([sys.executable, "-m", "trainer"], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == contract.EXIT_COMPLETED, run.stdout + run.stderr
    assert f"resumed_from dir={step_url} step={expected_ckpt['step']} saved_world_size=2 world_size=1" in run.stdout
    records = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines() if line.strip()]
    losses = {str(r["step"]): r["loss"] for r in records}
    # the same model, optimizer, scheduler, data position and RNG as the old trainer's continuation: equal
    # losses (bit for bit on the capturing machine; a CPU with other vector units may round differently)
    assert losses == pytest.approx(expected_ckpt["losses"], rel=1e-5, abs=0.0)
