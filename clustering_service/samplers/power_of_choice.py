"""Power-of-choice (Cho et al. 2020; seed-hicsfl.md §2.2): the K candidates with the highest loss at the global model.

Two calls per round. Without `candidate_losses` the sampler draws the candidate set A: d clients without
replacement ∝ data size (uniform when sizes are not given), or every candidate when d = 0 or d ≥ N (the HiCS-FL
paper's ideal setting, d = N), and answers `needs_losses`. The caller measures F_k(θ_t) on A and calls again with
A as `candidates` and their losses; the answer is the top K by loss (ties: lower client id).
"""

from __future__ import annotations

import numpy as np

from clustering_service.errors import InvalidInput
from clustering_service.samplers.base import (
    Sampler,
    SelectionInput,
    SelectionMethod,
    SelectionOutput,
    data_sizes,
    gumbel_top_k,
    round_rng,
)
from clustering_service.state import RunState


class PowerOfChoiceSampler(Sampler):
    method = SelectionMethod.POWER_OF_CHOICE
    params_used = ("choice_candidates",)

    def select(self, request: SelectionInput, state: RunState) -> SelectionOutput:
        self.check_params(request.params)
        cands, k = request.candidates, request.num_to_select
        losses = request.candidate_losses
        if losses is not None:
            order = np.lexsort((cands, -losses))[:k]  # highest loss first, then lower id
            return SelectionOutput(selected=tuple(cands[order].tolist()))
        d = request.params.choice_candidates or cands.size
        if d < k:
            raise InvalidInput(f"params.candidates (d = {d}) must be >= num_to_select ({k}): pow-d picks K of d")
        if d >= cands.size:
            return SelectionOutput(selected=tuple(cands.tolist()), needs_losses=True)
        sizes = request.candidate_num_samples
        log_w = np.log(data_sizes(sizes)) if sizes is not None else np.zeros(cands.size)
        picked = gumbel_top_k(log_w, d, round_rng(request.seed, request.round))
        return SelectionOutput(selected=tuple(cands[picked].tolist()), needs_losses=True)
