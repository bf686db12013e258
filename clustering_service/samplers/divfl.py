"""DivFL (Balakrishnan et al. 2022; seed-hicsfl.md §2.4): a diverse subset by greedy facility location.

Chooses S, |S| = K, greedily minimising Σ_k min_{s∈S} ‖g_k − g_s‖ over the candidates' last updates g, given as
their Gram matrix (`similarity`; the aggregator computes it where the updates are). The stored updates stand in for
the paper's "ideal" fresh gradients of every client. Before every client has reported an update the distances say
nothing, so the first ⌈N/K⌉ rounds are a random warm-up without replacement (as HiCS-FL's; `warmup_rounds`).
Ties go to a seeded random order of the candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

from clustering_service.samplers.base import check_at_least, require_similarity, round_rng, warmup_selection
from clustering_service.samplers.hics import default_warmup
from clustering_service.samplers.hierarchy import euclidean_from_gram, facility_location_greedy
from fairfl.sampling import RunState, Sampler, SelectionInput, SelectionOutput


@dataclass(frozen=True)
class DivflParams:
    warmup_rounds: int | None = None  # random rounds without replacement first (default ceil(N / K))
    # Aggregator side: similarities from count sketches of this many buckets instead of the full updates (0 = exact).
    sketch_dim: int | None = None

    def validate(self, path: str) -> None:
        check_at_least(self, ("warmup_rounds", "sketch_dim"), 0, path)


class DivflSampler(Sampler):
    Params = DivflParams
    needs_similarity = True

    @classmethod
    def similarity_sketch_dim(cls, params: DivflParams) -> int:
        return params.sketch_dim or 0

    def select(self, request: SelectionInput, state: RunState) -> SelectionOutput:
        p = request.params
        cands, k = request.candidates, request.num_to_select
        warmup = p.warmup_rounds if p.warmup_rounds is not None else default_warmup(cands.size, k)
        if (warm := warmup_selection(request, warmup)) is not None:
            return warm
        distance = euclidean_from_gram(require_similarity(request, "divfl"))
        order = round_rng(request.seed, request.round).permutation(cands.size)
        picked = facility_location_greedy(distance, k, order)
        return SelectionOutput(selected=tuple(cands[picked].tolist()))
