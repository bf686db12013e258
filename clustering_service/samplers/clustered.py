"""Clustered Sampling, Algorithm 2 (Fraboni et al. 2021, "Clustered Sampling: Low-Variance and Improved
Representativity for Clients Selection in Federated Learning"; seed-hicsfl.md §2.3).

The aggregator sends the Gram matrix of the candidates' last updates (never the models). Here:
1. Ward's tree over the angular distances arccos(cos(g_i, g_j)) (0 for a client without an update yet).
2. Cut it into the largest subtrees whose data share Σ p_k is at most 1/K (p_k ∝ data size, uniform if not given).
3. The K heaviest clusters each seed one of K sampling distributions with mass K·p_k per member; the other clusters,
   lightest first and clients shuffled within, fill the distributions in order up to mass 1 each (a client's mass may
   be split between two).
4. One client is drawn from each distribution, so every client is drawn K·p_k times in expectation (unbiased).
The K draws are returned as they are, repeats included: the engine trains a repeated client once, and a draw-weighted
strategy (cluster2: the simple average over the K draws) counts it twice, as the algorithm does. If some p_k > 1/K
there can be fewer than K clusters; a distribution left empty then draws ∝ p_k from everyone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from scipy.cluster import hierarchy
from scipy.spatial.distance import squareform

from clustering_service.clustering import canonical_labels
from clustering_service.samplers.base import (
    check_at_least,
    data_sizes,
    require_similarity,
    round_rng,
    warmup_selection,
)
from clustering_service.samplers.hierarchy import angles_from_gram
from fairfl.sampling import RunState, Sampler, SelectionInput, SelectionOutput

# Relative slack on the 1/K mass cap, so float sums of shares that are exactly 1/K are not split.
_MASS_SLACK = 1e-9


def mass_capped_clusters(distance: NDArray[np.float64], shares: NDArray[np.float64], count: int, rows: bool) -> NDArray:
    """Step 1-2: Ward's tree, cut into maximal subtrees of total share <= 1/count; canonical labels."""
    n = shares.size
    if n == 1:
        return np.zeros(1, dtype=np.int64)
    tree = hierarchy.linkage(distance if rows else squareform(distance, checks=False), method="ward")
    # Share of every merged node: a tree recurrence over n − 1 nodes (children always come first).
    node_share = np.concatenate([shares, np.zeros(n - 1)])
    children = tree[:, :2].astype(np.int64)
    for i, (a, b) in enumerate(children.tolist()):
        node_share[n + i] = node_share[a] + node_share[b]
    labels = hierarchy.fcluster(
        tree, t=(1.0 + _MASS_SLACK) / count, criterion="monocrit", monocrit=node_share[n:].copy()
    )
    return canonical_labels(labels)


def sampling_distributions(
    labels: NDArray[np.int64], shares: NDArray[np.float64], count: int, rng: np.random.Generator
) -> NDArray[np.float64]:
    """Step 3: K rows (distributions over the n clients) of total mass 1 each, rows normalised."""
    n = shares.size
    mass = count * shares
    cluster_mass = np.bincount(labels, weights=mass)
    rank = np.lexsort((np.arange(cluster_mass.size), cluster_mass))  # clusters, lightest first (ties: lower label)
    kept = rank[-count:]
    rows = np.zeros((count, n))
    row_of_cluster = np.full(cluster_mass.size, -1, dtype=np.int64)
    row_of_cluster[kept] = np.arange(kept.size)  # lightest kept cluster -> row 0, filled first below
    seeded = row_of_cluster[labels] >= 0
    rows[row_of_cluster[labels[seeded]], np.flatnonzero(seeded)] = mass[seeded]
    rest = np.flatnonzero(~seeded)
    if rest.size:
        position = np.empty(cluster_mass.size, dtype=np.int64)
        position[rank] = np.arange(rank.size)
        rest = rest[np.lexsort((rng.random(rest.size), position[labels[rest]]))]  # by cluster, shuffled within
        # Lay the leftover clients' masses end to end and the rows' free capacities end to end; a client gives each
        # row the overlap of the two intervals.
        client_end = np.cumsum(mass[rest])
        client_start = client_end - mass[rest]
        room_end = np.cumsum(np.maximum(1.0 - rows.sum(axis=1), 0.0))
        room_start = room_end - np.maximum(1.0 - rows.sum(axis=1), 0.0)
        overlap = np.minimum(client_end[None, :], room_end[:, None]) - np.maximum(
            client_start[None, :], room_start[:, None]
        )
        rows[:, rest] += np.maximum(overlap, 0.0)
    totals = rows.sum(axis=1, keepdims=True)
    empty = totals[:, 0] <= 0
    rows[empty] = shares  # only when some client holds more than 1/K of the data
    totals[empty] = shares.sum()
    return rows / totals


def draw_one_per_row(rows: NDArray[np.float64], rng: np.random.Generator) -> NDArray[np.int64]:
    """Step 4: one independent draw from every row (inverse CDF, vectorised)."""
    cdf = np.cumsum(rows, axis=1)
    u = rng.random(rows.shape[0]) * cdf[:, -1]
    return np.minimum((cdf <= u[:, None]).sum(axis=1), rows.shape[1] - 1)


@dataclass(frozen=True)
class ClusteredParams:
    warmup_rounds: int | None = None  # rounds of random selection without replacement first (default 0)
    ward_rows_as_features: bool | None = None  # Ward on the rows of the distance matrix, not on the distances
    # Aggregator side: similarities from count sketches of this many buckets instead of the full updates (0 = exact).
    sketch_dim: int | None = None

    def validate(self, path: str) -> None:
        check_at_least(self, ("warmup_rounds", "sketch_dim"), 0, path)


class ClusteredSampler(Sampler):
    Params = ClusteredParams
    needs_similarity = True

    @classmethod
    def similarity_sketch_dim(cls, params: ClusteredParams) -> int:
        return params.sketch_dim or 0

    def select(self, request: SelectionInput, state: RunState) -> SelectionOutput:
        p = request.params
        cands, k = request.candidates, request.num_to_select
        rng = round_rng(request.seed, request.round)
        # Fraboni's algorithm needs no warm-up: zero updates are all at distance 0.
        if (warm := warmup_selection(request, p.warmup_rounds or 0)) is not None:
            return warm
        similarity = require_similarity(request, "clustered_sampling")
        sizes = request.candidate_num_samples
        shares = data_sizes(sizes) if sizes is not None else np.ones(cands.size)
        shares = shares / shares.sum()
        labels = mass_capped_clusters(angles_from_gram(similarity), shares, k, bool(p.ward_rows_as_features))
        picks = draw_one_per_row(sampling_distributions(labels, shares, k, rng), rng)
        return SelectionOutput(selected=tuple(cands[picks].tolist()), cluster_of_selected=tuple(labels[picks].tolist()))
