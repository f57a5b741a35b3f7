"""Lists where the schema has lists, single values where it has single values.

OmegaConf checks scalar types while it merges (``"abc"`` for a number is its one-line
error), but a value of the wrong *shape* gave its internal wording
(``AnyNode is not a ListConfig, TupleConfig, list, or tuple``, sometimes under the key
``'?'``), a list inside a list of strings passed it and crashed later, and a YAML
boolean (unquoted ``no``) became the string ``'True'``. Each mapping
is checked here before it is merged: a one-line ``ConfigError`` naming the key, what
it takes and what it got.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Union

from .validation import ConfigError

_SCALARS = {int: ("an integer", "integers"), float: ("a number", "numbers"), str: ("a string", "strings"),
            bool: ("true or false", "true / false values")}


def _strip_optional(hint: Any) -> Any:
    if typing.get_origin(hint) is Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def describe(hint: Any, plural: bool = False) -> str:
    """``List[List[int]]`` -> ``"a list of lists of integers"``."""
    hint = _strip_optional(hint)
    if typing.get_origin(hint) is list:
        inner = describe(typing.get_args(hint)[0], plural=True)
        return f"lists of {inner}" if plural else f"a list of {inner}"
    if dataclasses.is_dataclass(hint):
        return "sections" if plural else "a section"
    singular, many = _SCALARS.get(hint, ("a value", "values"))
    return many if plural else singular


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` has the container shape of ``hint`` (scalar types are OmegaConf's)."""
    optional = typing.get_origin(hint) is Union
    hint = _strip_optional(hint)
    if value is None:  # a list that is not Optional is [] when empty; other None: OmegaConf's check
        return optional or typing.get_origin(hint) is not list
    if typing.get_origin(hint) is list:
        return isinstance(value, list) and all(_fits(v, typing.get_args(hint)[0]) for v in value)
    if dataclasses.is_dataclass(hint):
        return isinstance(value, dict)
    if hint is str and isinstance(value, bool):  # OmegaConf would make it the string 'True'
        return False
    if hint in _SCALARS:
        return not isinstance(value, (list, dict))
    return True


def _has_bool(value: Any) -> bool:
    return isinstance(value, bool) or (isinstance(value, list) and any(_has_bool(v) for v in value))


def _example(value: Any, hint: Any) -> str:
    """A value of ``hint``'s shape built from ``value`` (a single value in a list), if one fits."""
    if value == "":
        return " (empty: [])"
    wrapped = [value]
    return f" (as a list: {wrapped!r})" if _fits(wrapped, hint) else ""


def check_value_shapes(data: dict, schema: type, source: str, prefix: str = "") -> None:
    """Check ``data`` (a mapping of the config or of one of its sections, ``schema``)
    key by key; unknown keys are left to ``check_keys``.

    Raises:
        ConfigError: ``<source>: config key 'a.b' takes a list of integers, got 64 (as a
            list: [64])``.
    """
    hints = typing.get_type_hints(schema)
    for key, value in data.items():
        hint = hints.get(key)
        if hint is None:
            continue
        name = f"{prefix}{key}"
        inner = _strip_optional(hint)
        if dataclasses.is_dataclass(inner):
            if isinstance(value, dict):
                check_value_shapes(value, inner, source, f"{name}.")
            continue  # a section given a value: check_keys says so
        if not _fits(value, hint):
            got = "null" if value is None else repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            example = " (empty: [])" if value is None else _example(value, hint)
            if _has_bool(value) and "string" in describe(hint):
                example = " (YAML reads unquoted yes, no, on, off, true and false as booleans: quote them, e.g. 'no')"
            raise ConfigError(f"{source}: config key '{name}' takes {describe(hint)}, got {got}{example}")
        items = typing.get_args(inner)
        if typing.get_origin(inner) is list and items and dataclasses.is_dataclass(items[0]):
            for i, item in enumerate(value or []):
                check_value_shapes(item, items[0], source, f"{name}[{i}].")

