"""Checkpoint storage in-process (DCP without a process group): checksums computed while writing,
commit marker, verification of truncated/altered/missing files, rotation. The same on s3, gs and az
against their emulators: test_store_matrix.py."""

from __future__ import annotations

import os
from pathlib import Path

import crc32c
import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainer import store


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
            "step": torch.tensor(seed)}


def _save(dir_url: str, seed: int = 0, storage_options: dict | None = None) -> None:
    writer = store.CommitWriter(dir_url, storage_options)
    writer.write_extra("__extra_0.pkl", b"extra-%d" % seed)
    dcp.save(_state(seed), storage_writer=writer)
    store.commit(dir_url, 1, {"step": seed}, storage_options)


def test_checksums_recorded_while_writing_match_the_files(tmp_path: Path) -> None:
    d = store.step_dir(f"file://{tmp_path}", 1)
    _save(d, 1)
    marker = store.read_marker(d)
    assert marker is not None and marker["step"] == 1 and marker["world_size"] == 1
    assert {".metadata", "__0_0.distcp", "__extra_0.pkl"} <= set(marker["files"])
    for name, (size, crc) in marker["files"].items():
        data = (Path(store.local_path(d)) / name).read_bytes()
        assert (len(data), crc32c.crc32c(data)) == (size, crc), name
    assert store.verify(d) is None
    loaded = {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)}, "step": torch.tensor(0)}
    dcp.load(loaded, storage_reader=store.make_reader(d))
    assert torch.equal(loaded["model"]["w"], _state(1)["model"]["w"])


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "no_marker"])
def test_verify_detects_damage(tmp_path: Path, damage: str) -> None:
    d = store.step_dir(f"file://{tmp_path}", 3)
    _save(d, 3)
    shard = Path(store.local_path(d)) / "__0_0.distcp"
    data = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        i = len(data) // 2
        shard.write_bytes(data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :])
    elif damage == "delete":
        shard.unlink()
    else:
        (Path(store.local_path(d)) / store.COMMIT_MARKER).unlink()
    problem = store.verify(d)
    assert problem is not None
    assert ("__0_0.distcp" in problem) or damage == "no_marker"


def test_rotation_keeps_last_k_and_removes_stale_partials(tmp_path: Path) -> None:
    root = f"file://{tmp_path}"
    for step in (1, 2, 3, 4):
        _save(store.step_dir(root, step), step)
    os.makedirs(store.local_path(store.step_dir(root, 0)))  # an old partial (never committed)
    os.makedirs(store.local_path(store.step_dir(root, 9)))  # a newer one, maybe in flight: kept
    removed = store.rotate(root, keep=2)
    assert sorted(removed) == sorted(store.step_dir(root, s) for s in (0, 1, 2))
    assert [(s, c) for s, _, c in store.list_checkpoints(root)] == [(3, True), (4, True), (9, False)]


def test_rotation_deletes_only_what_the_job_wrote(tmp_path: Path) -> None:
    """A root that holds another job's checkpoints (written there before roots were exclusive, or by
    another deployment): rotation neither deletes them nor counts them among the kept ones."""
    root = f"file://{tmp_path}"

    def save_as(step: int, job: str | None) -> None:
        d = store.step_dir(root, step)
        writer = store.CommitWriter(d)
        writer.write_extra("__extra_0.pt", b"x")
        dcp.save(_state(step), storage_writer=writer)
        store.commit(d, 1, {"step": step, **({"job_id": job} if job else {})})

    for step, job in ((1, "other"), (2, None), (3, "mine"), (4, "other"), (5, "mine"), (6, "mine")):
        save_as(step, job)
    removed = store.rotate(root, keep=2, job_id="mine")
    assert sorted(removed) == sorted(store.step_dir(root, s) for s in (2, 3))  # the legacy one counts as its own
    assert [s for s, _, c in store.list_checkpoints(root) if c] == [1, 4, 5, 6]
    assert store.rotate(root, keep=1, job_id="nobody") == []  # nothing of its own: nothing deleted
