"""A user's sampler: a window of the (sorted) candidates that moves on by `num_to_select` every round."""

from __future__ import annotations

from dataclasses import dataclass

from fairfl.api import ConfigError, RunState, Sampler, SelectionInput, SelectionOutput


@dataclass(frozen=True)
class RoundRobinParams:
    offset: int = 0  # where round 1's window starts

    def validate(self, path: str) -> None:
        if self.offset < 0:
            raise ConfigError(f"{path}.offset: must be >= 0, got {self.offset}")


class RoundRobin(Sampler):
    Params = RoundRobinParams

    def select(self, request: SelectionInput, state: RunState) -> SelectionOutput:
        n, k = request.candidates.size, request.num_to_select
        start = request.params.offset + (request.round - 1) * k
        picked = [int(request.candidates[(start + i) % n]) for i in range(k)]
        return SelectionOutput(selected=tuple(picked))
