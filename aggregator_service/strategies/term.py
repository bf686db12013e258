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

from aggregator_service.strategies.fedfair import require_finite
from fairfl.fold import ResultFold, softmax_weighted
from fairfl.metrics.fairness import weight_entropy_metrics
from fairfl.protocol import TRAIN, UPDATE, ClientResult
from fairfl.strategy import (
    AggregateOutcome,
    PhasePlan,
    RoundContext,
    Strategy,
    phase_folds,
    train_phase,
)


@dataclass
class TERMParams:
    tilt: float = 1.0  # t; FedEBA+ grid {0.1, 0.5, 0.8, 1, 5}; any sign allowed

    def validate(self, path: str) -> None:
        require_finite(path, tilt=self.tilt)


class TERM(Strategy):
    name = "term"
    Params = TERMParams

    def _tilted(self, ctx: RoundContext) -> ResultFold:
        """softmax(t·F_i(x_t)) over the updates, streamed with a running log-sum-exp (fairfl/fold.py)."""
        tilt = self.params.tilt
        return softmax_weighted(ctx.params.numel(), UPDATE, lambda result: tilt * result.loss_before)

    def folds(self, ctx: RoundContext, phase_index: int, plan: PhasePlan) -> list[ResultFold]:
        return [self._tilted(ctx)] if plan.phase == TRAIN else []

    def aggregate(self, ctx: RoundContext, phases: Sequence[list[ClientResult]]) -> AggregateOutcome:
        index = train_phase(phases)
        results = phases[index]
        (fold,) = phase_folds(ctx, phases, index, lambda: [self._tilted(ctx)])
        by_client = fold.weights_by_client()
        weights = [by_client[r.client_id] for r in results]
        return AggregateOutcome(
            params=ctx.params + self.server_lr * fold.sum.weighted_mean(),
            weights=by_client,
            metrics=weight_entropy_metrics(weights),
        )
