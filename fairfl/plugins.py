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
        entry = self._entry_points().get(ref)
        if entry is None:
            raise PluginError(
                f"{field}: unknown {self.kind} {ref!r}; available: {', '.join(self.names()) or 'none'} "
                "(or name your own as package.module:attr)"
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


def params_to_struct(params: Any) -> struct_pb2.Struct:
    """A plug-in's parameters (dataclass or mapping) as a protobuf Struct, the open typed field they travel in."""
    raw = dataclasses.asdict(params) if dataclasses.is_dataclass(params) else dict(params or {})
    out = struct_pb2.Struct()
    out.update({k: v for k, v in raw.items() if v is not None})
    return out


def params_from_struct(cls: type, message: struct_pb2.Struct, path: str) -> Any:
    """`parse_params` of a Struct off the wire. Struct numbers are doubles, so an integral value is read back as the
    int it was wherever the dataclass declares an int."""
    raw = json_format.MessageToDict(message)
    hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
    return parse_params(cls, {k: _integral(v, hints.get(k)) for k, v in raw.items()}, path)


def _integral(value: Any, hint: Any) -> Any:
    wants_int = (
        hint is int
        or int in typing.get_args(hint)
        or (typing.get_origin(hint) is list and typing.get_args(hint)[:1] == (int,))
    )
    if not wants_int:
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [int(v) if isinstance(v, float) and v.is_integer() else v for v in value]
    return value
