"""Power-of-choice (Cho et al. 2020; seed-hicsfl.md §2.2): the K candidates with the highest loss at the global model.

Two calls per round. Without `candidate_losses` the sampler draws the candidate set A: d clients without
replacement ∝ data size (uniform when sizes are not given), or every candidate when d = 0 or d ≥ N (the HiCS-FL
paper's ideal setting, d = N), and answers `needs_losses`. The caller measures F_k(θ_t) on A and calls again with
A as `candidates` and their losses; the answer is the top K by loss (ties: lower client id).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from clustering_service.samplers.base import check_at_least, data_sizes, gumbel_top_k, round_rng
from fairfl.sampling import InvalidInput, RunState, Sampler, SelectionInput, SelectionOutput
from fairfl.schema import ConfigError

if TYPE_CHECKING:
    from fairfl.config import ExperimentConfig


@dataclass(frozen=True)
class PowerOfChoiceParams:
    # d, the size of the candidate set whose losses are compared (None or 0 = every candidate, the paper's ideal).
    candidates: int | None = None

    def validate(self, path: str) -> None:
        check_at_least(self, ("candidates",), 0, path)


class PowerOfChoiceSampler(Sampler):
    Params = PowerOfChoiceParams
    needs_losses = True

    @classmethod
    def validate_run(cls, params: PowerOfChoiceParams, cfg: ExperimentConfig) -> None:
        d, k, n = params.candidates, cfg.selection.clients_per_round, cfg.data.num_clients
        if d and not k <= d <= n:
            raise ConfigError(
                f"selection.params.candidates: d = {d} must be between selection.clients_per_round = {k} and "
                f"data.num_clients = {n} (0 = every client)"
            )

    def select(self, request: SelectionInput, state: RunState) -> SelectionOutput:
        cands, k = request.candidates, request.num_to_select
        losses = request.candidate_losses
        if losses is not None:
            order = np.lexsort((cands, -losses))[:k]  # highest loss first, then lower id
            return SelectionOutput(selected=tuple(cands[order].tolist()))
        d = request.params.candidates or cands.size
        if d < k:
            raise InvalidInput(f"params.candidates (d = {d}) must be >= num_to_select ({k}): pow-d picks K of d")
        if d >= cands.size:
            return SelectionOutput(selected=tuple(cands.tolist()), needs_losses=True)
        sizes = request.candidate_num_samples
        log_w = np.log(data_sizes(sizes)) if sizes is not None else np.zeros(cands.size)
        picked = gumbel_top_k(log_w, d, round_rng(request.seed, request.round))
        return SelectionOutput(selected=tuple(cands[picked].tolist()), needs_losses=True)
