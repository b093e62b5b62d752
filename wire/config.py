"""The one configuration loader: TOML tables and environment overrides -> frozen, typed dataclasses.

Role: every configuration this product reads - orchd's settings, each provider's table, the agent's
configuration - is a frozen dataclass built by ``load_dataclass``. Every problem (unknown keys, wrong
types, values out of range, choices not offered) is collected with its key path, and one ``SettingsError``
lists them all, so an operator fixes everything in one go.

Field types drive the conversion: ``bool``, ``int``, ``float`` (never NaN), ``str``, ``Literal[...]`` and
``Enum`` subclasses (the choices), ``datetime`` (a TOML/YAML date-time or date, or an ISO-8601 string),
``tuple[T, ...]``, ``Mapping[str, T]``, nested dataclasses, ``X | None``, ``A | B`` and msgspec Structs. A
field without a default is required. A field's ``metadata={"gt": 0}`` (or ``"ge"``) bounds a number.
Environment values are strings: ``from_env`` turns each into the field's type (``"2024"`` stays a string
for a ``str`` field; a comma splits only a tuple; ``yes``/``no`` only for a bool).
Pure: no I/O except reading the file ``read_toml`` is given.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import math
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

import msgspec

T = TypeVar("T")


class SettingsError(ValueError):
    """Every problem of one configuration source, each ``key.path: what is wrong``."""

    def __init__(self, problems: list[str], source: str = "settings") -> None:
        self.problems = problems
        self.source = source
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid {source} ({len(problems)} problem{'s' * (len(problems) != 1)}):\n{lines}")


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The TOML file as a dict; a missing or malformed file is a SettingsError naming it."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise SettingsError([f"file not found: {path}"], str(path)) from None
    except OSError as e:
        raise SettingsError([f"cannot read: {e.strerror}"], str(path)) from None
    except tomllib.TOMLDecodeError as e:
        raise SettingsError([f"not valid TOML: {e}"], str(path)) from None


def load_dataclass(cls: type[T], raw: Any, path: str = "") -> tuple[T | None, list[str]]:
    """Build frozen dataclass ``cls`` from ``raw``; return (instance or None, every problem found)."""
    where = path or "<root>"
    if not isinstance(raw, Mapping):
        return None, [f"{where}: expected a table, got {type(raw).__name__}"]
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    problems: list[str] = []
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            known = ", ".join(sorted(fields))
            problems.append(f"{_join(path, key)}: unknown key (known: {known})")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                problems.append(f"{_join(path, name)}: required")
            continue
        value, more = convert(hints[name], raw[name], _join(path, name))
        if not more:
            more = _bounds(f, value, _join(path, name))
        problems += more
        if not more:
            kwargs[name] = value
    if problems:
        return None, problems
    return cls(**kwargs), []


def load_checked(cls: type[T], raw: Any, path: str) -> T:
    """``load_dataclass`` plus the class's own ``check(path) -> list[str]`` cross checks, if it has one;
    raise one SettingsError listing every problem (each provider's table is loaded this way)."""
    cfg, problems = load_dataclass(cls, raw, path)
    check = getattr(cfg, "check", None)
    if check is not None:
        problems += check(path)
    if problems or cfg is None:
        raise SettingsError(problems, path)
    return cfg


def from_env(cls: type, env: Mapping[str, str], prefix: str, nested: bool = True) -> tuple[dict[str, Any], list[str]]:
    """Environment overrides for dataclass ``cls`` as a raw table, each value converted by its field's type.

    ``nested``: ``<PREFIX><SECTION>__<KEY>`` addresses ``section.key`` (orchd's ``ORCH_DAEMON__TICK_S``);
    otherwise ``<PREFIX><KEY>`` addresses a top-level field (the agent's ``ORCH_AGENT_HEARTBEAT_S``).
    Names that match no field are problems, not silently ignored. Inside a ``Mapping[str, T]`` field the
    next part is an entry's key and the rest is typed by ``T`` (``ORCH_PROVIDERS__FEEDS__AWS__ENABLED``);
    below ``Any`` (a provider's own table) a value is read as JSON or a TOML value, else kept as text, so
    a list there is written ``["a", "b"]``. A whole table and one of its keys may both be given (the key
    wins, whatever the order of the environment); a key that cannot be a table is a problem."""
    raw: dict[str, Any] = {}
    problems: list[str] = []
    origin: dict[tuple[str, ...], str] = {}
    for key in sorted(env):  # a table's own name sorts before its keys: the more specific one wins
        if not key.startswith(prefix) or (nested and "__" not in key):
            continue
        parts = [p.lower() for p in key[len(prefix):].split("__")] if nested else [key[len(prefix):].lower()]
        if not all(parts):
            problems.append(f"{key}: empty path component")
            continue
        tp, err = _field_type(cls, parts)
        if err:
            problems.append(f"{key}: {err}")
            continue
        err = _put(raw, parts, env_value(tp, env[key]), origin, key)
        if err:
            problems.append(f"{key}: {err}")
    return raw, problems


def _put(raw: dict[str, Any], parts: list[str], value: Any, origin: dict[tuple[str, ...], str], key: str) -> str:
    """Set ``raw[parts[0]]...[parts[-1]] = value``; an error text when another variable is in the way."""
    node = raw
    for i, p in enumerate(parts[:-1]):
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            return f"{origin[tuple(parts[: i + 1])]} already sets {'.'.join(parts[: i + 1])} to a non-table value"
        node = child
    where = tuple(parts)
    if where in origin:
        return f"{origin[where]} already sets {'.'.join(parts)}"
    origin[where] = key
    node[parts[-1]] = value
    return ""


def env_value(tp: Any, text: str) -> Any:
    """An environment string as the value a TOML file would give for a field of type ``tp``."""
    base = _strip_optional(tp)
    origin = typing.get_origin(base)
    if base is bool:
        low = text.strip().lower()
        return {"true": True, "1": True, "yes": True, "on": True,
                "false": False, "0": False, "no": False, "off": False}.get(low, text)
    if base in (int, float):
        try:
            return int(text) if base is int else float(text)
        except ValueError:
            return text
    if origin is tuple:
        item = (typing.get_args(base) or (str,))[0]
        return [env_value(item, part.strip()) for part in text.split(",") if part.strip()]
    if base in (str, dt.datetime) or origin is Literal or (isinstance(base, type) and issubclass(base, enum.Enum)):
        return text  # the converter checks the choice or parses the ISO-8601 text
    try:  # tables, structs: JSON or TOML inline values
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        try:
            return tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            return text


def problem_path(problem: str) -> str:
    """The key path a problem is about (``"a.b[2]: wrong"`` -> ``"a.b"``); "" for the root."""
    path = problem.split(": ", 1)[0]
    return "" if path == "<root>" else path.split("[", 1)[0]


def without_problems(raw: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    """``raw`` less every key a problem names, table by table: what loads cleanly in a second pass once
    the required keys are filled in, so cross-field rules can still run on the valid part (job specs)."""
    out = _deep_copy(raw)
    for problem in problems:
        parts = problem_path(problem).split(".")
        node: Any = out
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(parts[-1], None)
    return out


def _deep_copy(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in raw.items()}


def merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` laid on ``base`` table by table (a later source wins key by key)."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def _field_type(cls: Any, parts: list[str]) -> tuple[Any, str]:
    """The type a value at ``parts`` below ``cls`` must have; (None, why) where no field is there."""
    tp: Any = cls
    for i, part in enumerate(parts):
        tp = _strip_optional(tp)
        if tp is Any:
            return Any, ""  # an untyped table (a provider's own): its owner checks the keys
        if dataclasses.is_dataclass(tp):
            names = {f.name for f in dataclasses.fields(tp)}
            if part not in names:
                return None, f"unknown setting {'.'.join(parts[: i + 1])}"
            tp = typing.get_type_hints(tp)[part]
        elif typing.get_origin(tp) in (Mapping, dict) or tp in (Mapping, dict):
            args = typing.get_args(tp)
            tp = args[1] if len(args) == 2 else Any  # ``part`` is an entry's key: typed by the values
        else:
            return None, f"{'.'.join(parts[:i])} is not a table"
    return tp, ""


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _bounds(f: dataclasses.Field[Any], value: Any, path: str) -> list[str]:
    gt, ge = f.metadata.get("gt"), f.metadata.get("ge")
    if value is None:  # an optional field left unset: nothing to bound
        return []
    if gt is not None and value <= gt:
        return [f"{path}: must be > {gt}, got {value!r}"]
    if ge is not None and value < ge:
        return [f"{path}: must be >= {ge}, got {value!r}"]
    return []


def convert(tp: Any, value: Any, path: str) -> tuple[Any, list[str]]:
    """``value`` (as TOML or JSON gives it) as type ``tp``; (value, []) or (None, problems)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return load_dataclass(typing.cast(type, tp), value, path)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        try:
            return msgspec.convert(value, tp), []
        except msgspec.ValidationError as e:
            return None, [f"{path}: {e}"]
    if origin in (typing.Union, types.UnionType):
        return _convert_union(args, value, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        for member in tp:
            if member.value == value and type(member.value) is type(value):
                return member, []
        return None, [f"{path}: {value!r} is not one of {', '.join(str(m.value) for m in tp)}"]
    if tp is dt.datetime:
        return _convert_datetime(value, path)
    if origin is Literal:
        if value in args and isinstance(value, str):
            return value, []
        return None, [f"{path}: {value!r} is not one of {', '.join(map(str, args))}"]
    if origin is tuple:
        return _convert_tuple(args, value, path)
    if origin in (Mapping, dict) or tp in (Mapping, dict):
        return _convert_mapping(args, value, path)
    return _convert_scalar(tp, value, path)


def _convert_union(args: tuple[Any, ...], value: Any, path: str) -> tuple[Any, list[str]]:
    """The first member that takes ``value``. ``X | None``: X's own problems; ``str | int | ...``: one line."""
    errors: list[str] = []
    members = [a for a in args if a is not type(None)]
    if value is None and len(members) < len(args):
        return None, []
    for arg in members:
        v, errs = convert(arg, value, path)
        if not errs:
            return v, []
        errors = errs
    if len(members) > 1:
        names = " | ".join(getattr(a, "__name__", str(a)) for a in members)
        return None, [f"{path}: expected {names}, got {value!r}"]
    return None, errors


def _convert_datetime(value: Any, path: str) -> tuple[Any, list[str]]:
    """A TOML/YAML date-time or date (midnight), or an ISO-8601 string; the zone, if any, is kept."""
    if isinstance(value, dt.datetime):
        return value, []
    if isinstance(value, dt.date):
        return dt.datetime(value.year, value.month, value.day), []
    if isinstance(value, str):
        try:
            return dt.datetime.fromisoformat(value.replace("Z", "+00:00")), []
        except ValueError:
            return None, [f"{path}: not an ISO-8601 date-time: {value!r}"]
    return None, [f"{path}: expected a date-time, got {value!r}"]


def _convert_tuple(args: tuple[Any, ...], value: Any, path: str) -> tuple[Any, list[str]]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple):
        return None, [f"{path}: expected a list, got {type(value).__name__}"]
    item_tp = args[0] if args else Any
    out, problems = [], []
    for i, item in enumerate(value):
        v, errs = convert(item_tp, item, f"{path}[{i}]")
        out.append(v)
        problems += errs
    return tuple(out), problems


def _convert_mapping(args: tuple[Any, ...], value: Any, path: str) -> tuple[Any, list[str]]:
    if not isinstance(value, Mapping):
        return None, [f"{path}: expected a table, got {type(value).__name__}"]
    val_tp = args[1] if len(args) == 2 else Any
    if val_tp is Any:
        return dict(value), []
    out: dict[str, Any] = {}
    problems: list[str] = []
    for k, item in value.items():
        if not isinstance(k, str):  # TOML keys are always strings; YAML's may not be
            problems.append(f"{path}: key {k!r} is not a string")
            continue
        v, errs = convert(val_tp, item, f"{path}.{k}")
        out[k] = v
        problems += errs
    return out, problems


def _convert_scalar(tp: Any, value: Any, path: str) -> tuple[Any, list[str]]:
    if tp is Any:
        return value, []
    if tp is bool:
        if isinstance(value, bool):
            return value, []
        return None, [f"{path}: expected true/false, got {value!r}"]
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value):
            return float(value), []  # NaN passes every bound (each comparison is false): never a setting
        return None, [f"{path}: expected a number, got {value!r}"]
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value, []
        return None, [f"{path}: expected an integer, got {value!r}"]
    if tp is str:
        if isinstance(value, str):
            return value, []
        return None, [f"{path}: expected a string, got {value!r}"]
    return None, [f"{path}: unsupported setting type {tp!r}"]
