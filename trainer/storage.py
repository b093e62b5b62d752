"""Checkpoint stores by URL: local files, ``s3://``, ``gs://``, ``az://`` through fsspec; no torch.

Role: the one place that turns a checkpoint URL and the job's ``storage_options`` into an fsspec filesystem,
for the trainer's writer and reader, for the root-ownership checks of the agent and orchd
(:mod:`trainer.rootowner`) and for :func:`create_if_absent`, the atomic create each store offers.

Options. ``storage_options`` is either one fsspec options dict for the checkpoint URL's store (endpoints,
``client_kwargs``, ...) or, for a job that moves between clouds, a dict per scheme (``{"s3": {...}, "gs":
{...}, "az": {...}}``): the options of the URL's scheme apply. Credentials never come from the job: each
store uses its SDK's default chain on the node.

  s3://bucket/prefix      botocore's chain: environment, ~/.aws files, the instance profile (IMDS)
  gs://bucket/prefix      google.auth.default(): GOOGLE_APPLICATION_CREDENTIALS, gcloud's application-
                          default file, the metadata server (``token`` in the options overrides it, e.g.
                          ``"anon"`` for an emulator)
  az://container/prefix   the account from AZURE_STORAGE_ACCOUNT_NAME (or ``account_name``) with
                          azure-identity's default chain (environment, managed identity, Azure CLI), or
                          AZURE_STORAGE_CONNECTION_STRING (or ``connection_string``)

A missing credential or account fails with :class:`StoreConfigError`, whose text names the store and what
was missing. gs:// uses gcsfs's JSON-API filesystem (``gcsfs.core.GCSFileSystem``), not the class gcsfs
exports by default: that one first asks the Storage Control API (gRPC) for the bucket's type, which an
emulator or a restricted service account never answers (a minute's wait per bucket). Zonal (Rapid)
buckets, which need gRPC, are therefore not supported as checkpoint stores.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import fsspec

SCHEMES = {"s3": "s3", "s3a": "s3", "gs": "gs", "gcs": "gs", "az": "az", "abfs": "az", "abfss": "az",
           "file": "file"}
_CREDENTIAL_ERRORS = {  # exception class names (any SDK's), without importing the SDKs
    "NoCredentialsError": "no AWS credentials (environment, ~/.aws files or an instance profile)",
    "PartialCredentialsError": "incomplete AWS credentials",
    "DefaultCredentialsError": "no Google credentials (GOOGLE_APPLICATION_CREDENTIALS, gcloud's application-"
                               "default credentials or the metadata server)",
    "CredentialUnavailableError": "no Azure credential (environment, managed identity or Azure CLI)",
    "ClientAuthenticationError": "Azure refused the credential",
}


class StoreConfigError(Exception):
    """A checkpoint store cannot be used as configured: the text names the store and what is missing."""


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    return url[len("file://") :] if url.startswith("file://") else url


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *parts])


def path_of(url: str) -> str:
    """The path fsspec filesystems take (no scheme for local paths)."""
    return local_path(url) if is_local(url) else url


def scheme(url: str) -> str:
    """The store of a URL: ``file``, ``s3``, ``gs`` or ``az``; StoreConfigError for any other."""
    if is_local(url):
        return "file"
    name = url.split("://", 1)[0].lower()
    if name not in SCHEMES:
        raise StoreConfigError(f"checkpoint store {url}: unsupported scheme {name!r} (file, s3, gs, az)")
    return SCHEMES[name]


def store_options(url: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """The fsspec options for ``url``: the per-scheme entry when ``storage_options`` has one per scheme,
    else the dict itself; gs:// gets google.auth's default chain unless a token is given."""
    opts = dict(storage_options or {})
    kind = scheme(url)
    per_scheme = {k: v for k, v in opts.items() if k in SCHEMES and isinstance(v, dict)}
    if per_scheme:
        if len(per_scheme) != len(opts):
            raise StoreConfigError(f"checkpoint store {url}: storage_options mixes per-scheme entries "
                                   f"({sorted(per_scheme)}) with plain options ({sorted(set(opts) - set(per_scheme))})")
        opts = dict(next((v for k, v in per_scheme.items() if SCHEMES[k] == kind), {}))
    if kind == "gs":
        opts.setdefault("token", "google_default")
    return opts


def _use_gcs_json_api() -> None:
    """gs:// and gcs:// through gcsfs's JSON-API class (see the module's docstring)."""
    import fsspec

    try:
        from gcsfs.core import GCSFileSystem
    except ImportError as e:
        raise StoreConfigError("checkpoint store gs://: gcsfs is not installed (pip install 'spot-orchestrator[gcp]')"
                               ) from e
    for name in ("gs", "gcs"):
        if fsspec.registry.get(name) is not GCSFileSystem:
            fsspec.register_implementation(name, GCSFileSystem, clobber=True)


def _check_azure(url: str, opts: dict[str, Any]) -> None:
    if any(opts.get(k) for k in ("connection_string", "account_name")) or opts.get("anon"):
        return
    if os.environ.get("AZURE_STORAGE_CONNECTION_STRING") or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME"):
        return
    raise StoreConfigError(
        f"checkpoint store {url}: no Azure storage account: set AZURE_STORAGE_ACCOUNT_NAME (credentials from "
        "azure-identity's default chain) or AZURE_STORAGE_CONNECTION_STRING on the node, or account_name in the "
        "job's storage_options")


def prepare(url: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """Resolve ``url``'s options and ready its fsspec implementation; StoreConfigError when it is unusable."""
    opts = store_options(url, storage_options)
    kind = scheme(url)
    if kind == "gs":
        _use_gcs_json_api()
    elif kind == "az":
        _check_azure(url, opts)
    return opts


def filesystem(url: str, storage_options: dict[str, Any] | None = None) -> fsspec.AbstractFileSystem:
    from fsspec.core import url_to_fs

    opts = prepare(url, storage_options)
    try:
        fs, _ = url_to_fs(path_of(url), **opts)
    except ImportError as e:
        raise StoreConfigError(f"checkpoint store {url}: its fsspec implementation is not installed: {e}") from e
    except Exception as e:
        raise explain(url, e) from e
    return fs


def listing(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    """The names under ``path`` as the store has them now: fsspec's listing cache (adlfs, s3fs, gcsfs keep one
    per filesystem instance, shared by every user in the process) would hide files written or deleted since."""
    forget(fs, path)
    return list(fs.ls(path, detail=False))


def forget(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Drop fsspec's cached listings of ``path`` (adlfs keys its cache by the path without the scheme only)."""
    fs.invalidate_cache(fs._strip_protocol(path))


def credential_problem(e: BaseException) -> str | None:
    """What credential was missing, when ``e`` (or its cause) is an SDK's credential error."""
    seen: BaseException | None = e
    for _ in range(8):
        if seen is None:
            return None
        for cls in type(seen).__mro__:
            if cls.__name__ in _CREDENTIAL_ERRORS:
                return f"{_CREDENTIAL_ERRORS[cls.__name__]}: {seen}"
        seen = seen.__cause__ or seen.__context__
    return None


def explain(url: str, e: BaseException) -> Exception:
    """The error to raise for a failed store operation: a StoreConfigError naming the store and the
    missing credential when that is the cause, else ``e`` itself."""
    if isinstance(e, StoreConfigError):
        return e
    if (problem := credential_problem(e)) is not None:
        return StoreConfigError(f"checkpoint store {url}: {problem}")
    if isinstance(e, ValueError) and "connection_string or account_name" in str(e):
        return StoreConfigError(f"checkpoint store {url}: no Azure storage account or credentials: {e}")
    return e if isinstance(e, Exception) else RuntimeError(repr(e))


def create_if_absent(url: str, body: bytes, storage_options: dict[str, Any] | None = None) -> bool:
    """Write ``body`` to ``url`` only if nothing is there, atomically: True when this call created it, False
    when it already existed (whoever wrote it). Local files: a complete temporary file linked into place
    (``link(2)`` fails with EEXIST like ``O_EXCL``, and no reader sees a half-written file); s3:
    ``If-None-Match: *``; gs: ``ifGenerationMatch=0``; az: ``If-None-Match: *``."""
    if is_local(url):
        return _create_local(local_path(url), body)
    fs = filesystem(url, storage_options)
    try:
        fs.pipe_file(url, body, mode="create")
    except FileExistsError:
        return False
    except Exception as e:
        raise explain(url, e) from e
    return True


def _create_local(path: str, body: bytes) -> bool:
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{id(body)}.tmp"
    with open(tmp, "wb") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    dfd = os.open(parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return True
