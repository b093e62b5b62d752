"""The parallel checkpoint writer (several files per rank, one thread each): what it writes verifies and
loads bit-exactly (in-process and with real gloo ranks, 1 and 2), torch.save's redundant zip CRC32 is not
computed, a failure in one writer thread fails the save as a storage error with nothing committed (in
the manager and in the trainer: exit 76), and s3 shards go up as multipart uploads."""

from __future__ import annotations

import io
import sys
import zipfile
from pathlib import Path

import crc32c
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from tests.trainer.helpers import GPT_CMD, REPO, Generation, trainer_env
from trainer import contract, store
from trainer.checkpoint import CheckpointManager, StorageError
from trainer.dist import DistInfo

SCRIPT = [sys.executable, str(REPO / "tests" / "trainer" / "scripts" / "parallel_save.py")]


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(64, 64, generator=g)
    return {"model": {f"w{i}": torch.randn(32 * (i + 1), 16, generator=g) for i in range(6)},
            "view": big[8:24],  # a view into a larger storage: only its own bytes are saved
            "meta": {"lr": 0.5, "names": ["a", "b"]},  # not a tensor: a BYTE_IO item
            "step": torch.tensor(seed)}


def _zeros_like(state: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
            "view": torch.zeros(16, 64), "meta": {"lr": 0.0, "names": []}, "step": torch.tensor(0)}


def test_parallel_files_checksummed_loadable_bitexact_without_zip_crc(tmp_path: Path) -> None:
    d = store.step_dir(f"file://{tmp_path}", 1)
    writer = store.CommitWriter(d, thread_count=4)
    writer.write_extra("__extra_0.pt", b"x")
    dcp.save(_state(1), storage_writer=writer)
    store.commit(d, 1, {"step": 1})
    path = Path(store.local_path(d))
    files = sorted(p.name for p in path.glob("*.distcp"))
    assert files == ["__0_0.distcp", "__0_1.distcp", "__0_2.distcp", "__0_3.distcp"]
    marker = store.read_marker(d)
    assert marker is not None and store.verify(d) is None
    for name in files:
        data = (path / name).read_bytes()
        assert marker["files"][name] == [len(data), crc32c.crc32c(data)]
    # every tensor record is a torch.save zip without its own CRC32 (CRC32C in the marker covers it)
    meta = FileSystemReader(str(path)).read_metadata()
    records = 0
    for info in meta.storage_data.values():
        blob = (path / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        if blob[:2] == b"PK":
            entries = zipfile.ZipFile(io.BytesIO(blob)).infolist()
            records += 1
            assert all(e.CRC == 0 for e in entries if "/data/" in e.filename), entries
    assert records == len(meta.storage_data) == 10  # 8 tensors, 2 objects (torch.save'd by DCP too)
    loaded = _zeros_like(_state(1))
    dcp.load(loaded, storage_reader=store.make_reader(d))
    want = _state(1)
    assert all(torch.equal(loaded["model"][k], v) for k, v in want["model"].items())
    assert torch.equal(loaded["view"], want["view"]) and loaded["meta"] == want["meta"]
    assert torch.serialization.get_crc32_options()  # the caller's thread keeps torch's default


def _info() -> DistInfo:
    return DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None,  # type: ignore[arg-type]
                    ckpt_group=None, save_group=None)  # type: ignore[arg-type]


def test_one_failing_writer_thread_fails_the_save_nothing_committed(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    mgr = CheckpointManager(f"file://{tmp_path}", _info(), keep=3, async_mode="off", thread_count=4)
    mgr.save(1, model, opt, {})
    # one of the four files of step 2 cannot be created (a directory is in the way): one thread fails
    (tmp_path / "step_000000002" / "__0_0.distcp").mkdir(parents=True)
    with pytest.raises(StorageError, match=r"^storage_error: .*IsADirectoryError"):
        mgr.save(2, model, opt, {})
    assert not (tmp_path / "step_000000002" / store.COMMIT_MARKER).exists()
    assert [s for s, _, c in store.list_checkpoints(f"file://{tmp_path}") if c] == [1]
    assert mgr.resolve("latest") == store.step_dir(f"file://{tmp_path}", 1)


def test_emergency_save_leaves_rotation_to_the_next_commit(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    mgr = CheckpointManager(f"file://{tmp_path}", _info(), keep=1, async_mode="off")
    committed = lambda: [s for s, _, c in store.list_checkpoints(f"file://{tmp_path}") if c]  # noqa: E731
    mgr.save(1, model, None, {})
    mgr.save(2, model, None, {}, reason="preemption_notice")  # timed to its marker: nothing deleted
    assert committed() == [1, 2]
    mgr.save(3, model, None, {}, reason="final")
    assert committed() == [3]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_real_ranks_parallel_save_loads_bitexact(tmp_path: Path, world_size: int) -> None:
    root = f"file://{tmp_path / 'ckpt'}"
    g = Generation([*SCRIPT, root, "4"], world_size, {"ORCH_COLLECTIVE_TIMEOUT_S": "30"})
    assert g.wait() == [0] * world_size, g.log()
    lines = [line for r in g.ranks for line in r.lines if line.startswith("parallel_save ")]
    assert len(lines) == world_size, g.log()
    for line in lines:
        fields = dict(kv.split("=") for kv in line.split()[1:])
        assert fields["files"] == "4" and fields["bitexact"] == "True" and fields["step"] == "7", line
        assert int(fields["tensors"]) > 10, line
    d = store.step_dir(root, 7)
    assert store.verify(d) is None
    assert len(list((tmp_path / "ckpt" / "step_000000007").glob("*.distcp"))) == 4 * world_size


@pytest.mark.slow
def test_trainer_exits_76_when_one_writer_thread_fails(tmp_path: Path) -> None:
    """2 real ranks, final save at step 2 with 4 files per rank; rank 1's third file cannot be created."""
    (tmp_path / "ckpt" / "step_000000002" / "__1_2.distcp").mkdir(parents=True)
    args = {"size": "tiny", "seq_len": 32, "global_batch": 4, "micro_batch": 2, "seed": 3, "async_ckpt": "off",
            "ckpt_threads": 4}
    g = Generation(GPT_CMD, 2, trainer_env(tmp_path, total_steps=2, args=args))
    assert g.wait() == [contract.EXIT_CHECKPOINT_FAILED] * 2, g.log()
    reasons = [r.reason for r in g.reports(contract.ExitReport)]
    assert len(reasons) == 2 and all(r.startswith("storage_error:") for r in reasons), reasons
    assert any("IsADirectoryError" in r for r in reasons), reasons
    assert not (tmp_path / "ckpt" / "step_000000002" / store.COMMIT_MARKER).exists()


@pytest.fixture(scope="module")
def moto_s3():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    opts = {"key": "testing", "secret": "testing",
            "client_kwargs": {"endpoint_url": f"http://{host}:{port}", "region_name": "us-east-1"}}
    import boto3

    s3 = boto3.client("s3", endpoint_url=opts["client_kwargs"]["endpoint_url"], region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    s3.create_bucket(Bucket="ckpt-par")
    try:
        yield opts, s3
    finally:
        server.stop()


def test_s3_shards_are_multipart_uploads_that_verify_and_load(moto_s3: tuple) -> None:
    opts, s3 = moto_s3
    d = store.step_dir("s3://ckpt-par/job", 3)
    g = torch.Generator().manual_seed(3)
    state = {"big": torch.randn(3 << 20, generator=g), "small": torch.randn(8, generator=g)}  # 12 MiB + 32 B
    writer = store.CommitWriter(d, opts, thread_count=2, part_size=5 << 20, upload_concurrency=4)
    writer.write_extra("__extra_0.pt", b"x")
    dcp.save(state, storage_writer=writer)
    store.commit(d, 1, {"step": 3}, opts)
    assert store.verify(d, opts) is None
    sizes = {}
    for name in ("__0_0.distcp", "__0_1.distcp"):
        head = s3.head_object(Bucket="ckpt-par", Key=f"job/step_000000003/{name}")
        sizes[name] = (head["ContentLength"], head["ETag"].strip('"').rpartition("-")[2])
    assert sizes["__0_0.distcp"][1] == "3", sizes  # the 12 MiB shard: 3 parts of <= 5 MiB
    assert sizes["__0_1.distcp"][0] < 5 << 20, sizes  # the small one: a single PUT
    loaded = {"big": torch.zeros(3 << 20), "small": torch.zeros(8)}
    dcp.load(loaded, storage_reader=store.make_reader(d, opts))
    assert torch.equal(loaded["big"], state["big"]) and torch.equal(loaded["small"], state["small"])


def test_writer_rejects_bad_settings(tmp_path: Path) -> None:
    for kwargs in ({"thread_count": 0}, {"part_size": 1 << 20}, {"upload_concurrency": 0}):
        with pytest.raises(ValueError, match="CommitWriter: thread_count"):
            store.CommitWriter(f"file://{tmp_path}", **kwargs)
