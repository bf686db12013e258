"""Fairness metrics over per-client results: the one implementation every service and experiment uses.

Definitions follow shared/specs: seed-fedeba.md §5 (variance, worst/best 5%, C_v, angle, KL), seed-fedfdp.md §5 (Ψ)
and seed-equitable.md §5 (client disagreement, NMI). Accuracies are in percent unless stated otherwise.
`psi_telemetry` and `weight_entropy_metrics` are the per-round strategy metrics (RoundEvent.strategy_metrics) built
from them: the engine reports the first for every strategy, each strategy the second for its own weights.

Conventions for degenerate inputs, chosen so that "all clients equal" always reads as perfectly fair:
- Jain's index of an all-equal vector is 1.0, including the all-zero vector (where the formula is 0/0).
- C_v and the loss angle of an all-equal vector are 0.0, including the all-zero vector.
- C_v with mean 0 but non-zero spread (possible only with mixed signs) is +inf.
- Client disagreement over a single client is 0.0 (the paper's C(r, 2) is 0 there).
Empty or non-finite inputs raise ValueError naming the metric; degenerate outputs never raise or warn.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sklearn.metrics import normalized_mutual_info_score

__all__ = [
    "FairnessReport",
    "best_fraction",
    "client_disagreement",
    "coefficient_of_variation",
    "fairness_report",
    "jain_index",
    "kl_to_uniform",
    "loss_angle_degrees",
    "mean_accuracy",
    "nmi",
    "pooled_accuracy",
    "psi",
    "psi_telemetry",
    "std",
    "variance",
    "weight_entropy",
    "weight_entropy_metrics",
    "worst_fraction",
]


def _vector(values: ArrayLike, metric: str) -> NDArray[np.float64]:
    """Validate one per-client vector: 1-D, non-empty, finite. Errors name the metric so a log line is actionable."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim == 0:
        x = x.reshape(1)
    if x.ndim != 1:
        raise ValueError(f"{metric}: expected a 1-D sequence of per-client values, got shape {x.shape}")
    if x.size == 0:
        raise ValueError(f"{metric}: no values given")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{metric}: values must be finite (got NaN or inf)")
    return x


def _distribution(weights: ArrayLike, metric: str) -> NDArray[np.float64]:
    """Normalise non-negative weights to a probability vector."""
    w = _vector(weights, metric)
    if np.any(w < 0):
        raise ValueError(f"{metric}: weights must be non-negative")
    total = w.sum()
    if total <= 0:
        raise ValueError(f"{metric}: weights must have a positive sum")
    return w / total


def _tail_size(m: int, fraction: float, metric: str) -> int:
    if not 0 < fraction <= 1:
        raise ValueError(f"{metric}: fraction must be in (0, 1], got {fraction}")
    # The small slack keeps products like 0.07 * 100 = 7.000000000000001 from rounding up to 8.
    return max(1, math.ceil(fraction * m - 1e-9))


def mean_accuracy(accuracies: ArrayLike) -> float:
    """Unweighted mean over clients (every client counts once, whatever its size)."""
    return float(_vector(accuracies, "mean_accuracy").mean())


def pooled_accuracy(accuracies: ArrayLike, num_samples: ArrayLike) -> float:
    """Σ n_i acc_i / Σ n_i: the global model's accuracy on the union of the client test sets (seed-fedfdp.md §5)."""
    acc = _vector(accuracies, "pooled_accuracy")
    p = _distribution(num_samples, "pooled_accuracy")
    if p.shape != acc.shape:
        raise ValueError(f"pooled_accuracy: {acc.size} accuracies but {p.size} sample counts")
    return float(p @ acc)


def variance(values: ArrayLike) -> float:
    """Population variance (1/m) over all m clients, FedEBA+ Definition 3.1 (seed-fedeba.md §5)."""
    return float(_vector(values, "variance").var())


def std(values: ArrayLike) -> float:
    """Population standard deviation (1/m), the square root of `variance`."""
    return float(_vector(values, "std").std())


def worst_fraction(values: ArrayLike, fraction: float) -> float:
    """Mean of the lowest ceil(fraction·m) values, at least one (q-FFL convention, seed-fedeba.md §5)."""
    x = _vector(values, "worst_fraction")
    k = _tail_size(x.size, fraction, "worst_fraction")
    return float(np.partition(x, k - 1)[:k].mean())


def best_fraction(values: ArrayLike, fraction: float) -> float:
    """Mean of the highest ceil(fraction·m) values, at least one."""
    x = _vector(values, "best_fraction")
    k = _tail_size(x.size, fraction, "best_fraction")
    return float(np.partition(x, x.size - k)[x.size - k :].mean())


def jain_index(values: ArrayLike) -> float:
    """Jain's index (Σx)² / (m·Σx²) in [1/m, 1]; 1.0 for all-equal values including all zeros (0/0)."""
    x = _vector(values, "jain_index")
    if np.any(x < 0):
        raise ValueError("jain_index: values must be non-negative")
    sum_sq = float(np.dot(x, x))
    if sum_sq == 0.0:
        return 1.0
    return float(x.sum() ** 2 / (x.size * sum_sq))


def coefficient_of_variation(values: ArrayLike) -> float:
    """std / mean (population std). 0.0 when all values are equal (including all zero); +inf if mean is 0 but not std.

    FedEBA+ Table 18/19 divides by the global (pooled) accuracy instead of the client mean; the two coincide when
    clients are weighted equally. Use `std(a) / pooled_accuracy(a, n)` for the paper's variant.
    """
    x = _vector(values, "coefficient_of_variation")
    s, mu = float(x.std()), float(x.mean())
    if s == 0.0:
        return 0.0
    if mu == 0.0:
        return math.inf
    return s / mu


def loss_angle_degrees(values: ArrayLike) -> float:
    """Angle in degrees between the per-client vector and the all-ones vector, arccos(<L,1> / (‖L‖·√m)).

    q-FFL's cosine metric (seed-fedeba.md §5). For non-negative L it equals degrees(arctan(C_v)). The zero vector
    is treated as all-equal: 0.0.
    """
    x = _vector(values, "loss_angle_degrees")
    norm = float(np.linalg.norm(x))
    if norm == 0.0:
        return 0.0
    # Clip: rounding can push an all-equal vector's cosine a hair above 1.
    cosine = np.clip(x.sum() / (norm * math.sqrt(x.size)), -1.0, 1.0)
    return float(np.degrees(np.arccos(cosine)))


def psi(losses: ArrayLike, weights: ArrayLike, global_loss: float | None = None) -> float:
    """FedFDP's Ψ = Σ p_i (F_i − F)², p normalised, F = Σ p_i F_i unless given (seed-fedfdp.md §5, Eq. 7).

    With F left as None this is the p-weighted variance, matching the reference code's `weighted_variance`.
    """
    f = _vector(losses, "psi")
    p = _distribution(weights, "psi")
    if p.shape != f.shape:
        raise ValueError(f"psi: {f.size} losses but {p.size} weights")
    if global_loss is None:
        centre = float(p @ f)
    else:
        centre = float(global_loss)
        if not math.isfinite(centre):
            raise ValueError("psi: global_loss must be finite")
    return float(p @ (f - centre) ** 2)


def client_disagreement(losses: ArrayLike, unordered: bool = False) -> float:
    """Equitable-FL client disagreement, seed-equitable.md §5 (paper eq. 9), over the r participating clients.

    Literal form (default): CD = Σ_{i∈S} Σ_{j∈S} |f_i − f_j| / C(r, 2), the double sum over ordered pairs, which is
    twice the mean absolute pairwise gap. `unordered=True` sums over i < j only (the spec's `cd_unordered` flag),
    giving the mean absolute pairwise gap. A single client has no pairs: 0.0.
    """
    f = np.sort(_vector(losses, "client_disagreement"))
    r = f.size
    if r < 2:
        return 0.0
    # For sorted f, Σ_{i<j} (f_j − f_i) = Σ_k f_k·(2k − r + 1) with 0-based k: O(r log r), no r×r matrix.
    unordered_sum = float(f @ (2.0 * np.arange(r) - r + 1.0))
    pairs = r * (r - 1) / 2.0
    total = unordered_sum if unordered else 2.0 * unordered_sum
    return total / pairs


def weight_entropy(weights: ArrayLike) -> float:
    """Shannon entropy (natural log) of the normalised weights, with 0·log 0 = 0; log m for uniform weights."""
    p = _distribution(weights, "weight_entropy")
    nz = p[p > 0]
    return float(-(nz @ np.log(nz)))


class ReportsLosses(Protocol):
    """What `psi_telemetry` reads of a client's training result (fairfl.protocol.ClientResult has it); NaN = not
    reported."""

    num_samples: int
    loss_before: float
    loss_after: float
    noisy_loss: float


# The Ψ telemetry forms (seed-fedfdp.md §9.13 asks for both the local and the global models' forms): metric name and
# the ClientResult loss it is taken over.
PSI_FORMS = (("psi", "loss_after"), ("psi_before", "loss_before"), ("psi_noisy", "noisy_loss"))


def psi_telemetry(results: Iterable[ReportsLosses]) -> dict[str, float]:
    """Ψ of a round's training results, the telemetry the engine reports for every strategy:
      psi        = Σ p_i (F_i(x_{t,K}^i) − F)², the local models' losses (loss_after), the paper tables' Ψ;
      psi_before = Σ p_i (F_i(x_t) − F)², the global model's losses (loss_before), Eq. 7 at x_t;
      psi_noisy  = the same over the clients' noisy loss releases F̃_i (DP runs; post-processing, so always private);
    with p_i = n_i / Σ n over the clients that reported that loss (renormalised among them) and F the p-weighted mean
    of the same losses. A form no client reported (losses not measured, or withheld under DP-SGD without
    privacy.plaintext_telemetry) is left out, not NaN.
    """
    results = list(results)
    metrics = {}
    for key, field_name in PSI_FORMS:
        pairs = [(getattr(r, field_name), r.num_samples) for r in results]
        reported = [(loss, n) for loss, n in pairs if math.isfinite(loss)]
        if reported:
            metrics[key] = psi([v for v, _ in reported], [n for _, n in reported])
    return metrics


def weight_entropy_metrics(weights: Sequence[float]) -> dict[str, float]:
    """{"weight_entropy": H(p)} of a strategy's aggregation weights this round; empty when they sum to 0 (no weight
    went anywhere, e.g. q-FFL with every loss 0)."""
    return {"weight_entropy": weight_entropy(weights)} if sum(weights) > 0 else {}


def kl_to_uniform(values: ArrayLike) -> float:
    """q-FFL's entropy metric KL(â ‖ u) = Σ â_i log(m·â_i) with â = a / Σa (natural log, seed-fedeba.md §5)."""
    p = _distribution(values, "kl_to_uniform")
    nz = p[p > 0]
    # Clamp: for near-uniform vectors rounding can give -1e-17, and a divergence is never negative.
    return max(0.0, float(nz @ np.log(p.size * nz)))


def nmi(true_groups: ArrayLike, found_clusters: ArrayLike) -> float:
    """Normalized mutual information (sklearn, arithmetic normalisation) of found clusters vs. true group labels.

    Invariant to relabelling: a perfect clustering scores 1.0 whatever ids the clusters get (seed-equitable.md §5).
    """
    truth, found = np.asarray(true_groups), np.asarray(found_clusters)
    if truth.ndim != 1 or found.ndim != 1:
        raise ValueError("nmi: labels must be 1-D sequences")
    if truth.size == 0:
        raise ValueError("nmi: no labels given")
    if truth.shape != found.shape:
        raise ValueError(f"nmi: {truth.size} true labels but {found.size} cluster labels")
    return float(normalized_mutual_info_score(truth, found))


@dataclass(frozen=True)
class FairnessReport:
    """Per-round fairness summary over every evaluated client. Accuracies in %, variance in %²."""

    mean: float
    variance: float
    std: float
    worst_5: float
    worst_10: float
    best_5: float
    best_10: float
    jain_index: float
    cv: float
    weighted_accuracy: float
    mean_loss: float
    loss_variance: float
    evaluated_clients: int
    missing_clients: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fairness_report(
    accuracies_pct: ArrayLike,
    losses: ArrayLike | None = None,
    num_samples: ArrayLike | None = None,
    missing_clients: int = 0,
) -> FairnessReport:
    """Summarise per-client test accuracies (in %) and optionally losses.

    weighted_accuracy is the pooled accuracy Σ n_i acc_i / Σ n_i (the mean when num_samples is None);
    mean_loss and loss_variance are NaN when losses is None. missing_clients counts clients that were due to be
    evaluated but returned nothing, so a report over a partial population says so.
    """
    acc = np.asarray(accuracies_pct, dtype=np.float64)
    if acc.size == 0:
        raise ValueError("no client accuracies to report on")
    acc = _vector(acc, "accuracies_pct")
    if np.any((acc < 0) | (acc > 100)):
        raise ValueError("accuracies_pct: accuracies must be percentages in [0, 100]")
    m = acc.size

    weighted = float(acc.mean()) if num_samples is None else pooled_accuracy(acc, num_samples)

    if losses is None:
        mean_loss = loss_var = math.nan
    else:
        loss = _vector(losses, "losses")
        if loss.size != m:
            raise ValueError(f"losses: {loss.size} losses but {m} accuracies")
        mean_loss, loss_var = float(loss.mean()), float(loss.var())

    if isinstance(missing_clients, bool) or not isinstance(missing_clients, (int, np.integer)) or missing_clients < 0:
        raise ValueError(f"missing_clients must be a non-negative integer, got {missing_clients!r}")

    return FairnessReport(
        mean=float(acc.mean()),
        variance=float(acc.var()),
        std=float(acc.std()),
        worst_5=worst_fraction(acc, 0.05),
        worst_10=worst_fraction(acc, 0.10),
        best_5=best_fraction(acc, 0.05),
        best_10=best_fraction(acc, 0.10),
        jain_index=jain_index(acc),
        cv=coefficient_of_variation(acc),
        weighted_accuracy=weighted,
        mean_loss=mean_loss,
        loss_variance=loss_var,
        evaluated_clients=int(m),
        missing_clients=int(missing_clients),
    )
