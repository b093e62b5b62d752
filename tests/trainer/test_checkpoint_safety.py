"""Checkpoint safety in-process (one rank, no process group): malformed commit markers and damaged files fall
back to the previous good checkpoint, 'no usable checkpoint' is explicit, the job id in the marker, roots,
extra state without pickle, storage errors during a save."""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer import contract, extra_state, store
from trainer.checkpoint import CheckpointManager, NoUsableCheckpoint, StorageError
from trainer.dist import DistInfo


def _info() -> DistInfo:
    return DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None,  # type: ignore[arg-type]
                    ckpt_group=None, save_group=None)  # type: ignore[arg-type]


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return model, opt


def _mgr(root: Path, job_id: str = "job-a") -> CheckpointManager:
    return CheckpointManager(f"file://{root}", _info(), keep=10, async_mode="off", job_id=job_id)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Committed checkpoints of steps 2 and 4 of job-a."""
    r = tmp_path / "ckpt"
    mgr = _mgr(r)
    model, opt = _model()
    for step in (2, 4):
        mgr.save(step, model, opt, {"data": {"next": step}, "user": {"k": [1, 2.5, "s"]}})
    return r


def _dir(root: Path, step: int) -> Path:
    return root / f"step_{step:09d}"


def _url(root: Path, step: int) -> str:
    return f"file://{_dir(root, step)}"


def _marker(root: Path, step: int) -> dict[str, Any]:
    return json.loads((_dir(root, step) / store.COMMIT_MARKER).read_text())


def _write_marker(root: Path, step: int, value: Any) -> None:
    (_dir(root, step) / store.COMMIT_MARKER).write_text(json.dumps(value))


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _damage(root: Path, step: int, how: str) -> None:
    d, marker = _dir(root, step), _marker(root, step)
    if how in ("list", "string", "empty_object", "empty_files_list", "empty_files_dict"):
        value = {"list": [], "string": "x", "empty_object": {}, "empty_files_list": {"files": []},
                 "empty_files_dict": {**marker, "files": {}}}[how]
        _write_marker(root, step, value)
    elif how == "not_json":
        (d / store.COMMIT_MARKER).write_bytes(b"\xff\x00{")
    elif how == "missing_file":
        (d / "__0_0.distcp").unlink()
    elif how == "bad_checksum":
        _flip(d / "__0_0.distcp")
    elif how == "metadata_tampered":
        _flip(d / ".metadata")
    elif how == "metadata_unlisted":  # the marker no longer covers .metadata (DCP would unpickle it unchecked)
        _write_marker(root, step, {**marker, "files": {k: v for k, v in marker["files"].items() if k != ".metadata"}})
    elif how == "extra_tampered":
        _flip(d / "__extra_0.pt")
    elif how == "unlisted_shard":  # a data file the marker does not cover
        (d / "__9_0.distcp").write_bytes(b"junk")
    elif how == "path_traversal":
        _write_marker(root, step, {**marker, "files": {**marker["files"], "../../etc/passwd": [1, 2]}})
    elif how == "step_mismatch":
        _write_marker(root, step, {**marker, "step": step + 100})
    elif how == "bad_entry":
        _write_marker(root, step, {**marker, "files": {**marker["files"], ".metadata": "x"}})
    else:
        raise AssertionError(how)


DAMAGE = ["list", "string", "empty_object", "empty_files_list", "empty_files_dict", "not_json", "missing_file",
          "bad_checksum", "metadata_tampered", "metadata_unlisted", "extra_tampered", "unlisted_shard",
          "path_traversal", "step_mismatch", "bad_entry"]


@pytest.mark.parametrize("how", DAMAGE)
def test_damaged_newest_falls_back_to_previous(root: Path, how: str, capsys: pytest.CaptureFixture[str]) -> None:
    _damage(root, 4, how)
    assert store.verify(_url(root, 4)) is not None
    mgr = _mgr(root)
    assert mgr.resolve("latest") == _url(root, 2)
    assert mgr.resolve(_url(root, 4)) == _url(root, 2)  # the URL orchd named is unusable: the previous one
    assert "checkpoint_fallback" in capsys.readouterr().out
    model, opt = _model()
    assert mgr.load(_url(root, 2), model, opt)["step"] == 2


@pytest.mark.parametrize("how", ["list", "string", "empty_files_list", "metadata_tampered"])
def test_every_checkpoint_damaged_is_an_explicit_failure(root: Path, how: str) -> None:
    _damage(root, 4, how)
    _damage(root, 2, "empty_object")
    mgr = _mgr(root)
    for resume in ("latest", _url(root, 4)):
        with pytest.raises(NoUsableCheckpoint) as e:
            mgr.resolve(resume)
        assert "step_000000004" in str(e.value) and "step_000000002" in str(e.value)


def test_fresh_root_is_a_fresh_start_only_for_latest(tmp_path: Path) -> None:
    mgr = _mgr(tmp_path / "empty")
    assert mgr.resolve("") is None and mgr.resolve("latest") is None
    with pytest.raises(NoUsableCheckpoint):
        mgr.resolve(f"file://{tmp_path / 'empty'}/step_000000007")  # named but absent: not a silent step 1


def test_new_marker_holds_the_job_id_and_extras_are_not_pickle(root: Path) -> None:
    marker = _marker(root, 4)
    assert marker["job_id"] == "job-a" and marker["format"] == store.FORMAT_VERSION
    assert "__extra_0.pt" in marker["files"] and not any(n.endswith(".pkl") for n in marker["files"])
    body = (_dir(root, 4) / "__extra_0.pt").read_bytes()
    assert zipfile.is_zipfile(io.BytesIO(body))  # torch.save's zip container
    extra = torch.load(io.BytesIO(body), weights_only=True)  # torch's restricted unpickler reads it
    assert extra["step"] == 4 and extra["user"] == {"k": [1, 2.5, "s"]}
    model, opt = _model()
    assert _mgr(root).load(_url(root, 4), model, opt)["data"] == {"next": 4}


def test_another_jobs_checkpoint_is_refused(root: Path) -> None:
    with pytest.raises(NoUsableCheckpoint, match="job 'job-a', not of 'job-b'"):
        _mgr(root, job_id="job-b").resolve("latest")
    # job-b's own older checkpoint under the same root is used, job-a's newer one is skipped
    _write_marker(root, 2, {**_marker(root, 2), "job_id": "job-b"})
    assert _mgr(root, job_id="job-b").resolve("latest") == _url(root, 2)


def test_old_marker_without_job_id_is_accepted_under_the_jobs_root(root: Path) -> None:
    old = {k: v for k, v in _marker(root, 4).items() if k != "job_id"}
    _write_marker(root, 4, old)
    assert _mgr(root, job_id="job-b").resolve("latest") == _url(root, 4)


def test_checkpoint_outside_the_jobs_root_is_refused(root: Path, tmp_path: Path) -> None:
    mine = _mgr(tmp_path / "mine", job_id="job-b")
    model, opt = _model()
    mine.save(1, model, opt, {})  # the job has committed under its own root: only that root counts
    for url in (_url(root, 4), f"file://{tmp_path / 'mine'}/../ckpt/step_000000004"):
        assert mine.resolve(url) == f"file://{tmp_path / 'mine'}/step_000000001"
        assert not mine._in_root(url)


def test_spec_start_from_before_the_first_commit_is_verified(root: Path, tmp_path: Path) -> None:
    """orchd's start_from (another job's checkpoint, named in the spec) before the job's own first commit:
    root and job id checks are waived, verification is not."""
    fresh = _mgr(tmp_path / "fresh", job_id="job-b")
    assert fresh.resolve(_url(root, 4)) == _url(root, 4)
    assert fresh.resolve("latest") is None  # never searched for: only a named URL
    _damage(root, 4, "metadata_tampered")
    with pytest.raises(NoUsableCheckpoint, match="checksum mismatch in .metadata"):
        fresh.resolve(_url(root, 4))


def test_legacy_pickled_extra_is_read_without_arbitrary_globals(root: Path, tmp_path: Path) -> None:
    class Boom:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    with pytest.raises(extra_state.UnsafeExtraState):
        extra_state.decode("__extra_0.pkl", pickle.dumps({"step": 1, "x": Boom()}))
    legacy = {"step": 3, "rng": {"python": (3, tuple(range(625)), None)}, "od": __import__("collections").OrderedDict(),
              "t": torch.arange(4), "np": __import__("numpy").arange(3, dtype="uint32")}
    got = extra_state.decode("__extra_0.pkl", pickle.dumps(legacy))
    assert got["step"] == 3 and torch.equal(got["t"], torch.arange(4)) and got["np"].tolist() == [0, 1, 2]
    assert not (tmp_path / "pwned").exists()


def test_unpicklable_user_state_fails_at_save_time(tmp_path: Path) -> None:
    model, opt = _model()
    with pytest.raises(TypeError, match="plain containers"):
        _mgr(tmp_path / "c").save(1, model, opt, {"user": {"obj": object()}})


def test_storage_error_during_save_is_a_storage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = store._HashingFS.create_stream

    def full(self: Any, path: Any, mode: str) -> Any:
        if "w" in mode and str(path).endswith(".distcp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, path, mode)

    monkeypatch.setattr(store._HashingFS, "create_stream", full)
    model, opt = _model()
    with pytest.raises(StorageError) as e:
        _mgr(tmp_path / "c").save(1, model, opt, {})
    assert str(e.value).startswith(contract.STORAGE_ERROR_REASON) and "No space left on device" in str(e.value)
    assert store.read_marker(f"file://{tmp_path / 'c'}/step_000000001") is None  # never committed


def test_save_failure_reasons() -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    from trainer.checkpoint import save_failure

    enospc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert str(save_failure(enospc)).startswith("storage_error: OSError: [Errno 28]")
    wrapped = CheckpointException("save failed", {1: (enospc, None)})
    assert str(save_failure(wrapped)).startswith("storage_error: OSError: [Errno 28]")
    assert str(save_failure(CheckpointException("x", {0: (ValueError("v"), None)}))).startswith("storage_error:")
    assert str(save_failure(TypeError("bug"))).startswith("checkpoint_failed: TypeError: bug")
    assert save_failure(RuntimeError("Connection closed by peer")) is None  # EXIT_PEER_LOST
    assert save_failure(CheckpointException("x", {0: (RuntimeError("gloo timed out"), None)})) is None


def test_marker_step_for_the_agent() -> None:
    assert contract.commit_marker_step(b'{"step": 5, "files": {}}') == 5
    for body in (b"[]", b'"x"', b"{}", b'{"step": "5"}', b'{"step": true}', b'{"step": -1}', b"\xff"):
        assert contract.commit_marker_step(body) is None, body
