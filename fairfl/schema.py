"""Typed dataclass schemas read from YAML-shaped data, with errors that name the bad field by its dotted path.

The experiment config (fairfl.config) and every plug-in's declared parameters (fairfl.plugins) are read by the same
code, so a plug-in's `params` get the config's validation and error style for free.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any, Literal

__all__ = ["ConfigError", "build_dataclass", "expect_mapping"]


class ConfigError(ValueError):
    """An experiment config is invalid; the message names the field."""


def expect_mapping(raw: Any, fields: typing.Sequence[str], path: str) -> dict[str, Any]:
    """`raw` as a mapping whose keys are all among `fields`; else a ConfigError naming `path` and the valid fields.

    For hand-written YAML shapes that are not dataclasses: comparison files, their runs and claims, results manifest.
    """
    valid = ", ".join(fields)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping with fields {valid}, got {type(raw).__name__}")
    unknown = sorted(set(map(str, raw)) - set(fields))
    if unknown:
        raise ConfigError(f"{path}: unknown field {unknown[0]!r}; valid fields: {valid}")
    return raw


_YAML11_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _at_least(value: int, minimum: int, path: str) -> None:
    if value < minimum:
        raise ConfigError(f"{path}: must be >= {minimum}, got {value}")


def _positive(value: float, path: str, allow_zero: bool = False) -> None:
    if not (value >= 0 if allow_zero else value > 0) or value != value or value == float("inf"):
        raise ConfigError(f"{path}: must be {'>= 0' if allow_zero else '> 0'} and finite, got {value}")


def _describe(hint: Any) -> str:
    """What a value of `hint` looks like to the person writing the YAML ("an integer", "'auto'")."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " or ".join(map(repr, typing.get_args(hint)))
    if origin in (list, tuple):
        return "a list"
    if origin is dict or dataclasses.is_dataclass(hint):
        return "a mapping"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(hint, str(hint))


def _coerce(value: Any, hint: Any, path: str) -> Any:
    if hint is Any:  # a plug-in's raw parameters: its own declaration (fairfl.plugins.parse_params) checks them
        return value
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, option, path)
            except ConfigError as err:
                errors.append(str(err))
        if len(errors) == 1:
            raise ConfigError(errors[0])
        expected = " or ".join(_describe(a) for a in args if a is not type(None))
        raise ConfigError(f"{path}: expected {expected}, got {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
        return [_coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:  # tuple[int, ...] or a fixed tuple[int, float]; YAML writes either as a list
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
        hints = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(hints) != len(value):
            raise ConfigError(f"{path}: expected {len(hints)} values, got {len(value)}")
        return tuple(_coerce(v, h, f"{path}[{i}]") for i, (v, h) in enumerate(zip(value, hints, strict=True)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        return {str(k): _coerce(v, args[1], f"{path}.{k}") for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if hint is float:
        # YAML 1.1 reads 1e-3 and 1.0e3 (no dot, or no exponent sign) as strings; whoever wrote them meant numbers.
        if isinstance(value, str) and _YAML11_EXPONENT.fullmatch(value.strip()):
            return float(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported config type {hint}")  # pragma: no cover - schema bug


def _build(cls: type, data: Any, path: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        moved = getattr(cls, "MOVED_FIELDS", {}).get(unknown[0])  # a key an older config schema had here
        if moved is not None:
            raise ConfigError(f"{_join(path, unknown[0])}: this field moved to {moved}")
        raise ConfigError(f"{_join(path, unknown[0])}: unknown field; valid fields here: {', '.join(names)}")
    values = {name: _coerce(data[name], hints[name], _join(path, name)) for name in names if name in data}
    return cls(**values)


build_dataclass = _build
