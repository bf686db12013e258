"""Client samplers, one file per method, behind `Sampler.select(SelectionInput, RunState) -> SelectionOutput`."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from clustering_service.errors import InvalidInput
from clustering_service.samplers.base import (
    BOOL_PARAMS,
    FLOAT_PARAMS,
    INT_PARAMS,
    Sampler,
    SelectionInput,
    SelectionMethod,
    SelectionOutput,
    SelectionParams,
    check_param_values,
    param_label,
)
from clustering_service.samplers.clustered import ClusteredSampler
from clustering_service.samplers.divfl import DivflSampler
from clustering_service.samplers.full import FullSampler
from clustering_service.samplers.hics import HicsSampler
from clustering_service.samplers.power_of_choice import PowerOfChoiceSampler
from clustering_service.samplers.random import RandomSampler
from clustering_service.state import RunState

# Add a sampler here when its file lands; every other method is reported as not implemented.
_REGISTRY: dict[SelectionMethod, type[Sampler]] = {
    cls.method: cls
    for cls in (RandomSampler, FullSampler, HicsSampler, PowerOfChoiceSampler, ClusteredSampler, DivflSampler)
}
# Config names that differ from the enum names.
_ALIASES = {"CLUSTERED": SelectionMethod.CLUSTERED_SAMPLING}


def implemented_methods() -> list[SelectionMethod]:
    return sorted(_REGISTRY)


def parse_method(method: SelectionMethod | int | str) -> SelectionMethod:
    """Accept the enum, its proto number, or a config name ("random", "hics", "SELECTION_METHOD_FULL")."""
    try:
        if isinstance(method, str):
            name = method.strip().upper().removeprefix("SELECTION_METHOD_")
            parsed = _ALIASES.get(name) or SelectionMethod[name]
        else:
            parsed = SelectionMethod(int(method))
    except (KeyError, ValueError):
        names = ", ".join(m.name for m in SelectionMethod if m)
        raise InvalidInput(f"unknown selection method {method!r}; expected one of {names}") from None
    if parsed is SelectionMethod.UNSPECIFIED:
        raise InvalidInput("selection method is unspecified; set it to e.g. RANDOM or FULL")
    return parsed


def get_sampler(method: SelectionMethod | int | str) -> Sampler:
    """The sampler for `method`; raises InvalidInput for unknown methods, NotImplementedError for planned ones."""
    parsed = parse_method(method)
    cls = _REGISTRY.get(parsed)
    if cls is None:
        available = ", ".join(m.name for m in implemented_methods())
        raise NotImplementedError(
            f"selection method {parsed.name} is not implemented by this clustering service yet (available: {available})"
        )
    return cls()


def params_from_config(method: str, raw: dict[str, Any]) -> SelectionParams:
    """`selection.params` of an experiment as SelectionParams for `method`; raises InvalidInput naming the key
    (config loading prefixes the dotted path). Keys are SelectionParams fields; `candidates` is power-of-choice's d."""
    sampler = get_sampler(method)
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = "choice_candidates" if key == "candidates" else key
        if name not in sampler.params_used or name == "total_rounds":  # the run's rounds give 𝒯
            valid = ", ".join(param_label(n) for n in sampler.params_used if n != "total_rounds") or "none"
            raise InvalidInput(f"{key}: not a parameter of selection method {method}; its parameters: {valid}")
        if name in FLOAT_PARAMS:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidInput(f"{key}: expected a number, got {value!r}")
            value = float(value)
        elif name in INT_PARAMS:
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidInput(f"{key}: expected an integer, got {value!r}")
        elif name in BOOL_PARAMS and not isinstance(value, bool):
            raise InvalidInput(f"{key}: expected true or false, got {value!r}")
        values[name] = value
    params = SelectionParams(**values)
    check_param_values(params)
    return params


def select(method: SelectionMethod | int | str, request: SelectionInput, state: RunState) -> SelectionOutput:
    """Run one selection with the sampler for `method` (the same entry point for both transports)."""
    return run_sampler(get_sampler(method), request, state)


def run_sampler(sampler: Sampler, request: SelectionInput, state: RunState) -> SelectionOutput:
    """`sampler.select`, with the time it took recorded in `seconds`."""
    start = time.perf_counter()
    out = sampler.select(request, state)
    return replace(out, seconds=time.perf_counter() - start)


__all__ = [
    "ClusteredSampler",
    "DivflSampler",
    "FullSampler",
    "HicsSampler",
    "PowerOfChoiceSampler",
    "RandomSampler",
    "Sampler",
    "SelectionInput",
    "SelectionMethod",
    "SelectionOutput",
    "SelectionParams",
    "get_sampler",
    "implemented_methods",
    "params_from_config",
    "parse_method",
    "run_sampler",
    "select",
]
