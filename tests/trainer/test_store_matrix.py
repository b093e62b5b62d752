"""The checkpoint store on every backend, each against its emulator: local files, s3 (moto's server), gs
(gcp-storage-emulator) and az (Azurite). In-process, one rank: save with parallel files, checksums of the
bytes the store holds, commit marker created last and read back, rotation of the job's own checkpoints,
resume, a damaged marker or shard falling back, a refused write, a marker never replacing another job's.
The root owner claim and its race live in test_root_owner.py; real gloo ranks in test_cross_cloud.py."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.storage_emulators import Store
from trainer import storage, store
from trainer.checkpoint import CheckpointManager, NoUsableCheckpoint, StorageError
from trainer.dist import DistInfo


def _root(backend: Store) -> str:
    return backend.url(f"jobs/{uuid.uuid4().hex[:10]}")


def _info() -> DistInfo:
    return DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None,  # type: ignore[arg-type]
                    ckpt_group=None, save_group=None)  # type: ignore[arg-type]


def _model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    return model, opt


def _mgr(root: str, backend: Store, job_id: str = "job-a", keep: int = 10) -> CheckpointManager:
    mgr = CheckpointManager(root, _info(), keep=keep, async_mode="off", storage_options=backend.options,
                            thread_count=2, job_id=job_id)
    mgr.claim_root("cluster-1", adopt=False)
    return mgr


def _fs(backend: Store, url: str) -> Any:
    return storage.filesystem(url, backend.options)


def _write(backend: Store, url: str, data: bytes) -> None:
    _fs(backend, url).pipe_file(storage.path_of(url), data)


def test_save_commit_verify_rotate_resume(backend: Store) -> None:
    root = _root(backend)
    mgr = _mgr(root, backend, keep=2)
    other = store.step_dir(root, 1)  # another job's committed checkpoint under the root: never rotated away
    writer = store.CommitWriter(other, backend.options)
    writer.write_extra("__extra_0.pt", b"x")
    dcp.save({"w": torch.ones(3)}, storage_writer=writer)
    store.commit(other, 1, {"step": 1, "job_id": "job-b"}, backend.options)
    model, opt = _model()
    for step in (2, 3, 4):
        mgr.save(step, model, opt, {"data": {"next": step}})
    assert [(s, c) for s, _, c in store.list_checkpoints(root, backend.options)] == [(1, True), (3, True), (4, True)]
    d = store.step_dir(root, 4)
    marker = store.read_marker(d, backend.options)
    assert marker is not None and marker["job_id"] == "job-a" and marker["world_size"] == 1
    assert sum(n.endswith(".distcp") for n in marker["files"]) == max(mgr.thread_count, mgr.save_threads) > 1
    fs = _fs(backend, d)
    for name, (size, crc) in marker["files"].items():  # checksums taken while writing = the bytes stored
        data = fs.cat_file(storage.path_of(storage.join(d, name)))
        assert (len(data), crc32c.crc32c(data)) == (size, crc), name
    assert store.verify(d, backend.options) is None
    fresh = _mgr(root, backend)
    assert fresh.resolve("latest") == d
    model2, opt2 = _model(seed=1)
    extra = fresh.load(d, model2, opt2)
    assert extra["step"] == 4 and extra["data"] == {"next": 4}
    pairs = zip(model.state_dict().values(), model2.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], opt2.state_dict()["state"][0]["exp_avg"])


@pytest.mark.parametrize("damage", ["marker", "shard"])
def test_damaged_newest_falls_back(backend: Store, damage: str) -> None:
    root = _root(backend)
    mgr = _mgr(root, backend)
    model, opt = _model()
    for step in (2, 4):
        mgr.save(step, model, opt, {})
    d4 = store.step_dir(root, 4)
    if damage == "marker":
        _write(backend, storage.join(d4, store.COMMIT_MARKER), b'{"step": 4, "files": ')
    else:
        name = storage.join(d4, "__0_0.distcp")
        data = bytearray(_fs(backend, name).cat_file(storage.path_of(name)))
        data[len(data) // 2] ^= 1
        _write(backend, name, bytes(data))
    problem = store.verify(d4, backend.options)
    assert problem is not None and ("malformed commit marker" in problem if damage == "marker" else
                                    "checksum mismatch in __0_0.distcp" in problem)
    assert _mgr(root, backend).resolve("latest") == store.step_dir(root, 2)
    _write(backend, storage.join(store.step_dir(root, 2), store.COMMIT_MARKER), b"[]")
    with pytest.raises(NoUsableCheckpoint, match="step_000000002"):
        _mgr(root, backend).resolve("latest")


def test_refused_write_fails_the_save_nothing_committed(backend: Store, tmp_path: Path) -> None:
    """The store refuses a write (a full disk locally, a 403 from the object store): a storage error, no
    marker, and the previous checkpoint is still the one to resume from."""
    root = _root(backend)
    mgr = _mgr(root, backend)
    model, opt = _model()
    mgr.save(2, model, opt, {})
    refused = store.step_dir(root, 3)
    if backend.kind == "file":  # a root on a full filesystem: the step directory is a mount of /dev/full's kind
        mgr.storage_options = {}
        target = Path(storage.local_path(refused))
        target.mkdir(parents=True)
        (target / "__0_0.distcp").symlink_to("/dev/full")
    else:
        backend.refuse_writes(storage.path_of(refused).split("://", 1)[1].split("/", 1)[1] + "/__0_")
    with pytest.raises(StorageError, match="^storage_error: "):
        mgr.save(3, model, opt, {})
    assert store.read_marker(refused, backend.options) is None
    assert _mgr(root, backend).resolve("latest") == store.step_dir(root, 2)


def test_commit_marker_is_created_once_and_never_replaces_another_jobs(backend: Store) -> None:
    root = _root(backend)
    d = store.step_dir(root, 5)
    writer = store.CommitWriter(d, backend.options)
    writer.write_extra("__extra_0.pt", b"x")
    dcp.save({"w": torch.ones(3)}, storage_writer=writer)
    first = store.commit(d, 1, {"step": 5, "job_id": "job-a"}, backend.options)
    store.commit(d, 1, {"step": 5, "job_id": "job-a"}, backend.options)  # the same job saving the step again
    with pytest.raises(RuntimeError, match="holds a committed checkpoint of job 'job-a'"):
        store.commit(d, 1, {"step": 5, "job_id": "job-b"}, backend.options)
    marker = store.read_marker(d, backend.options)
    assert marker is not None and marker["job_id"] == "job-a" and marker["files"] == first["files"]


def test_create_if_absent_is_exclusive(backend: Store) -> None:
    url = storage.join(_root(backend), "x.json")
    assert storage.create_if_absent(url, b"one", backend.options) is True
    assert storage.create_if_absent(url, b"two", backend.options) is False
    assert bytes(_fs(backend, url).cat_file(storage.path_of(url))) == b"one"
