"""Typed configuration: dataclasses built from YAML mappings and `a.b.c=value` overrides.

Every field is typed and documented by the string literal that follows it (an
attribute docstring, as in torchtitan). Mistakes raise ConfigError with one line
that names the key and says how to fix it.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import textwrap
import types
import typing
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml

from .errors import ConfigError


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstring of each field of dataclass `cls` (inherited ones included)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for stmt, nxt in zip(body, body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _unknown_key(key: str, known: list[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key.split(".")[-1], known, n=1)
    hint = f" (did you mean '{_join(where, close[0])}'?)" if close else f" (known keys: {', '.join(sorted(known))})"
    return ConfigError(f"unknown config key '{_join(where, key)}'{hint}")


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    if origin in (list, tuple):
        args = [a for a in get_args(tp) if a is not Ellipsis]
        if origin is tuple and len(args) == len(get_args(tp)) and len(set(args)) == 1:  # tuple[float, float]
            return f"a list of {len(args)} {PLURALS.get(args[0], _describe(args[0]))}"
        return "a list of " + " and ".join(PLURALS.get(a, _describe(a)) for a in args)
    if tp is float:
        return "a finite number"
    return {int: "an integer", bool: "true or false", str: "a string"}.get(tp, str(tp))


PLURALS = {float: "finite numbers", int: "integers", str: "strings", bool: "true/false values"}


BOOLEAN_WORDS = {word: truth for truth, words in ((True, ("true", "yes", "on", "y")), (False, ("false", "no", "off", "n")))
                 for word in words}
"""The words YAML reads as booleans, for a boolean setting given on the command line."""


def _coerce(value: Any, tp: Any, key: str, example: Any = None) -> Any:
    """Convert a YAML-parsed value to field type `tp`, or raise ConfigError naming `key` (and, for a list,
    showing `example`, the field's current value, in override form)."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in get_args(tp):
            return None
        for arg in get_args(tp):
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
    elif origin is Literal:
        if value in get_args(tp):
            return value
    elif origin in (list, tuple):
        args = get_args(tp) or (Any, ...)
        fixed = origin is tuple and args[-1] is not Ellipsis  # tuple[float, float]: exactly that many items
        if isinstance(value, (list, tuple)) and (not fixed or len(value) == len(args)):
            item_types = args if fixed else [args[0]] * len(value)
            items = [_coerce(v, a, key) for v, a in zip(value, item_types)]
            return tuple(items) if origin is tuple else items
    elif tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in BOOLEAN_WORDS:  # an override's word (parse_override)
            return BOOLEAN_WORDS[value.lower()]
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads '1e-3' (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        # nan and inf are no setting's meaning: nan passes every range check (each comparison is false).
        if number is not None and math.isfinite(number):
            return number
    elif tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    elif tp is Any:
        return value
    hint = f" (e.g. {key}={_as_override(example)})" if isinstance(example, (list, tuple)) and example else ""
    raise ConfigError(f"{key}={value!r} is not valid: expected {_describe(tp)}{hint}")


def _as_override(value: list | tuple) -> str:
    return "[" + ",".join(str(v) for v in value) + "]"


def from_dict(cls: type, data: dict | None, prefix: str = "") -> Any:
    """Build dataclass `cls` from a nested mapping; fields not given keep their defaults."""
    return merge(cls(), data or {}, prefix)


def merge(cfg: Any, data: dict, prefix: str = "") -> Any:
    """A copy of dataclass `cfg` with the values of the nested mapping `data` applied."""
    if not isinstance(data, dict):
        raise ConfigError(f"'{prefix or 'config'}' must be a mapping of keys to values, got {data!r}")
    cls = type(cfg)
    fields = _fields(cls)
    hints = get_type_hints(cls)
    changes = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown_key(str(key), list(fields), prefix)
        current = getattr(cfg, key)
        if dataclasses.is_dataclass(current):
            changes[key] = merge(current, value, _join(prefix, key))
        else:
            changes[key] = _coerce(value, hints[key], _join(prefix, key), example=current)
    return dataclasses.replace(cfg, **changes)


def parse_override(text: str) -> tuple[list[str], Any]:
    """'train.steps=100' -> (['train', 'steps'], 100), the value parsed as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override '{text}' is not of the form key=value (e.g. train.steps=100)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, bool):  # YAML reads on/off/yes/no as booleans too: keep the word for a string field
        value = raw.strip()
    return key.strip().split("."), value


def apply_overrides(cfg: Any, overrides: list[str]) -> Any:
    """Apply `a.b.c=value` strings, in order, to a copy of dataclass `cfg`."""
    for text in overrides:
        path, value = parse_override(text)
        nested: Any = value
        for part in reversed(path):
            nested = {part: nested}
        cfg = merge(cfg, nested)
    return cfg


def to_dict(cfg: Any) -> dict:
    """Plain nested dict (tuples as lists) suitable for YAML."""

    def plain(v):
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(dataclasses.asdict(cfg))


def load_yaml(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' not found (give a YAML path such as configs/tiny.yaml)") from None
    except IsADirectoryError:
        raise ConfigError(f"config file '{path}' is a folder; give a YAML file such as configs/tiny.yaml") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file '{path}' is not UTF-8 text; give a YAML file such as configs/tiny.yaml") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file '{path}' is not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if data is None:  # an empty file
        return {}
    if not isinstance(data, dict):
        kind = "a list" if isinstance(data, list) else f"the single value {data!r}"
        raise ConfigError(f"config file '{path}' holds {kind} at its top level; it must map sections to keys "
                          "(e.g. 'train:' then '  steps: 100' on the next line)")
    return data


def describe_fields(cfg: Any, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(key, current value, docstring) for every leaf field, for `--help`-style listings."""
    rows = []
    docs = field_docs(type(cfg))
    for name in _fields(type(cfg)):
        value = getattr(cfg, name)
        key = _join(prefix, name)
        if dataclasses.is_dataclass(value):
            rows.extend(describe_fields(value, key))
        else:
            rows.append((key, value, docs.get(name, "")))
    return rows
