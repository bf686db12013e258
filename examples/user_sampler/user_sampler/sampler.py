"""Round-robin client selection: every round takes the next `clients_per_round` candidates of a fixed order, so with
a stable candidate set each client trains once every ceil(N / K) rounds (cyclic participation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fairfl.api import ConfigError, RunState, Sampler, SelectionInput, SelectionOutput

if TYPE_CHECKING:
    from fairfl.api import ExperimentConfig  # only for the annotation of validate_run


@dataclass(frozen=True)
class RoundRobinParams:
    """`selection.params`, checked when the config loads (unknown keys, types, then `validate`)."""

    shuffle: bool = False  # visit the clients in an order drawn once from the run seed, instead of by id
    offset: int = 0  # where round 1 starts in that order

    def validate(self, path: str) -> None:
        if self.offset < 0:
            raise ConfigError(f"{path}.offset: must be >= 0, got {self.offset}")


class RoundRobin(Sampler):
    Params = RoundRobinParams
    # Capabilities: deterministic, not uniform, so DP's accounting (which assumes uniform sampling) cannot use it
    # and a config with privacy.enabled is refused. It reads no signatures, losses or similarities.
    uniform = False

    @classmethod
    def validate_run(cls, params: Any, cfg: ExperimentConfig) -> None:
        if params.offset >= cfg.data.num_clients:
            raise ConfigError(
                f"selection.params.offset: {params.offset} is not below data.num_clients {cfg.data.num_clients}"
            )

    def select(self, request: SelectionInput, state: RunState) -> SelectionOutput:
        # Runs in the clustering service (or in-process); it must give the same answer for the same request anywhere.
        candidates = request.candidates  # sorted ascending by FairFL
        order = candidates
        if request.params.shuffle:
            order = candidates[np.random.default_rng(request.seed).permutation(candidates.size)]
        start = request.params.offset + (request.round - 1) * request.num_to_select
        picked = (start + np.arange(request.num_to_select)) % candidates.size
        return SelectionOutput(selected=tuple(order[picked].tolist()))
