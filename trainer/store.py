"""Checkpoint storage: DCP writer that checksums while writing, commit markers, verify, list, rotate.

Role: the byte-level half of the checkpoint manager. One checkpoint is a directory
``<root>/step_<step:09d>/`` holding the DCP files (``__<rank>_<n>.distcp``, ``.metadata``), one small
``__extra_<rank>.pt`` per rank (step, data position, scheduler, RNG, config; torch.save of plain
containers and tensors, read back with ``weights_only=True``; ``.pkl`` in the previous release), one
checksum manifest per rank (``__crc_<rank>.json``, written by that rank right after its data files) plus
``__crc_meta.json`` (the ``.metadata`` file's), and, written last by rank 0, the commit marker
``COMMITTED``: JSON that lists every file with its size and CRC32C, plus the job id. A directory
without a well-formed marker (:func:`parse_marker`) does not exist as a checkpoint; nothing in it is
read before :func:`verify` checked every file the loader reads (DCP's ``.metadata``, which DCP
unpickles, included).

Checksums are computed on the bytes as they are written, never by re-reading. Each rank writes its
items as ``thread_count`` files of about equal size, one thread each, in DCP's layout (the stock loader
reads them): local files start writeback as they grow and are fsynced by their thread; object-store
files are uploaded in one go (s3: multipart, parts in parallel). torch.save's own zip CRC32 (redundant)
is off in those threads. The writer is picklable: sync, thread- and process-based async saves alike.

Stores: trainer.storage (``s3://``, ``gs://``, ``az://`` via fsspec; ``file://`` and plain paths via torch's local
FileSystem, fsync per file). Concurrency: only the checksum sink is shared (writer threads; locked).
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import json
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any, cast

import crc32c
import fsspec
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as _FsspecFS
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemBase, _StorageInfo
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future
from torch.utils.serialization import config as _torch_save_config

from trainer import contract, storage
from trainer.reader import make_reader  # noqa: F401  (store.make_reader: its callers)

COMMIT_MARKER = contract.CHECKPOINT_COMMIT_MARKER
FORMAT_VERSION = 2  # 2: job_id in the marker, extra state as __extra_<rank>.pt (no pickle); 1 still loads
_STEP_DIR = re.compile(r"^step_(\d{9})$")


is_local, local_path, join, _path, filesystem = (storage.is_local, storage.local_path, storage.join, storage.path_of,
                                                 storage.filesystem)


def step_dir(root_url: str, step: int) -> str:
    return join(root_url, contract.CHECKPOINT_DIR_FORMAT.format(step=step))


def step_of(name: str) -> int | None:
    """The step of a checkpoint directory name (``step_000000120`` -> 120), None for any other name."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


# --- writing --------------------------------------------------------------------------------------


class _ChecksumSink:
    """Thread-safe {file name: (size, crc32c)}; picklable (the lock is recreated)."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def record(self, name: str, size: int, crc: int) -> None:
        with self._lock:
            self.files[name] = (size, crc)

    def __getstate__(self) -> dict[str, Any]:
        return {"files": dict(self.files)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.files = state["files"]
        self._lock = threading.Lock()


class _HashingStream(io.RawIOBase):
    """Forwards writes to ``raw`` and updates size and CRC32C on the way."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self.raw = raw
        self.size = 0
        self.crc = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        self.crc = crc32c.crc32c(mv, self.crc)
        self.size += mv.nbytes
        written = self.raw.write(mv)
        return mv.nbytes if written is None else written

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        self.raw.flush()  # DCP fsyncs fileno() before closing: buffered bytes must reach the fd first
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:  # DCP closes inside create_stream; the inner context closes raw
        if not self.closed:
            self.raw.flush()
        super().close()


class _HashingFS(FileSystemBase):
    """Wraps a DCP FileSystem: every file opened for writing is checksummed into ``sink``."""

    def __init__(self, inner: FileSystemBase, sink: _ChecksumSink) -> None:
        self.inner = inner
        self.sink = sink

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[io.IOBase]:
        with self.inner.create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = _HashingStream(raw)
            yield stream
            self.sink.record(os.path.basename(os.fspath(path)), stream.size, stream.crc)

    def concat_path(self, path: Any, suffix: str) -> Any:
        return self.inner.concat_path(path, suffix)

    def rename(self, path: Any, new_path: Any) -> None:
        """DCP renames only its small ``.metadata.tmp``: on object stores a read and a write (no move API needed)."""
        if not isinstance(self.inner, _FsspecFS):
            self.inner.rename(path, new_path)
            return
        fs = cast(Any, self.inner).fs
        fs.pipe_file(str(new_path), fs.cat_file(str(path)))
        fs.rm_file(str(path))

    def init_path(self, path: Any, **kwargs: Any) -> Any:
        return self.inner.init_path(path, **kwargs)

    def mkdir(self, path: Any) -> None:
        self.inner.mkdir(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def exists(self, path: Any) -> bool:
        return self.inner.exists(path)

    def rm_file(self, path: Any) -> None:
        self.inner.rm_file(path)


@contextmanager
def _no_zip_crc32() -> Iterator[None]:
    """torch.save's zip CRC32 of every record (a second pass, 0.3 s CPU/GiB here, redundant with CRC32C): off
    in this thread only (torch's config is thread-local); torch.load reads records with or without it."""
    saved = _torch_save_config.save.compute_crc32
    _torch_save_config.save.compute_crc32 = False
    try:
        yield
    finally:
        _torch_save_config.save.compute_crc32 = saved


def _item_bytes(item: WriteItem) -> int:
    td = item.tensor_data
    return 0 if td is None else int(td.size.numel()) * td.properties.dtype.itemsize


def _buckets(items: list[WriteItem], n: int) -> list[list[WriteItem]]:
    """Items into ``n`` files of about equal size (largest first into the lightest file)."""
    buckets: list[list[WriteItem]] = [[] for _ in range(n)]
    sizes = [0] * n
    for item in sorted(items, key=_item_bytes, reverse=True):
        i = sizes.index(min(sizes))
        buckets[i].append(item)
        sizes[i] += max(_item_bytes(item), 1)
    return buckets


def _write_items(stream: _HashingStream, name: str, items: list[WriteItem], planner: Any,
                 kick: bool = False) -> list[WriteResult]:
    """``kick`` (local files): start writeback every 32 MiB (fadvise), not all at the final fsync."""
    out, kicked = [], 0
    for item in items:
        if kick and stream.size - kicked >= 32 << 20:
            os.posix_fadvise(stream.fileno(), kicked, stream.size - kicked, os.POSIX_FADV_DONTNEED)
            kicked = stream.size
        offset = stream.size
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            stream.write(data.getbuffer())
        else:
            tensor = data.detach().cpu()
            if tensor.untyped_storage().size() != tensor.nbytes:  # a view: save only its own bytes
                tensor = tensor.clone()
            torch.save(tensor, cast(IO[bytes], stream))
        length = stream.size - offset
        out.append(WriteResult(index=item.index, size_in_bytes=length,
                               storage_data=_StorageInfo(name, offset, length)))
    return out


class CommitWriter(FileSystemWriter):
    """DCP storage writer for one checkpoint directory; records CRC32C of every file it writes and
    leaves per-rank manifests that :func:`commit` merges into the commit marker."""

    def __init__(self, dir_url: str, storage_options: dict[str, Any] | None = None, *, thread_count: int = 1,
                 sync_files: bool = True, cache_staged_state_dict: bool = False, part_size: int = 64 << 20,
                 upload_concurrency: int = 8) -> None:
        if thread_count < 1 or part_size < 5 << 20 or upload_concurrency < 1:
            raise ValueError(f"CommitWriter: thread_count ({thread_count}) and upload_concurrency "
                             f"({upload_concurrency}) must be >= 1, part_size ({part_size}) >= 5 MiB")
        self.part_size, self.upload_concurrency = part_size, upload_concurrency
        self.local = local = is_local(dir_url)
        super().__init__(local_path(dir_url) if local else dir_url, thread_count=thread_count,
                         sync_files=sync_files and local,  # object stores: a completed PUT is durable
                         cache_staged_state_dict=cache_staged_state_dict)
        inner: FileSystemBase = FileSystem() if local else _FsspecFS()
        self.sink = _ChecksumSink()
        self.hashing_fs = _HashingFS(inner, self.sink)
        # FileSystemWriter declares ``fs`` as its local FileSystem but calls only FileSystemBase methods
        self.fs = cast(FileSystem, self.hashing_fs)
        target = local_path(dir_url) if local else dir_url  # the base class mangled "s3://" into a Path
        opts = {} if local else storage.prepare(dir_url, storage_options)
        self.path = self.hashing_fs.init_path(target, **opts)
        self.hashing_fs.mkdir(self.path)

    def write_extra(self, name: str, payload: bytes) -> None:
        """A small side file (extra state), checksummed like the DCP files."""
        with self.hashing_fs.create_stream(self.hashing_fs.concat_path(self.path, name), "wb") as f:
            f.write(payload)
            if self.sync_files:  # fileno() flushes first
                os.fsync(f.fileno())

    def _write_manifest(self, name: str, files: dict[str, tuple[int, int]]) -> None:
        body = json.dumps({n: list(v) for n, v in sorted(files.items())}).encode()
        with self.hashing_fs.inner.create_stream(self.hashing_fs.concat_path(self.path, name), "wb") as f:
            f.write(body)

    def write_data(self, plan: Any, planner: Any) -> Future[list[WriteResult]]:
        """This rank's items in ``thread_count`` files, one thread each, checksummed as written and fsynced; a
        failure in any thread fails the save once the others are done (nothing committed); then the manifest."""
        buckets = [b for b in _buckets(plan.items, max(1, self.thread_count)) if b]
        with cf.ThreadPoolExecutor(len(buckets) or 1, thread_name_prefix="ckpt-write") as pool:
            futures = [pool.submit(self._write_file, f"{plan.storage_data.prefix}{i}.distcp", b, planner)
                       for i, b in enumerate(buckets)]
            cf.wait(futures)  # every thread done, then the first failure (if any) raises
            results = [r for f in futures for r in f.result()]
        rank = self.rank if self.rank is not None else 0
        own = {n: v for n, v in self.sink.files.items() if not n.startswith(".metadata")}
        self._write_manifest(f"__crc_{rank}.json", own)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_file(self, name: str, items: list[WriteItem], planner: Any) -> list[WriteResult]:
        """One data file in DCP's layout (items at their offsets: BYTE_IO raw, tensors as ``torch.save``)."""
        path = self.hashing_fs.concat_path(self.path, name)
        if self.local:
            with _no_zip_crc32(), self.hashing_fs.create_stream(path, "wb") as stream:
                out = _write_items(cast(_HashingStream, stream), name, items, planner, kick=self.sync_files)
                if self.sync_files:
                    os.fsync(stream.fileno())
            return out
        buf = io.BytesIO()  # object store: the file in memory, then one upload (parallel multipart on s3)
        stream = _HashingStream(buf)
        with _no_zip_crc32():
            out = _write_items(stream, name, items, planner)
        fs = cast(Any, self.hashing_fs.inner).fs
        kind = storage.scheme(str(path))  # per store: s3 multipart and az blocks in parallel, gs resumable chunks
        opts: dict[str, Any] = {"s3": {"chunksize": self.part_size, "max_concurrency": self.upload_concurrency},
                                "az": {"max_concurrency": self.upload_concurrency},
                                "gs": {"chunksize": self.part_size}}.get(kind, {})
        fs.pipe_file(str(path), buf.getvalue(), **opts)
        self.sink.record(name, stream.size, stream.crc)
        return out

    def finish(self, metadata: Any, results: Any) -> None:
        super().finish(metadata, results)
        size, crc = self.sink.files[".metadata.tmp"]
        self._write_manifest("__crc_meta.json", {".metadata": (size, crc)})


# --- commit, verify, list, rotate ------------------------------------------------------------------


def commit(dir_url: str, world_size: int, meta: dict[str, Any],
           storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rank 0, after every rank's data is durable: merge manifests, write the commit marker last."""
    fs = filesystem(dir_url, storage_options)
    base = _path(dir_url)
    files: dict[str, list[int]] = {}
    for name in [f"__crc_{r}.json" for r in range(world_size)] + ["__crc_meta.json"]:
        with fs.open(join(base, name), "rb") as f:
            files.update(json.loads(f.read()))
    if ".metadata" not in files or not any(n.endswith(".distcp") for n in files):
        raise RuntimeError(f"incomplete checkpoint in {dir_url}: {sorted(files)}")
    marker = {"format": FORMAT_VERSION, "world_size": world_size, "committed_ts": time.time(), "files": files, **meta}
    body = json.dumps(marker, sort_keys=True).encode()
    if (problem := parse_marker(body, dir_url)[1]) is not None:  # never commit what a loader would refuse
        raise RuntimeError(f"refusing to commit {dir_url}: {problem}")
    _write_marker(dir_url, body, meta.get("job_id"), storage_options)
    return marker


def _write_marker(dir_url: str, body: bytes, job_id: str | None, storage_options: dict[str, Any] | None) -> None:
    """The commit marker, created only if absent (one atomic create on every store), then read back: the
    commit counts only once the store returns these bytes. A marker already there is replaced only when it
    is this job's own (the same step saved again); another job's committed checkpoint is never touched."""
    target = join(dir_url, COMMIT_MARKER)
    if not storage.create_if_absent(target, body, storage_options):
        existing, _ = marker_problem(dir_url, storage_options)
        owner = (existing or {}).get("job_id")
        if existing is not None and owner is not None and owner != job_id:
            raise RuntimeError(f"refusing to commit {dir_url}: it holds a committed checkpoint of job {owner!r}")
        if is_local(dir_url):
            tmp = f"{local_path(target)}.tmp"
            with open(tmp, "wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, local_path(target))
        else:
            filesystem(dir_url, storage_options).pipe_file(target, body)  # one PUT: atomic on object stores
    fs = filesystem(dir_url, storage_options)
    with fs.open(_path(target), "rb") as f:
        if f.read() != body:
            raise RuntimeError(f"commit marker of {dir_url} reads back different bytes: not committed")


_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$|^\.metadata$")
_EXTRA_NAMES = ("__extra_0.pt", "__extra_0.pkl")  # new (torch.save, weights_only) / previous release (pickle)


def _is_int(v: Any, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def parse_marker(body: bytes, dir_url: str | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """(marker, None) when ``body`` is a well-formed commit marker, else (None, why). Well-formed: a JSON
    object with an integer ``step`` (equal to the directory's step when ``dir_url`` names one), a
    ``world_size`` >= 1, an optional string ``job_id``, and ``files``: a non-empty object of plain file
    names -> [size, crc32c] that lists ``.metadata`` (DCP unpickles it), at least one ``.distcp`` and rank 0's
    extra-state file. Markers of the previous release (no ``job_id``) are well-formed."""
    try:
        marker = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return None, f"malformed commit marker: {e}"
    if not isinstance(marker, dict):
        return None, f"malformed commit marker: a JSON {type(marker).__name__}, not an object"
    step, ws, job, files = marker.get("step"), marker.get("world_size"), marker.get("job_id"), marker.get("files")
    if not _is_int(step) or not _is_int(ws, 1) or (job is not None and not isinstance(job, str)):
        return None, "malformed commit marker: step, world_size or job_id missing or invalid"
    if dir_url is not None and (m := _STEP_DIR.match(dir_url.rstrip("/").rsplit("/", 1)[-1])) and int(m[1]) != step:
        return None, f"malformed commit marker: step {step} in the directory of step {int(m[1])}"
    if not isinstance(files, dict) or not files:
        return None, "malformed commit marker: no files listed"
    for name, entry in files.items():
        if not _SAFE_NAME.match(name) or name in (".", ".."):
            return None, f"malformed commit marker: bad file name {name!r}"
        if not isinstance(entry, list) or len(entry) != 2 or not all(_is_int(v) for v in entry):
            return None, f"malformed commit marker: bad entry for {name}"
    if ".metadata" not in files or not any(n.endswith(".distcp") for n in files):
        return None, "malformed commit marker: .metadata or data files not listed"
    if not any(n in files for n in _EXTRA_NAMES):
        return None, "malformed commit marker: extra state not listed"
    return marker, None


def marker_problem(dir_url: str, storage_options: dict[str, Any] | None = None) -> tuple[dict[str, Any] | None, str]:
    """(marker, "") or (None, why the directory has no usable marker)."""
    fs = filesystem(dir_url, storage_options)
    try:
        with fs.open(join(_path(dir_url), COMMIT_MARKER), "rb") as f:
            body = f.read()
    except FileNotFoundError:
        return None, "no commit marker"
    except OSError as e:
        return None, f"unreadable commit marker: {e}"
    marker, problem = parse_marker(body, dir_url)
    return marker, problem or ""


def read_marker(dir_url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The well-formed commit marker of ``dir_url``, or None (missing or malformed)."""
    return marker_problem(dir_url, storage_options)[0]


def _file_crc(fs: fsspec.AbstractFileSystem, path: str) -> tuple[int, int]:
    size, crc = 0, 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            crc = crc32c.crc32c(chunk, crc)
            size += len(chunk)
    return size, crc


def _unlisted(fs: fsspec.AbstractFileSystem, base: str, files: dict[str, Any]) -> list[str]:
    """Files the loader would read (DCP data and metadata, extra state) that the marker does not cover."""
    names = [e.rstrip("/").rsplit("/", 1)[-1] for e in storage.listing(fs, base)]
    return sorted(n for n in names if (n == ".metadata" or n.endswith(".distcp") or n.startswith("__extra_"))
                  and n not in files)


def verify(dir_url: str, storage_options: dict[str, Any] | None = None, threads: int = 4) -> str | None:
    """None when the checkpoint has a well-formed commit marker, every listed file has its recorded size
    and CRC32C, and no file the loader reads is missing from the list; otherwise why it is unusable."""
    marker, problem = marker_problem(dir_url, storage_options)
    if marker is None:
        return problem
    fs = filesystem(dir_url, storage_options)
    base = _path(dir_url)
    files: dict[str, list[int]] = marker["files"]
    if unlisted := _unlisted(fs, base, files):
        return f"files not covered by the commit marker: {unlisted}"
    with cf.ThreadPoolExecutor(max_workers=threads) as pool:
        futures = {name: pool.submit(_file_crc, fs, join(base, name)) for name in files}
        for name, fut in futures.items():
            try:
                size, crc = fut.result()
            except FileNotFoundError:
                return f"missing file {name}"
            except OSError as e:
                return f"unreadable file {name}: {e}"
            if [size, crc] != list(files[name]):
                return f"checksum mismatch in {name}: size {size} crc {crc} != {files[name]}"
    return None


def list_checkpoints(root_url: str, storage_options: dict[str, Any] | None = None) -> list[tuple[int, str, bool]]:
    """(step, dir_url, committed) for every step directory under root, oldest first."""
    fs = filesystem(root_url, storage_options)
    root = _path(root_url)
    try:
        entries = storage.listing(fs, root)
    except FileNotFoundError:
        return []
    out = []
    for entry in entries:
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if m := _STEP_DIR.match(name):
            d = join(root_url, name)
            storage.forget(fs, _path(d))  # the marker as the store has it now
            out.append((int(m.group(1)), d, fs.exists(join(_path(d), COMMIT_MARKER))))
    return sorted(out)


def rotate(root_url: str, keep: int, storage_options: dict[str, Any] | None = None,
           job_id: str | None = None) -> list[str]:
    """Keep the newest ``keep`` committed checkpoints; drop older committed ones and uncommitted
    leftovers older than the newest committed one (never a newer one: it may be in flight).

    With ``job_id``, only what that job wrote counts: a checkpoint whose marker names another job is
    never deleted nor counted among the kept ones (markers of the previous release carry no job id and
    count as the job's own: its root was its own). The newest committed checkpoint that bounds the
    leftovers is the job's own too."""
    entries = list_checkpoints(root_url, storage_options)
    committed = [e for e in entries if e[2]]
    if job_id is not None:
        committed = [e for e in committed if (read_marker(e[1], storage_options) or {}).get("job_id", job_id) == job_id]
    if not committed:
        return []
    newest = committed[-1][0]
    doomed = [d for (_, d, _) in committed[:-keep]] if keep > 0 else []
    doomed += [d for (s, d, c) in entries if not c and s < newest]
    fs = filesystem(root_url, storage_options)
    for d in doomed:
        # the marker goes first so that a crash mid-delete never leaves a committed partial checkpoint
        marker = join(_path(d), COMMIT_MARKER)
        if fs.exists(marker):
            fs.rm(marker)
        fs.rm(_path(d), recursive=True)
    return doomed
