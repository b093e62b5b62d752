"""Reading a checkpoint directory with DCP's loader: local files through torch's reader; object-store
files fetched whole (or in large blocks), not one ranged request per tensor slice."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import fsspec
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as _FsspecFS
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

from trainer import storage

__all__ = ["make_reader"]

WHOLE_READ_BYTES = 256 << 20  # an object-store file up to this size is fetched in one request
READ_BLOCK_BYTES = 64 << 20  # larger ones are read in blocks of this size


class _WholeFileFS(_FsspecFS):
    """Reads an object-store file in one request (blocks of READ_BLOCK_BYTES above WHOLE_READ_BYTES), not
    one ranged request per tensor: DCP's loader reads a shard file as many small slices, each a round trip
    through fsspec's default buffering."""

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[io.IOBase]:
        if "r" not in mode or "+" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        fs = cast(fsspec.AbstractFileSystem, self.fs)
        path = os.fspath(path)
        if fs.size(path) <= WHOLE_READ_BYTES:
            yield io.BytesIO(fs.cat_file(path))
        else:
            with fs.open(path, mode, block_size=READ_BLOCK_BYTES, cache_type="readahead") as stream:
                yield stream


def make_reader(dir_url: str, storage_options: dict[str, Any] | None = None) -> FileSystemReader:
    if storage.is_local(dir_url):
        return FileSystemReader(storage.local_path(dir_url))
    reader = FsspecReader(dir_url, **storage.prepare(dir_url, storage_options))
    whole = _WholeFileFS()
    whole.fs = cast(_FsspecFS, reader.fs).fs
    reader.fs = whole  # type: ignore[assignment]  # FileSystemReader declares a local FileSystem
    return reader
