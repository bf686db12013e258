"""TERM with client-level tilting (Li, Beirami, Sanjabi, Smith, "Tilted Empirical Risk Minimization", ICLR 2021).

The tilted objective (1/t) log Σ_i exp(t F_i(x)) has gradient Σ_i p_i ∇F_i(x) with p_i ∝ exp(t F_i(x)), so the
server averages the round's updates with those tilted weights:
    p_i = exp(t F_i) / Σ_{j∈S} exp(t F_j)   (log-sum-exp),   x_{t+1} = x_t + server_lr · Σ_i p_i Δ_i,
with F_i = F_i(x_t) = loss_before over the round's clients S. t = 0 is uniform averaging, t → +∞ follows the worst
(highest-loss) client (min-max), t < 0 down-weights high-loss clients (robustness to outliers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from aggregator_service.strategies.base import AggregateOutcome, RoundContext, Strategy, train_results, weighted_sum
from aggregator_service.strategies.fedfair import loss_metrics, require_finite
from fairfl.protocol import UPDATE, ClientResult


@dataclass
class TERMParams:
    tilt: float = 1.0  # t; FedEBA+ grid {0.1, 0.5, 0.8, 1, 5}; any sign allowed

    def validate(self, path: str) -> None:
        require_finite(path, tilt=self.tilt)


def tilted_weights(losses: np.ndarray, tilt: float) -> np.ndarray:
    """softmax(t·F) in float64, shifted by the maximum so large |t·F| cannot overflow."""
    z = tilt * losses
    e = np.exp(z - z.max())
    return e / e.sum()


class TERM(Strategy):
    name = "term"
    Params = TERMParams

    def aggregate(self, ctx: RoundContext, phases: Sequence[list[ClientResult]]) -> AggregateOutcome:
        results = train_results(phases)
        losses = np.array([r.loss_before for r in results], dtype=np.float64)
        weights = tilted_weights(losses, self.params.tilt).tolist()
        step = weighted_sum([r.payloads[UPDATE] for r in results], weights)
        return AggregateOutcome(
            params=ctx.params + self.server_lr * step,
            weights={r.client_id: w for r, w in zip(results, weights, strict=True)},
            metrics=loss_metrics(results, weights),
        )
