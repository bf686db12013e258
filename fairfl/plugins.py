"""The plug-in registry: one per kind of extension (models, datasets, strategies, samplers), on the ground floor.

A config names a plug-in by a registered name (`fedavg`) or by `package.module:attr`. Names come from two places,
looked up in this order: `register(...)` calls made in this process, then the installed distributions' entry points
of the kind's group (`fairfl.models`, `fairfl.datasets`, `fairfl.strategies`, `fairfl.samplers`). FairFL's own
built-ins are entry points of the `fairfl` distribution (pyproject.toml), exactly like a third party's, so no list
of names is kept anywhere else. `module:attr` is imported in whichever process needs the plug-in (aggregator, agent,
`compare` worker), which is what makes a plug-in work in fresh processes, not only in the one that registered it.

Every failure (cannot import, not there, wrong shape, missing capability, bad parameter) is a `PluginError` that
names the config field, raised when the config is loaded: before round 1, never in the middle of a run.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
import types
import typing
from collections.abc import Callable
from importlib import metadata
from typing import Any, Generic, TypeVar

from google.protobuf import json_format, struct_pb2

from fairfl.schema import ConfigError, _coerce

__all__ = [
    "NoParams",
    "PluginError",
    "Registry",
    "coerce_params",
    "params_from_struct",
    "params_to_struct",
    "parse_params",
    "reference_of",
]

T = TypeVar("T")
Check = Callable[[Any], str | None]  # None: the object has the kind's shape; else the reason it does not


@dataclasses.dataclass(frozen=True)
class NoParams:
    """The parameters of a plug-in that declares none: any key in its `params` is refused."""


class PluginError(ConfigError):
    """A plug-in cannot be used; the message names the config field and the reason."""


def reference_of(obj: Any) -> str:
    """`module:qualname` of a class or function: a name every process can import it by."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qualname or "<locals>" in qualname or module == "__main__":
        raise PluginError(
            f"{obj!r} cannot be named across processes: define it at the top level of an importable module "
            "(not in __main__ or inside a function)"
        )
    return f"{module}:{qualname}"


def _import_attr(ref: str, field: str, kind: str) -> Any:
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise PluginError(f"{field}: {ref!r} is not a {kind} reference; write package.module:attr")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise PluginError(
            f"{field}: cannot import module {module_name!r} for {kind} {ref!r} ({type(err).__name__}: {err}); "
            "is it installed or on PYTHONPATH in every process of the run?"
        ) from None
    except Exception as err:  # a plug-in module that raises on import: say so, never a bare traceback
        raise PluginError(
            f"{field}: importing module {module_name!r} for {kind} {ref!r} failed: {type(err).__name__}: {err}"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{field}: module {module_name!r} has no attribute {attr!r} (for {kind} {ref!r})")
        obj = getattr(obj, part)
    return obj


class Registry(Generic[T]):
    """Plug-ins of one kind, by name: this process's registrations, then entry points of `group`."""

    def __init__(self, kind: str, group: str, check: Check) -> None:
        self.kind = kind
        self.group = group
        self._check = check
        self._registered: dict[str, T] = {}
        self._loaded: dict[str, T] = {}  # resolved references, so every lookup after the first is a dict hit
        self._lock = threading.Lock()

    def register(self, name: str, obj: T) -> T:
        """Make `obj` available as `name` in this process (a `module:attr` reference works in every process)."""
        if not name or ":" in name:
            raise ValueError(f"a {self.kind} name must be non-empty and without ':', got {name!r}")
        reason = self._check(obj)
        if reason is not None:
            raise PluginError(f"cannot register {obj!r} as {self.kind} {name!r}: {reason}")
        with self._lock:
            self._registered[name] = obj
            self._loaded.pop(name, None)
        return obj

    def unregister(self, name: str) -> None:
        with self._lock:
            self._registered.pop(name, None)
            self._loaded.pop(name, None)

    def _entry_points(self) -> dict[str, metadata.EntryPoint]:
        return {ep.name: ep for ep in metadata.entry_points(group=self.group)}

    def names(self) -> list[str]:
        """Every name this process can resolve: its registrations and the installed entry points."""
        return sorted(set(self._registered) | set(self._entry_points()))

    def load(self, ref: str, field: str) -> T:
        """The plug-in `ref` names (a registered name or `package.module:attr`), checked for the kind's shape;
        PluginError naming `field` otherwise."""
        if not isinstance(ref, str) or not ref.strip():
            raise PluginError(f"{field}: expected a {self.kind} name or package.module:attr, got {ref!r}")
        cached = self._loaded.get(ref)
        if cached is not None:
            return cached
        obj = self._find(ref, field)
        reason = self._check(obj)
        if reason is not None:
            raise PluginError(f"{field}: {ref!r} is not a {self.kind}: {reason}")
        with self._lock:
            self._loaded[ref] = obj
        return obj

    def _find(self, ref: str, field: str) -> Any:
        if ":" in ref:
            return _import_attr(ref, field, self.kind)
        if ref in self._registered:
            return self._registered[ref]
        entries = self._entry_points()
        entry = entries.get(ref)
        if entry is None:
            hint = ""
            if not entries:  # not even FairFL's own built-ins: the checkout was never installed
                hint = (
                    f"; no entry points of group {self.group} are installed: is FairFL installed (`make setup`, or "
                    "`pip install -e .` in the checkout)?"
                )
            raise PluginError(
                f"{field}: unknown {self.kind} {ref!r}; available: {', '.join(self.names()) or 'none'} "
                f"(or name your own as package.module:attr){hint}"
            )
        try:
            return entry.load()
        except Exception as err:
            raise PluginError(
                f"{field}: {self.kind} {ref!r} (entry point {entry.value!r} of group {self.group}) failed to load: "
                f"{type(err).__name__}: {err}"
            ) from None

    def name_of(self, obj: T) -> str:
        """The name `obj` is known by here: a registered or entry-point name, else its `module:attr`."""
        for name, known in self._registered.items():
            if known is obj:
                return name
        for name, known in self._loaded.items():
            if known is obj and ":" not in name:
                return name
        return reference_of(obj)


def parse_params(cls: type, raw: Any, path: str) -> Any:
    """A plug-in's declared parameters (a dataclass whose fields all have defaults) from a config mapping: unknown
    keys and mistyped values are refused naming `path.<key>`, then the dataclass's own `validate(path)` runs."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise PluginError(f"{path}: expected a mapping of parameters, got {type(raw).__name__}")
    if not dataclasses.is_dataclass(cls):
        raise PluginError(f"{path}: the plug-in's Params {cls!r} is not a dataclass")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        valid = ", ".join(fields) or "none"
        raise PluginError(f"{path}: unknown parameter {unknown[0]!r}; valid parameters: {valid}")
    hints = typing.get_type_hints(cls)
    values = {key: _coerce(value, hints[key], f"{path}.{key}") for key, value in raw.items()}
    try:
        params = cls(**values)
    except TypeError as err:  # a required field without a default
        raise PluginError(f"{path}: {err}") from None
    check = getattr(params, "validate", None)
    if check is not None:
        check(path)
    return params


def coerce_params(cls: type, params: Any, path: str) -> Any:
    """`params` as a checked instance of the Params dataclass `cls`: None gives the defaults; a mapping (from a
    config) or an instance (built in code) goes through `parse_params`'s checks alike; anything else is refused."""
    if params is None or isinstance(params, dict):
        return parse_params(cls, params or {}, path)
    if not isinstance(params, cls):
        raise PluginError(f"{path}: expected {cls.__qualname__} or a mapping, got {type(params).__name__}")
    return parse_params(cls, dataclasses.asdict(params), path)


WIRE_INT_MAX = 2**53  # Struct numbers are doubles: every int up to here travels exactly


def params_to_struct(params: Any, path: str = "params") -> struct_pb2.Struct:
    """A plug-in's parameters (dataclass or mapping) as a protobuf Struct, the open typed field they travel in.
    None travels as null; an int a double cannot hold exactly is refused (PluginError naming `path.<key>`)."""
    raw = dataclasses.asdict(params) if dataclasses.is_dataclass(params) else dict(params or {})
    for key, value in raw.items():
        _check_exact(value, f"{path}.{key}")
    out = struct_pb2.Struct()
    out.update(raw)
    return out


def _check_exact(value: Any, path: str) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > WIRE_INT_MAX:
        raise PluginError(
            f"{path}: {value} is beyond ±2^53, which parameters on the wire (a Struct) cannot carry exactly"
        )
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_exact(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_exact(item, f"{path}.{key}")


def params_from_struct(cls: type, message: struct_pb2.Struct, path: str) -> Any:
    """`parse_params` of a Struct off the wire. Struct numbers are doubles, so an integral value is read back as the
    int it was wherever the dataclass declares an int (also inside lists, mappings and optional fields)."""
    raw = json_format.MessageToDict(message)
    hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
    return parse_params(cls, {k: _integral(v, hints.get(k)) for k, v in raw.items()}, path)


def _integral(value: Any, hint: Any) -> Any:
    """`value` with integral floats turned back into ints where `hint` admits an int at that position."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if isinstance(value, float) and value.is_integer() and int in options:
        return int(value)
    for option in options:
        origin, args = typing.get_origin(option), typing.get_args(option)
        if isinstance(value, list) and origin is list and args:
            return [_integral(item, args[0]) for item in value]
        if isinstance(value, list) and origin is tuple and args:
            hints = [args[0]] * len(value) if args[-1] is Ellipsis else [*args, *[None] * len(value)]
            return [_integral(item, hint) for item, hint in zip(value, hints, strict=False)]
        if isinstance(value, dict) and origin is dict and len(args) == 2:
            return {key: _integral(item, args[1]) for key, item in value.items()}
    return value
