"""Uniform random selection without replacement (the baseline of every paper)."""

from __future__ import annotations

import numpy as np

from clustering_service.samplers.base import Sampler, SelectionInput, SelectionMethod, SelectionOutput
from clustering_service.state import RunState


class RandomSampler(Sampler):
    method = SelectionMethod.RANDOM

    def select(self, request: SelectionInput, state: RunState) -> SelectionOutput:
        self.check_params(request.params)  # it takes none: a set parameter is a mistake worth reporting
        # Seeding from (seed, round) alone makes every round reproducible on its own (a resumed run or the
        # in-process oracle picks the same clients) while rounds stay independent of each other.
        rng = np.random.default_rng([request.seed, request.round])
        # Candidates are already sorted by SelectionInput, so the choice depends on the set, not the caller's order.
        picked = rng.choice(request.candidates.size, size=request.num_to_select, replace=False)
        return SelectionOutput(selected=tuple(request.candidates[picked].tolist()))
