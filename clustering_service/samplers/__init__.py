"""The built-in samplers, one file per method, behind `Sampler.select(SelectionInput, RunState) -> SelectionOutput`
(fairfl.sampling). They are registered as entry points of group fairfl.samplers (pyproject.toml) exactly like a
third party's, and every caller resolves a sampler through `fairfl.sampling.SAMPLERS`, by name or module:attr."""

from __future__ import annotations

import time
from dataclasses import replace

from clustering_service.samplers.clustered import ClusteredParams, ClusteredSampler
from clustering_service.samplers.divfl import DivflParams, DivflSampler
from clustering_service.samplers.full import FullSampler
from clustering_service.samplers.hics import HicsParams, HicsSampler
from clustering_service.samplers.power_of_choice import PowerOfChoiceParams, PowerOfChoiceSampler
from clustering_service.samplers.random import RandomSampler
from fairfl.sampling import (
    SAMPLERS,
    InvalidInput,
    RunState,
    Sampler,
    SelectionInput,
    SelectionOutput,
    resolve_params,
)
from fairfl.schema import ConfigError


def get_sampler(ref: str, field: str = "sampler") -> Sampler:
    """An instance of the sampler `ref` names (registered name, entry point or module:attr); InvalidInput naming
    `field` when it cannot be loaded."""
    try:
        return SAMPLERS.load(ref, field)()
    except ConfigError as err:  # PluginError: not importable, not a Sampler, unknown name
        raise InvalidInput(str(err)) from None


def select(ref: str, request: SelectionInput, state: RunState) -> SelectionOutput:
    """Run one selection with the sampler `ref` names (the same entry point for both transports)."""
    return run_sampler(get_sampler(ref), request, state)


def run_sampler(
    sampler: Sampler, request: SelectionInput, state: RunState, params_path: str = "params"
) -> SelectionOutput:
    """`sampler.select` with `request.params` as the sampler's Params (None: defaults; a mapping: parsed, errors
    naming `params_path`), the time it took recorded in `seconds`, and the answer checked against its declaration."""
    request = replace(request, params=resolve_params(type(sampler), request.params, params_path))
    start = time.perf_counter()
    out = sampler.select(request, state)
    if not isinstance(out, SelectionOutput):
        raise InvalidInput(f"sampler {type(sampler).__name__} returned {type(out).__name__}, not a SelectionOutput")
    if out.needs_losses and not type(sampler).needs_losses:
        raise InvalidInput(f"sampler {type(sampler).__name__} asked for losses but does not declare needs_losses")
    return replace(out, seconds=time.perf_counter() - start)


__all__ = [
    "ClusteredParams",
    "ClusteredSampler",
    "DivflParams",
    "DivflSampler",
    "FullSampler",
    "HicsParams",
    "HicsSampler",
    "PowerOfChoiceParams",
    "PowerOfChoiceSampler",
    "RandomSampler",
    "Sampler",
    "SelectionInput",
    "SelectionOutput",
    "get_sampler",
    "run_sampler",
    "select",
]
