"""Uniform random selection without replacement (the baseline of every paper)."""

from __future__ import annotations

import numpy as np

from fairfl.sampling import RunState, Sampler, SelectionInput, SelectionOutput


class RandomSampler(Sampler):
    uniform = True  # depends on (seed, round) and the candidate set only: DP's accounting holds

    def select(self, request: SelectionInput, state: RunState) -> SelectionOutput:
        # Seeding from (seed, round) alone makes every round reproducible on its own (a resumed run or the
        # in-process oracle picks the same clients) while rounds stay independent of each other.
        rng = np.random.default_rng([request.seed, request.round])
        # Candidates are already sorted by SelectionInput, so the choice depends on the set, not the caller's order.
        picked = rng.choice(request.candidates.size, size=request.num_to_select, replace=False)
        return SelectionOutput(selected=tuple(request.candidates[picked].tolist()))
