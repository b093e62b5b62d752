"""Checkpoint-root ownership enforced at the storage, on file, s3 (moto), gs (gcp-storage-emulator behind a
proxy that enforces ifGenerationMatch=0) and az (Azurite): two claimers at once, exactly one wins; roots
inside or above another job's root; roots of the previous release; the trainer refusing before any write;
orchd's check at submit; an operator's take-over; credentials missing."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.storage_emulators import Store
from trainer import rootowner, storage, store
from trainer.checkpoint import CheckpointManager
from trainer.dist import DistInfo


def _root(backend: Store) -> str:
    return backend.url(f"roots/{uuid.uuid4().hex[:10]}")


def test_two_claimers_at_once_exactly_one_wins(backend: Store) -> None:
    root = _root(backend)
    n = 6
    barrier = threading.Barrier(n)

    def claim(i: int) -> str:
        barrier.wait()
        try:
            return rootowner.claim(root, f"job-{i}", "cluster-1", backend.options).job_id
        except rootowner.RootOwned as e:
            return f"refused: {e}"

    with cf.ThreadPoolExecutor(n) as pool:
        results = list(pool.map(claim, range(n)))
    winners = [r for r in results if not r.startswith("refused")]
    assert len(winners) == 1, results
    owner = rootowner.read_owner(root, backend.options)
    assert owner is not None and owner.job_id == winners[0] and owner.cluster_id == "cluster-1"
    want = f"refused: checkpoint root {root} owned by job {winners[0]} of cluster cluster-1"
    assert all(r == want for r in results if r.startswith("refused")), results
    assert rootowner.claim(root, winners[0], "cluster-1", backend.options) == owner  # its other ranks/nodes
    with pytest.raises(rootowner.RootOwned, match=f"owned by job {winners[0]} of cluster cluster-1"):
        rootowner.claim(root, winners[0], "cluster-2", backend.options)  # the same job id of another cluster


def test_nested_roots_are_refused_both_ways(backend: Store) -> None:
    outer = _root(backend)
    root = storage.join(outer, "job-a")
    rootowner.claim(root, "job-a", "c1", backend.options)
    inside = rootowner.check_root_at_submit(storage.join(root, "sub"), "job-b", "c1", backend.options) or ""
    assert "lies inside the root" in inside and "of job job-a of cluster c1" in inside
    above = rootowner.check_root_at_submit(outer, "job-b", "c1", backend.options) or ""
    assert "lies above the root" in above and above.endswith(f"{storage.path_of(root).split('://')[-1]} of job job-a "
                                                             "of cluster c1"), above
    assert rootowner.check_root_at_submit(root, "job-a", "c1", backend.options) is None
    assert rootowner.check_root_at_submit(storage.join(outer, "job-b"), "job-b", "c1", backend.options) is None


def _legacy_checkpoint(backend: Store, root: str, step: int, job_id: str | None) -> None:
    """A committed checkpoint as the previous release wrote it: no owner marker (and, before format 2, no job id)."""
    d = store.step_dir(root, step)
    writer = store.CommitWriter(d, backend.options)
    writer.write_extra("__extra_0.pt", b"x")
    dcp.save({"w": torch.ones(2)}, storage_writer=writer)
    store.commit(d, 1, {"step": step, **({"job_id": job_id} if job_id else {})}, backend.options)


def test_roots_of_the_previous_release(backend: Store) -> None:
    named, anonymous = _root(backend), _root(backend)
    _legacy_checkpoint(backend, named, 3, "job-a")
    _legacy_checkpoint(backend, anonymous, 3, None)
    assert "holds committed checkpoints of job job-a" in (
        rootowner.check_root_at_submit(named, "job-b", "c1", backend.options) or "")
    assert rootowner.claim(named, "job-a", "c1", backend.options).job_id == "job-a"  # its own job adopts it
    assert "unknown job" in (rootowner.check_root_at_submit(anonymous, "job-b", "c1", backend.options) or "")
    with pytest.raises(rootowner.RootOwned, match="unknown job"):
        rootowner.claim(anonymous, "job-b", "c1", backend.options)
    assert rootowner.claim(anonymous, "job-b", "c1", backend.options, adopt=True).job_id == "job-b"  # resuming


def _info() -> DistInfo:
    return DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None,  # type: ignore[arg-type]
                    ckpt_group=None, save_group=None)  # type: ignore[arg-type]


def test_trainer_refuses_another_jobs_root_before_any_write(backend: Store) -> None:
    root = _root(backend)
    rootowner.claim(root, "job-a", "c1", backend.options)
    fs = storage.filesystem(root, backend.options)
    before = sorted(fs.find(storage.path_of(root)))
    mgr = CheckpointManager(root, _info(), async_mode="process", storage_options=backend.options, job_id="job-b")
    with pytest.raises(rootowner.RootOwned, match=f"checkpoint root {root} owned by job job-a of cluster c1"):
        mgr.claim_root("c1", adopt=True)
    anonymous = CheckpointManager(root, _info(), storage_options=backend.options, job_id="")
    with pytest.raises(rootowner.RootOwned, match="owned by job job-a of cluster c1 .this trainer has no ORCH_JOB_ID"):
        anonymous.claim_root("c1", adopt=False)
    storage.forget(fs, storage.path_of(root))
    assert sorted(fs.find(storage.path_of(root))) == before  # nothing written


def test_operator_take_over_is_recorded(backend: Store) -> None:
    root = _root(backend)
    rootowner.claim(root, "job-a", "lost-cluster", backend.options, now=100.0)
    with pytest.raises(ValueError, match="operator's name and a reason"):
        rootowner.take_over(root, "job-a", "new-cluster", backend.options, operator=" ", reason="x")
    owner = rootowner.take_over(root, "job-a", "new-cluster", backend.options, operator="alice",
                                reason="orchd state lost", now=200.0)
    again = rootowner.read_owner(root, backend.options)
    assert again == owner and owner.cluster_id == "new-cluster"
    assert owner.history == [{"job_id": "job-a", "cluster_id": "lost-cluster", "claimed_ts": 100.0,
                              "taken_over_ts": 200.0, "operator": "alice", "reason": "orchd state lost"}]
    assert rootowner.claim(root, "job-a", "new-cluster", backend.options) == owner


def test_malformed_owner_marker_refuses_everyone(backend: Store) -> None:
    root = _root(backend)
    url = storage.join(root, rootowner.OWNER_FILE)
    fs = storage.filesystem(url, backend.options)
    fs.makedirs(storage.path_of(root), exist_ok=True)
    fs.pipe_file(storage.path_of(url), b'{"job_id": 7}')
    assert "malformed owner marker" in (rootowner.check_root_at_submit(root, "job-a", "c1", backend.options) or "")


def test_gcs_emulator_does_not_enforce_if_generation_match(object_stores: Callable[[str], Store]) -> None:
    """The emulator's gap the proxy closes: straight to gcp-storage-emulator a second create succeeds. When this
    fails, the emulator enforces ifGenerationMatch=0 itself and the proxy's check can go."""
    gs = object_stores("gs")
    url = gs.url(f"gap/{uuid.uuid4().hex[:8]}")
    direct = gs.direct_options  # type: ignore[attr-defined]
    storage.filesystem(url, direct).invalidate_cache()
    assert storage.create_if_absent(url, b"one", direct) is True
    assert storage.create_if_absent(url, b"two", direct) is True
    assert storage.create_if_absent(url, b"three", gs.options) is False  # through the proxy: refused


def test_missing_credentials_name_the_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for k in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(storage.StoreConfigError, match="az://ckpt/job: no Azure storage account: set "
                                                       "AZURE_STORAGE_ACCOUNT_NAME"):
        rootowner.claim("az://ckpt/job", "job-a", "c1", {})
    # no ADC file, no metadata server (a closed port): google.auth's chain is exhausted
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")
    monkeypatch.setenv("GCE_METADATA_IP", "127.0.0.1:9")
    problem = rootowner.check_root_at_submit("gs://ckpt/job", "job-a", "c1", {"gs": {"skip_instance_cache": True}})
    assert problem is not None and problem.startswith("checkpoint store gs://ckpt/job: no Google credentials"), problem
    mixed = rootowner.check_root_at_submit("gs://b/j", "j", "c", {"gs": {}, "x": 1})
    assert "mixes per-scheme entries" in (mixed or "")
