"""Who owns a checkpoint root, enforced at the storage: the owner marker, its claim, its checks; no torch.

A checkpoint root (the job's ``checkpoint.url``) belongs to one job of one cluster. The first write under
it claims it: ``<root>/OWNER.json`` (:data:`OWNER_FILE`) is created with the store's atomic
create-if-absent (:func:`trainer.storage.create_if_absent`) and names the job, the cluster's identity
(orchd generates it once and keeps it in its state; ranks get it as ``ORCH_CLUSTER_ID``) and when. Of two
claimers at once exactly one creates the marker; the other reads it back and is refused unless it is the
same job of the same cluster (another rank or node of the job).

Refused, each with a text that names the other job (:class:`RootOwned`):

- a root whose marker names another job or another cluster:
  ``checkpoint root <url> owned by job X of cluster Y``;
- a root inside another job's root, or above one (its marker lies under the root);
- a root without a marker (written by the previous release) that holds committed checkpoints of another
  job, or of an unknown job (markers of the first format name none) unless the claimer adopts it: a
  resumed job adopts its own root (``adopt``).

The trainer claims before its first write, the agent checks before it starts ranks, orchd checks at submit
(:func:`check_root_at_submit`). Taking over a root whose owner's state was lost is an operator's explicit
act (:func:`take_over`): the marker then keeps the previous owners, who took over, when and why.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from trainer import contract, storage

OWNER_FILE = "OWNER.json"
OWNER_FORMAT = 1


class RootOwned(Exception):
    """The checkpoint root may not be written by this job; the text says whose it is."""


@dataclass(frozen=True)
class Owner:
    job_id: str
    cluster_id: str
    claimed_ts: float
    history: list[dict[str, Any]] = field(default_factory=list)  # previous owners, newest last (take-overs)

    def is_of(self, job_id: str, cluster_id: str) -> bool:
        return self.job_id == job_id and self.cluster_id == cluster_id

    def describe(self) -> str:
        return f"job {self.job_id} of cluster {self.cluster_id or '(none)'}"

    def body(self) -> bytes:
        return json.dumps({"format": OWNER_FORMAT, **asdict(self)}, sort_keys=True).encode()


def parse_owner(body: bytes, url: str) -> Owner:
    """The owner a marker names; RootOwned when it is malformed (nobody may write a root with an unreadable claim)."""
    try:
        raw = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RootOwned(f"checkpoint root {url} has a malformed owner marker: {e}") from e
    if (not isinstance(raw, dict) or not isinstance(raw.get("job_id"), str) or not raw["job_id"]
            or not isinstance(raw.get("cluster_id"), str) or not isinstance(raw.get("claimed_ts"), int | float)
            or not isinstance(raw.get("history", []), list)):
        raise RootOwned(f"checkpoint root {url} has a malformed owner marker: {body[:200]!r}")
    return Owner(raw["job_id"], raw["cluster_id"], float(raw["claimed_ts"]), list(raw.get("history", [])))


def _cat(fs: Any, path: str) -> bytes | None:
    """The bytes at ``path`` read fresh from the store (no listing cache), None when absent."""
    try:
        return bytes(fs.cat_file(path))
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


def read_owner(root: str, storage_options: dict[str, Any] | None = None) -> Owner | None:
    fs = storage.filesystem(root, storage_options)
    try:
        body = _cat(fs, storage.path_of(storage.join(root, OWNER_FILE)))
    except Exception as e:
        raise storage.explain(root, e) from e
    return None if body is None else parse_owner(body, root)


def _ancestors(root: str) -> list[str]:
    """URLs of every prefix above ``root``, down from the bucket or ``/`` (the root itself excluded)."""
    if storage.is_local(root):
        parts = storage.local_path(root).rstrip("/").split("/")
        return ["/".join(parts[:i]) or "/" for i in range(1, len(parts))]
    head, _, rest = root.partition("://")
    parts = rest.strip("/").split("/")
    return [f"{head}://{'/'.join(parts[:i])}" for i in range(1, len(parts))]


def _nesting_problem(root: str, fs: Any) -> str | None:
    """A marker above ``root`` (it lies inside another root) or under it (it contains one)."""
    for anc in _ancestors(root):
        body = _cat(fs, storage.path_of(storage.join(anc, OWNER_FILE)))
        if body is not None:
            return f"checkpoint root {root} lies inside the root {anc} of {parse_owner(body, anc).describe()}"
    base = storage.path_of(root).rstrip("/")
    storage.forget(fs, base)
    try:
        found = fs.find(base)
    except FileNotFoundError:
        found = []
    own = f"{fs._strip_protocol(base).rstrip('/')}/{OWNER_FILE}"
    for path in sorted(found):
        if path.rstrip("/").rsplit("/", 1)[-1] == OWNER_FILE and path.rstrip("/") != own:
            inner = path.rstrip("/").rsplit("/", 1)[0]
            inner_url = inner if storage.is_local(root) else f"{root.split('://', 1)[0]}://{inner}"
            body = _cat(fs, path)
            owner = parse_owner(body, inner_url).describe() if body is not None else "another job"
            return f"checkpoint root {root} lies above the root {inner_url} of {owner}"
    return None


def _legacy_problem(root: str, fs: Any, job_id: str, adopt: bool) -> str | None:
    """A root of the previous release (no marker): whose committed checkpoints does it hold?"""
    base = storage.path_of(root).rstrip("/")
    try:
        entries = storage.listing(fs, base)
    except FileNotFoundError:
        return None
    owners: set[str | None] = set()
    for entry in entries:
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if not name.startswith("step_"):
            continue
        body = _cat(fs, f"{entry.rstrip('/')}/{contract.CHECKPOINT_COMMIT_MARKER}")
        if body is None:
            continue  # never committed: no checkpoint
        try:
            marker = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            marker = None
        job = marker.get("job_id") if isinstance(marker, dict) else None
        owners.add(job if isinstance(job, str) else None)
    others = sorted(o for o in owners if o is not None and o != job_id)
    if others:
        return f"checkpoint root {root} holds committed checkpoints of job {others[0]} (written before owner markers)"
    if None in owners and not adopt:
        return (f"checkpoint root {root} holds committed checkpoints of an unknown job (written before owner "
                "markers): only a job resuming from it may adopt it")
    return None


def _examine(root: str, job_id: str, cluster_id: str, storage_options: dict[str, Any] | None,
             adopt: bool) -> tuple[Owner | None, str | None]:
    """(the root's owner or None, why this job may not write there or None)."""
    if not job_id:
        return None, f"checkpoint root {root}: no job id to claim it with"
    owner = read_owner(root, storage_options)
    if owner is not None:
        return owner, None if owner.is_of(job_id, cluster_id) else f"checkpoint root {root} owned by {owner.describe()}"
    fs = storage.filesystem(root, storage_options)
    try:
        return None, _nesting_problem(root, fs) or _legacy_problem(root, fs, job_id, adopt)
    except RootOwned:
        raise
    except Exception as e:
        raise storage.explain(root, e) from e


def problem(root: str, job_id: str, cluster_id: str, storage_options: dict[str, Any] | None = None, *,
            adopt: bool = False) -> str | None:
    """Why ``job_id`` of ``cluster_id`` may not write under ``root`` (None: it owns it or may claim it).
    Read-only. Store errors raise (:class:`trainer.storage.StoreConfigError` for missing credentials)."""
    return _examine(root, job_id, cluster_id, storage_options, adopt)[1]


def claim(root: str, job_id: str, cluster_id: str, storage_options: dict[str, Any] | None = None, *,
          adopt: bool = False, now: float | None = None) -> Owner:
    """Make ``root`` this job's (or confirm it is): the owner, or RootOwned naming whose it is."""
    owner, why = _examine(root, job_id, cluster_id, storage_options, adopt)
    if why is not None:
        raise RootOwned(why)
    if owner is not None:
        return owner  # already this job's
    mine = Owner(job_id, cluster_id, time.time() if now is None else now)
    if storage.create_if_absent(storage.join(root, OWNER_FILE), mine.body(), storage_options):
        return mine
    winner = read_owner(root, storage_options)  # lost a race: whoever won must be this job too
    if winner is not None and winner.is_of(job_id, cluster_id):
        return winner
    raise RootOwned(f"checkpoint root {root} owned by {winner.describe() if winner else 'another job'}")


def check_root_at_submit(url: str, job_id: str, cluster_id: str,
                         storage_options: dict[str, Any] | None = None) -> str | None:
    """For orchd at submit: None when ``job_id`` of this cluster may use ``url`` as its checkpoint root,
    else the reason (another owner, nesting, another job's checkpoints, or why the store could not be read)."""
    try:
        return problem(url, job_id, cluster_id, storage_options)
    except (RootOwned, storage.StoreConfigError) as e:
        return str(e)
    except Exception as e:
        return f"checkpoint root {url} could not be checked: {type(e).__name__}: {e}"


def take_over(root: str, job_id: str, cluster_id: str, storage_options: dict[str, Any] | None = None, *,
              operator: str, reason: str, now: float | None = None) -> Owner:
    """An operator gives ``root`` to ``job_id`` of ``cluster_id`` (e.g. after the owner cluster's state was
    lost). The new marker records the previous owner, the operator, when and why; returns it."""
    if not operator.strip() or not reason.strip():
        raise ValueError("taking over a checkpoint root needs the operator's name and a reason")
    ts = time.time() if now is None else now
    previous = read_owner(root, storage_options)
    history = [*previous.history, {"job_id": previous.job_id, "cluster_id": previous.cluster_id,
                                   "claimed_ts": previous.claimed_ts, "taken_over_ts": ts,
                                   "operator": operator, "reason": reason}] if previous else [
        {"job_id": "", "cluster_id": "", "claimed_ts": 0.0, "taken_over_ts": ts, "operator": operator,
         "reason": reason}]
    owner = Owner(job_id, cluster_id, ts, history)
    fs = storage.filesystem(root, storage_options)
    path = storage.path_of(storage.join(root, OWNER_FILE))
    try:
        fs.pipe_file(path, owner.body())
    except Exception as e:
        raise storage.explain(root, e) from e
    return owner
