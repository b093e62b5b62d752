"""Names are types: the two shapes every id or name that becomes part of a NATS subject or a KV key has.

- A **token** (``check_token``): ids that become one NATS subject token or one part of a KV key - job,
  node, sweep, cloud, region, zone. Letters, digits, ``_`` and ``-`` only, 1 to ``TOKEN_MAX`` characters:
  no dot (a subject's separator), no ``*`` or ``>`` (wildcards), no space, tab or other control character
  (NATS ends a subject at white space), nothing outside ASCII.
- A **dotted key** (``check_key``): names that carry dots and appear only inside a KV key (after
  ``pool.``) or in payloads - instance types (``p4d.24xlarge``, ``Standard_ND96asr_v4``) and pool names'
  instance-type part. One or more non-empty parts separated by single dots, each part as a token (``=``
  allowed too), 1 to ``KEY_MAX`` characters in all: no ``..``, no leading or trailing dot, no space,
  wildcard, ``/`` or control character.

Both are within what NATS allows (subject tokens: no ``.``, ``*``, ``>`` or white space; JetStream KV
keys: ``[-/_=.a-zA-Z0-9]+`` with no empty token, the key regex of the NATS clients) and what the pool
record key (``pool.<cloud>_<region>_<zone>_<instance type>_<market>``) and the node's subjects need.

``check_token(field, value)`` / ``check_key(field, value)`` return the value or raise ``BadName`` (a
``ValueError``) whose message names the field and the problem; the value is quoted shortened, so a
5,000-character name gives a one-line message. ``TOKEN_PATTERN`` / ``KEY_PATTERN`` are the same rules as
regular expressions for ``msgspec.Meta(pattern=...)`` (wire messages decode-check them).

Pure: no I/O, no third-party imports.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["JOB_ID_MAX", "KEY_MAX", "KEY_PATTERN", "TOKEN_MAX", "TOKEN_PATTERN", "BadName", "check_job_id",
           "check_key", "check_pool_key", "check_token", "is_key", "is_token"]

TOKEN_MAX: Final = 128
"""The longest token. A node id is its job's id plus ``-n<seq>``, so ``JOB_ID_MAX`` leaves room for that."""
JOB_ID_MAX: Final = 100
KEY_MAX: Final = 128
_TOKEN_CHARS: Final = "A-Za-z0-9_\\-"
_KEY_CHARS: Final = "A-Za-z0-9_=\\-"
# \Z, not $: "$" also matches before a final newline (msgspec runs re.search with these)
TOKEN_PATTERN: Final = f"^[{_TOKEN_CHARS}]{{1,{TOKEN_MAX}}}\\Z"
KEY_PATTERN: Final = f"^(?=[{_KEY_CHARS}.]{{1,{KEY_MAX}}}\\Z)[{_KEY_CHARS}]+(\\.[{_KEY_CHARS}]+)*\\Z"
_TOKEN_RE: Final = re.compile(f"[{_TOKEN_CHARS}]+")
_PART_RE: Final = re.compile(f"[{_KEY_CHARS}]+")
_SHOWN: Final = 40


class BadName(ValueError):
    """A name or id that is not a token / dotted key; ``field`` is what it was given as, ``problem`` why."""

    def __init__(self, field: str, value: object, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem} (got {_shown(value)})")


def _shown(value: object) -> str:
    if not isinstance(value, str):
        return type(value).__name__
    shown = ascii(value[:_SHOWN])  # escapes never make a line break; bounded whatever the characters
    if len(shown) > 2 * _SHOWN:
        shown = shown[: 2 * _SHOWN] + "..."
    return shown if len(value) <= _SHOWN else f"{shown}... ({len(value)} characters)"


def _bad_char(value: str, allowed: re.Pattern[str], extra: str = "") -> str | None:
    for c in value:
        if c in extra or allowed.fullmatch(c):
            continue
        if c == ".":
            return "contains a dot (a NATS subject separator)"
        if c in "*>":
            return f"contains the wildcard {c!r}"
        if c.isspace() or not c.isprintable():
            return f"contains white space or a control character ({c!r})"
        return f"contains {c!r} (allowed: letters, digits, '_', '-'{extra and ', ' + repr(extra)})"
    return None


def _bounded(field: str, value: object, max_len: int) -> str:
    """``value`` when it is a string of 1 to ``max_len`` characters, else ``BadName``."""
    if not isinstance(value, str):
        raise BadName(field, value, "must be a string")
    if not value:
        raise BadName(field, value, "must not be empty")
    if len(value) > max_len:
        raise BadName(field, value, f"longer than {max_len} characters")
    return value


def check_token(field: str, value: object, max_len: int = TOKEN_MAX) -> str:
    """``value`` when it is a token (letters, digits, ``_``, ``-``; 1 to ``max_len`` characters), else
    ``BadName`` naming ``field`` and the problem."""
    value = _bounded(field, value, max_len)
    if _TOKEN_RE.fullmatch(value) is None:
        raise BadName(field, value, _bad_char(value, _TOKEN_RE) or "not a token")
    return value


def check_key(field: str, value: object, max_len: int = KEY_MAX) -> str:
    """``value`` when it is a dotted key (non-empty parts of letters, digits, ``_``, ``-``, ``=`` joined
    by single dots; 1 to ``max_len`` characters), else ``BadName`` naming ``field`` and the problem."""
    value = _bounded(field, value, max_len)
    for part in value.split("."):
        if not part:
            raise BadName(field, value, "has an empty part (a leading, trailing or double dot)")
        if _PART_RE.fullmatch(part) is None:
            raise BadName(field, value, _bad_char(part, _PART_RE) or "not a dotted key")
    return value


def is_token(value: object, max_len: int = TOKEN_MAX) -> bool:
    """``check_token`` as a yes or no, with no error built (the screen asks it of every message)."""
    return isinstance(value, str) and 0 < len(value) <= max_len and _TOKEN_RE.fullmatch(value) is not None


def is_key(value: object, max_len: int = KEY_MAX) -> bool:
    """``check_key`` as a yes or no, with no error built."""
    return (isinstance(value, str) and 0 < len(value) <= max_len
            and all(_PART_RE.fullmatch(part) is not None for part in value.split(".")))


def check_job_id(value: object, field: str = "job id") -> str:
    """A job id: a token of at most ``JOB_ID_MAX`` characters (its nodes' ids add ``-n<seq>``)."""
    return check_token(field, value, JOB_ID_MAX)


def check_pool_key(field: str, pool: object) -> object:
    """A pool (``wire.PoolKey`` or anything with its fields): cloud, region and zone are tokens, the
    instance type a dotted key. Returns ``pool``; ``BadName`` names ``<field>.<part>``."""
    for part in ("cloud", "region", "zone"):
        check_token(f"{field}.{part}", getattr(pool, part, None))
    check_key(f"{field}.instance_type", getattr(pool, "instance_type", None))
    return pool
