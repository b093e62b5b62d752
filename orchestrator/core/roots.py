"""Checkpoint roots: one job, one root.

Role: the pure rules behind "a job writes (and rotates) only under its own checkpoint root". A root is
normalised (``normalise``) and compared by path segments (``relation``): two roots overlap when they are
equal or one lies inside the other, so ``/a/b`` and ``/a/bc`` are siblings, not nested.
``find_overlap`` names the job whose root a new root collides with; the core refuses such a submit
(decide.py ``_job_submitted``) and the admin service says why with the same function.

Normalised form: ``scheme://netloc/path`` with the scheme and netloc lower-cased, ``.`` and empty
segments dropped, ``..`` resolved (never above the root), no trailing slash; ``file://localhost/p`` is
``file:///p``. For comparison the Azure schemes (``az``, ``abfs``, ``abfss``) are one family and their
netloc is the container only (``container@account...``: the account may also come from storage options,
so two accounts with the same container and path are treated as overlapping: refused, never lost).
Percent-encoding is not decoded. A string without ``://`` is compared as a plain path.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Literal, NamedTuple

from wire.messages import CheckpointPolicy

__all__ = ["Overlap", "Relation", "find_overlap", "normalise", "relation", "start_from", "under_root"]

Relation = Literal["equal", "inside", "contains"]

_FAMILY = {"abfs": "az", "abfss": "az"}


class _Key(NamedTuple):
    scheme: str
    netloc: str
    segments: tuple[str, ...]


class Overlap(NamedTuple):
    """The new root ``root`` is ``relation`` (equal to / inside / containing) job ``job_id``'s root."""

    job_id: str
    relation: Relation
    root: str
    other_root: str


def _split(url: str) -> tuple[str, str, tuple[str, ...]]:
    text = url.strip()
    scheme, sep, rest = text.partition("://")
    if sep:
        netloc, _, path = rest.partition("/")
        scheme, netloc = scheme.lower(), netloc.lower()
    else:
        scheme, netloc, path = "", "", text
    if scheme == "file" and netloc == "localhost":
        netloc = ""
    segments: list[str] = []
    for seg in path.split("/"):
        if seg in ("", "."):
            continue
        if seg == "..":
            if segments:
                segments.pop()
            continue
        segments.append(seg)
    return scheme, netloc, tuple(segments)


@functools.lru_cache(maxsize=65536)
def normalise(url: str) -> str:
    """``url`` in normalised form (see the module docstring)."""
    scheme, netloc, segments = _split(url)
    path = "/" + "/".join(segments)
    if not scheme:
        return path
    return f"{scheme}://{netloc}{path if segments or not netloc else ''}"


@functools.lru_cache(maxsize=65536)
def _key(url: str) -> _Key:
    scheme, netloc, segments = _split(url)
    scheme = _FAMILY.get(scheme, scheme)
    if scheme == "az":
        netloc = netloc.partition("@")[0]
    return _Key(scheme, netloc, segments)


def relation(root: str, other: str) -> Relation | None:
    """How ``root`` relates to ``other``: ``equal``, ``inside`` (a descendant of it), ``contains`` (an
    ancestor of it), or None (disjoint: other scheme, bucket or host, or sibling paths)."""
    return _relate(_key(root), _key(other))


_SEGMENT_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.=+")


def under_root(url: str, root: str) -> bool:
    """Whether ``url`` names a directory strictly below the checkpoint root ``root`` (the trust gate's
    check of a committed checkpoint): ``inside`` it by ``relation`` (compared as every root is), no ``.``
    or ``..`` segment anywhere in ``url`` as given (nothing to resolve around the comparison), and what it
    adds below the root in plain segments (``[A-Za-z0-9_.=+-]``). The root is the job spec's (admin-given,
    trusted); only what the agent adds below it is restricted."""
    if relation(url, root) != "inside":
        return False
    path = url.partition("://")[2].partition("/")[2] if "://" in url else url
    if any(seg in (".", "..") for seg in path.split("/")):
        return False
    below = _key(url).segments[len(_key(root).segments):]
    return all(_SEGMENT_OK.issuperset(seg) for seg in below)


def _relate(a: _Key, b: _Key) -> Relation | None:
    if a.scheme != b.scheme or a.netloc != b.netloc:
        return None
    n = min(len(a.segments), len(b.segments))
    if a.segments[:n] != b.segments[:n]:
        return None
    if len(a.segments) == len(b.segments):
        return "equal"
    return "inside" if len(a.segments) > len(b.segments) else "contains"


def find_overlap(roots: Iterable[tuple[str, str]], root: str) -> Overlap | None:
    """The first (by job id) of ``(job_id, root)`` pairs whose root overlaps ``root``, or None."""
    found: Overlap | None = None
    key = _key(root)
    for job_id, other in roots:
        rel = _relate(key, _key(other))
        if rel is not None and (found is None or job_id < found.job_id):
            found = Overlap(job_id, rel, normalise(root), normalise(other))
    return found


def start_from(policy: CheckpointPolicy) -> str | None:
    """The checkpoint a job's spec explicitly starts from (before its own first commit), or None."""
    value = policy.start_from
    return value if isinstance(value, str) and value.strip() else None
