"""A job that moves between clouds, with real gloo ranks of the built-in trainer: two ranks on a node
configured for GCP write their checkpoints to gs:// (gcp-storage-emulator), an emergency checkpoint
included; the job resumes, resharded to one rank, on a node configured for Azure (Azurite's connection
string in its environment), reading the same gs:// URL, and finishes there, every sample once. Another job
refused on that root: test_root_owner.py (every store, in-process) and test_checkpoint_exits.py (a rank's
exit)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.storage_emulators import Store
from tests.trainer.helpers import GPT_CMD, Generation, step_records, trainer_env
from trainer import contract, rootowner, store

pytestmark = pytest.mark.slow  # real multi-process generations (run in CI too)

ARGS = {"size": "tiny", "seq_len": 32, "global_batch": 4, "micro_batch": 2, "lr": 3e-3, "warmup_steps": 2, "seed": 3}


def test_job_moves_from_gcs_node_to_azure_node_reading_its_gs_checkpoint(
        tmp_path: Path, object_stores: Callable[[str], Store]) -> None:
    gs, az = object_stores("gs"), object_stores("az")
    root = gs.url(f"moves/{uuid.uuid4().hex[:8]}")
    args = {**ARGS, "ckpt_every": 3, "storage_options": {"gs": gs.options, "az": az.options}}  # endpoints only
    job = {contract.ENV_JOB_ID: "job-x", contract.ENV_CLUSTER_ID: "cluster-1"}
    total = 6

    g = Generation(GPT_CMD, 2, trainer_env(tmp_path, total_steps=total, args=args, ckpt_url=root, extra=job))
    g.wait_step(3)
    g.request_checkpoint(tmp_path / "control0")
    assert g.wait() == [contract.EXIT_PREEMPTED] * 2, g.log()
    stop = g.reports(contract.CheckpointReport)[-1].step
    azure_node = {**job, "AZURE_STORAGE_CONNECTION_STRING": az.options["connection_string"]}
    g = Generation(GPT_CMD, 1, trainer_env(tmp_path, total_steps=total, args=args, ckpt_url=root, resume="latest",
                                           generation=1, extra=azure_node))
    assert g.wait() == [0], g.log()
    assert any(f"step_{stop:09d}" in line and "resumed_from" in line for line in g.ranks[0].lines), g.log()

    by_step: dict[int, list[int]] = {}
    for r in step_records(tmp_path / "steps.jsonl"):
        by_step.setdefault(r.step, []).extend(r.sample_ids)
    assert sorted(by_step) == list(range(1, total + 1))
    assert all(sorted(ids) == list(range((s - 1) * 4, s * 4)) for s, ids in by_step.items())
    entries = store.list_checkpoints(root, {"gs": gs.options})
    assert [s for s, _, c in entries if c][-1] == total
    assert all(store.verify(d, gs.options) is None for _, d, c in entries if c)
    owner = rootowner.read_owner(root, gs.options)
    assert owner is not None and (owner.job_id, owner.cluster_id) == ("job-x", "cluster-1")

