"""Client samplers, one file per method, behind `Sampler.select(SelectionInput, RunState) -> SelectionOutput`."""

from __future__ import annotations

import time
from dataclasses import replace

from clustering_service.errors import InvalidInput
from clustering_service.samplers.base import (
    Sampler,
    SelectionInput,
    SelectionMethod,
    SelectionOutput,
    SelectionParams,
)
from clustering_service.samplers.full import FullSampler
from clustering_service.samplers.random import RandomSampler
from clustering_service.state import RunState

# Add a sampler here when its file lands; every other method is reported as not implemented.
_REGISTRY: dict[SelectionMethod, type[Sampler]] = {cls.method: cls for cls in (RandomSampler, FullSampler)}


def implemented_methods() -> list[SelectionMethod]:
    return sorted(_REGISTRY)


def parse_method(method: SelectionMethod | int | str) -> SelectionMethod:
    """Accept the enum, its proto number, or a config name ("random", "hics", "SELECTION_METHOD_FULL")."""
    try:
        if isinstance(method, str):
            parsed = SelectionMethod[method.strip().upper().removeprefix("SELECTION_METHOD_")]
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


def select(method: SelectionMethod | int | str, request: SelectionInput, state: RunState) -> SelectionOutput:
    """Run one selection with the sampler for `method` (the same entry point for both transports)."""
    return run_sampler(get_sampler(method), request, state)


def run_sampler(sampler: Sampler, request: SelectionInput, state: RunState) -> SelectionOutput:
    """`sampler.select`, with the time it took recorded in `seconds`."""
    start = time.perf_counter()
    out = sampler.select(request, state)
    return replace(out, seconds=time.perf_counter() - start)


__all__ = [
    "FullSampler",
    "RandomSampler",
    "Sampler",
    "SelectionInput",
    "SelectionMethod",
    "SelectionOutput",
    "SelectionParams",
    "get_sampler",
    "implemented_methods",
    "parse_method",
    "run_sampler",
    "select",
]
