"""FedMGDA+ (Hu, Wang, Lin, Zhang, Yu, "Federated Learning Meets Multi-objective Optimization", IEEE TNSE 2022).

Every client's update is one objective; the server moves along a common direction, the minimum-norm point of the
convex hull of the (normalised) updates, kept within ε of uniform averaging:
    d_i = Δ_i / ‖Δ_i‖                      (`normalize`; d_i = 0 when Δ_i = 0)
    λ*  = argmin_λ ‖Σ_i λ_i d_i‖² = λᵀ G λ,  G = D Dᵀ,
          s.t. Σ λ_i = 1, λ_i ≥ 0, |λ_i − 1/m| ≤ ε
    x_{t+1} = x_t + server_lr · Σ_i λ*_i d_i
ε = 0 is uniform averaging of the d_i, ε ≥ 1 − 1/m is unconstrained MGDA (the min-norm element of the hull).
With normalisation the step length is at most server_lr, so server_lr is the paper's global step size η.
G is one m×m matmul of the stacked updates (in float64: m·d·8 bytes, fine for m up to a few hundred); the QP is a
small deterministic solver: accelerated projected gradient (FISTA with adaptive restart) on the capped simplex, with
an exact breakpoint projection.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from aggregator_service.strategies.fedfair import require_finite
from fairfl.metrics.fairness import weight_entropy_metrics
from fairfl.protocol import UPDATE, ClientResult
from fairfl.strategy import AggregateOutcome, RoundContext, Strategy, train_results, weighted_sum

QP_MAX_ITER = 20_000
QP_TOL = 1e-12


@dataclass
class FedMGDAParams:
    epsilon: float = 0.1  # FedEBA+ grid {0, 0.03, 0.08, 0.1, 1.0}
    normalize: bool = True

    def validate(self, path: str) -> None:
        from fairfl.schema import ConfigError

        require_finite(path, epsilon=self.epsilon)
        if not 0.0 <= self.epsilon <= 1.0:
            raise ConfigError(f"{path}.epsilon: must be in [0, 1] (1 = unconstrained MGDA), got {self.epsilon}")


def project_capped_simplex(y: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Euclidean projection onto {λ : Σλ = 1, lo ≤ λ_i ≤ hi} (needs lo < hi and m·lo ≤ 1 ≤ m·hi).

    The projection is clip(y − τ, lo, hi) with τ solving g(τ) = Σ clip(y_i − τ, lo, hi) = 1. g is continuous,
    non-increasing and linear between the knots y_i − hi and y_i − lo, so g at every knot (O(m log m) with sorted y and
    prefix sums) brackets τ, and linear interpolation inside the bracket is exact.
    """
    s = np.sort(y)
    prefix = np.concatenate([[0.0], np.cumsum(s)])
    knots = np.sort(np.concatenate([y - hi, y - lo]))
    n_lo = np.searchsorted(s, knots + lo, side="right")  # y_i ≤ τ + lo: clipped to lo
    n_below_hi = np.searchsorted(s, knots + hi, side="left")  # y_i ≥ τ + hi (the rest): clipped to hi
    n_mid = n_below_hi - n_lo
    g = n_lo * lo + (s.size - n_below_hi) * hi + (prefix[n_below_hi] - prefix[n_lo]) - n_mid * knots
    k = int(np.searchsorted(-g, -1.0, side="left"))  # first knot with g ≤ 1 (−g is non-decreasing)
    if k == 0:
        tau = knots[0]
    elif k == knots.size:
        tau = knots[-1]
    else:
        g0, g1 = g[k - 1], g[k]
        tau = knots[k - 1] + (g0 - 1.0) * (knots[k] - knots[k - 1]) / (g0 - g1)
    return np.clip(y - tau, lo, hi)


def min_norm_weights(gram: np.ndarray, epsilon: float) -> tuple[np.ndarray, int]:
    """argmin λᵀGλ over the simplex with |λ_i − 1/m| ≤ ε; returns (λ, iterations). Deterministic."""
    m = gram.shape[0]
    uniform = np.full(m, 1.0 / m)
    lo, hi = max(0.0, 1.0 / m - epsilon), min(1.0, 1.0 / m + epsilon)
    top = float(np.linalg.eigvalsh(gram)[-1]) if m > 1 else 0.0
    if m == 1 or hi - lo <= 0.0 or top <= 0.0:
        return uniform, 0
    step = 1.0 / (2.0 * top)  # ∇(λᵀGλ) = 2Gλ is 2‖G‖-Lipschitz
    x = uniform
    y = x.copy()
    t = 1.0
    iterations = 0
    while iterations < QP_MAX_ITER:
        iterations += 1
        x_new = project_capped_simplex(y - step * 2.0 * (gram @ y), lo, hi)
        converged = float(np.abs(x_new - y).max()) <= QP_TOL  # gradient mapping at y vanishes: optimal
        if float(np.dot(y - x_new, x_new - x)) > 0.0:
            # Momentum points uphill: restart (O'Donoghue & Candès 2015), which keeps FISTA monotone-ish and linear
            # on strongly convex problems.
            t, y = 1.0, x_new.copy()
        else:
            t_next = (1.0 + math.sqrt(1.0 + 4.0 * t * t)) / 2.0
            y = x_new + ((t - 1.0) / t_next) * (x_new - x)
            t = t_next
        x = x_new
        if converged:
            break
    return x, iterations


class FedMGDAPlus(Strategy):
    name = "fedmgda_plus"
    reads_client_losses = False  # F_i feed only the engine's Ψ telemetry (training.loss_telemetry)
    Params = FedMGDAParams

    def aggregate(self, ctx: RoundContext, phases: Sequence[list[ClientResult]]) -> AggregateOutcome:
        results = train_results(phases)
        updates = [r.payloads[UPDATE] for r in results]
        stacked = torch.stack(updates).double()
        gram = (stacked @ stacked.T).numpy()  # Δ_i·Δ_j, one matmul
        del stacked
        norms = np.sqrt(np.clip(np.diag(gram), 0.0, None))
        if self.params.normalize:
            inv = np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0)  # zero update → d_i = 0
            gram = gram * np.outer(inv, inv)
        else:
            inv = np.ones_like(norms)
        lam, iterations = min_norm_weights(gram, self.params.epsilon)
        # Σ λ_i d_i = Σ (λ_i / ‖Δ_i‖) Δ_i: fold the raw updates, no normalised copies.
        step = weighted_sum(updates, (lam * inv).tolist())
        weights = lam.tolist()
        metrics = weight_entropy_metrics(weights)
        metrics["direction_norm"] = math.sqrt(max(float(lam @ gram @ lam), 0.0))
        metrics["qp_iterations"] = float(iterations)
        return AggregateOutcome(
            params=ctx.params + self.server_lr * step,
            weights={r.client_id: w for r, w in zip(results, weights, strict=True)},
            metrics=metrics,
        )
