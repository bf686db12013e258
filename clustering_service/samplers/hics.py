"""HiCS-FL: heterogeneity-guided client sampling (Chen & Vikalo, NeurIPS 2024; spec seed-hicsfl.md §1).

Per round t, over all candidates N (Algorithm 1):
- t ≤ warm-up (⌈N/K⌉ by default): random selection without replacement, every client once (`warmup_block`).
- otherwise, from each client's latest reported output-bias update Δb (zeros if it never reported one):
  Ĥ = H(softmax(Δb/T)) (Eq. 7); distance arccos(cos(Δb_u, Δb_k)) + λ|Ĥ_u − Ĥ_k| (Eq. 9); Ward clustering of all
  candidates into M groups (M = K by default); cluster m drawn with π ∝ exp(γ_t·mean Ĥ of m), γ_t = γ0(1 − t/𝒯)
  (Eq. 10); a client of the drawn cluster ∝ its data size; repeated until K distinct clients. The repeated draw
  with redraws of chosen clients is sampling without replacement with per-client weight π_m·p_k/P_m, done here in
  one pass by Gumbel-top-K (identical distribution, no loop).
Code-parity options (§1.12): `ward_rows_as_features`, `uniform_within_cluster`, `freeze_after_warmup`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray
from scipy.special import logsumexp

from clustering_service.samplers.base import (
    check_at_least,
    check_finite,
    data_sizes,
    gumbel_top_k,
    round_rng,
    warmup_selection,
)
from clustering_service.samplers.hierarchy import HicsGeometry, entropy_estimate, ward_clusters
from fairfl.sampling import InvalidInput, RunState, Sampler, SelectionInput, SelectionOutput
from fairfl.schema import ConfigError

if TYPE_CHECKING:
    from fairfl.config import ExperimentConfig

# Paper defaults (seed-hicsfl.md §1.10, FMNIST): T, λ, γ0; exact Ward up to this many clients.
DEFAULT_TEMPERATURE = 0.0025
DEFAULT_LAMBDA = 10.0
DEFAULT_GAMMA0 = 4.0
DEFAULT_MAX_WARD_POINTS = 2000
_FROZEN = "hics_frozen"  # sampler_state key of the bias updates frozen after the warm-up


def default_warmup(num_candidates: int, count: int) -> int:
    return math.ceil(num_candidates / count)


def annealed_gamma(gamma0: float, round_number: int, total_rounds: int) -> float:
    """γ_t = γ0(1 − t/𝒯), held at 0 after round 𝒯."""
    return gamma0 * max(0.0, 1.0 - round_number / total_rounds)


def cluster_log_probabilities(labels: NDArray[np.int64], entropies: NDArray[np.float64], gamma: float) -> NDArray:
    """log π over the clusters present: log softmax(γ·H̄_m), H̄_m the mean Ĥ of cluster m (Eq. 10)."""
    counts = np.bincount(labels)
    mean_h = np.bincount(labels, weights=entropies) / counts
    logits = gamma * mean_h
    return logits - logsumexp(logits)


@dataclass(frozen=True)
class HicsParams:
    """None = the paper's value (seed-hicsfl.md §1.10)."""

    temperature: float | None = None  # T of softmax(Δb/T); default 0.0025
    lambda_entropy: float | None = None  # λ of the distance; default 10
    gamma0: float | None = None  # γ0 of γ_t = γ0(1 − t/𝒯); default 4
    num_clusters: int | None = None  # M; None or 0 = the number selected per round (the paper's M = K)
    # 𝒯: the run's rounds (supplied by the aggregator through run_params, never configured).
    total_rounds: int | None = None
    warmup_rounds: int | None = None  # random rounds without replacement first; default ⌈N/K⌉
    # Code-parity options (§1.12): Ward on the distance rows as features, clients of a cluster equally likely instead
    # of ∝ data size, bias updates frozen after the warm-up.
    ward_rows_as_features: bool | None = None
    uniform_within_cluster: bool | None = None
    freeze_after_warmup: bool | None = None
    # Exact Ward up to this many clients; above, Ward on this many representatives (samplers/hierarchy.py).
    max_ward_points: int | None = None

    def validate(self, path: str) -> None:
        check_finite(self, ("temperature",), path, positive=True)
        check_finite(self, ("lambda_entropy", "gamma0"), path)
        check_at_least(self, ("num_clusters", "warmup_rounds"), 0, path)
        check_at_least(self, ("total_rounds",), 1, path)
        check_at_least(self, ("max_ward_points",), 2, path)


class HicsSampler(Sampler):
    Params = HicsParams
    client_signatures = frozenset({"bias_update"})  # clients' output-layer bias updates Δb

    @classmethod
    def validate_run(cls, params: HicsParams, cfg: ExperimentConfig) -> None:
        if params.total_rounds is not None:
            raise ConfigError("selection.params.total_rounds: set by the run (rounds), not a parameter to configure")
        n = cfg.data.num_clients
        if params.num_clusters is not None and params.num_clusters > n:
            raise ConfigError(f"selection.params.num_clusters: {params.num_clusters} exceeds data.num_clients = {n}")

    @classmethod
    def run_params(cls, params: HicsParams, cfg: ExperimentConfig) -> HicsParams:
        return replace(params, total_rounds=cfg.rounds)

    def select(self, request: SelectionInput, state: RunState) -> SelectionOutput:
        p = request.params
        if p.total_rounds is None:
            raise InvalidInput("params.total_rounds is required for hics (γ_t = γ0(1 − t/total_rounds))")
        cands, k = request.candidates, request.num_to_select
        warmup = p.warmup_rounds if p.warmup_rounds is not None else default_warmup(cands.size, k)
        if (warm := warmup_selection(request, warmup)) is not None:
            return warm
        bias, sizes = self._signatures(request, state, frozen=bool(p.freeze_after_warmup))
        entropies = entropy_estimate(bias, p.temperature or DEFAULT_TEMPERATURE)
        lam = DEFAULT_LAMBDA if p.lambda_entropy is None else p.lambda_entropy
        geometry = HicsGeometry(bias, entropies, lam)
        n_clusters = min(p.num_clusters or k, cands.size)
        labels = ward_clusters(
            geometry,
            n_clusters,
            max_points=p.max_ward_points or DEFAULT_MAX_WARD_POINTS,
            rows_as_features=bool(p.ward_rows_as_features),
        )
        gamma0 = DEFAULT_GAMMA0 if p.gamma0 is None else p.gamma0
        log_pi = cluster_log_probabilities(labels, entropies, annealed_gamma(gamma0, request.round, p.total_rounds))
        if p.uniform_within_cluster:
            within = -np.log(np.bincount(labels)[labels])
        else:
            within = np.log(sizes) - np.log(np.bincount(labels, weights=sizes)[labels])
        picked = gumbel_top_k(log_pi[labels] + within, k, round_rng(request.seed, request.round))
        return SelectionOutput(
            selected=tuple(cands[picked].tolist()), cluster_of_selected=tuple(labels[picked].tolist())
        )

    @staticmethod
    def _signatures(
        request: SelectionInput, state: RunState, frozen: bool
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Latest Δb and data size of every candidate (Δb = 0 for clients that never reported; §1.11.2)."""
        cands = request.candidates
        if not frozen:
            bias, known, _ = state.gather("bias_update", cands)
        else:
            # Code parity (§1.12): the updates seen by the end of the warm-up, kept for the rest of the run.
            with state.lock:
                snapshot = state.sampler_state.get(_FROZEN)
                if snapshot is None:
                    everyone = np.fromiter(state.signatures(), dtype=np.int64)
                    everyone.sort()
                    bias_all, known_all, _ = state.gather("bias_update", everyone)
                    snapshot = state.sampler_state[_FROZEN] = (everyone, bias_all, known_all)
            ids, bias_all, known_all = snapshot
            if ids.size == 0:
                bias, known = np.zeros((cands.size, 1)), np.zeros(cands.size)
            else:
                pos = np.minimum(np.searchsorted(ids, cands), ids.size - 1)
                found = ids[pos] == cands
                bias, known = bias_all[pos] * found[:, None], known_all[pos] * found
        given = request.candidate_num_samples
        sizes = data_sizes(given if given is not None else known)
        return bias, sizes
