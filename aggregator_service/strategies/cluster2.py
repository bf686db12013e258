"""FedProx + Cluster2, the clustered-sampling baseline of Equitable-FL (seed-equitable.md §4.3; Fraboni et al. 2021,
"Clustered sampling", Algorithm 2). Cluster2 changes *who* participates, not the cluster weighting: the clustering
service's clustered sampler (selection.method clustered_sampling: Ward clustering of the clients' representative
updates, one client drawn from each of m distributions) picks the round's clients, they train with FedProx, and the
server takes the simple average over the m draws, w_{k+1} = Σ_j (1/m) w^{l_j}: a client drawn twice counts twice.
The sampler itself lives in the clustering service (one implementation, shared with HiCS-FL's CS baseline); this
strategy is the FedProx local step and the draw-weighted average.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from aggregator_service.strategies.equitable import fedprox_plan
from aggregator_service.strategies.fedfair import require_finite
from fairfl.metrics.fairness import weight_entropy_metrics
from fairfl.protocol import UPDATE, ClientResult
from fairfl.strategy import (
    AggregateOutcome,
    PhasePlan,
    RoundContext,
    Strategy,
    train_results,
    weighted_sum,
)

REQUIRED_SELECTION = "clustered_sampling"


@dataclass
class Cluster2Params:
    mu: float = 0.01  # FedProx μ, as for Equitable-FL

    def validate(self, path: str) -> None:
        from fairfl.schema import ConfigError

        require_finite(path, mu=self.mu)
        if self.mu < 0:
            raise ConfigError(f"{path}.mu: must be >= 0, got {self.mu}")


def draw_weights(selected: Sequence[int], trained: Sequence[int]) -> list[float]:
    """1/m per draw: a client's weight is its number of draws over the draws of the clients that returned a model."""
    draws = Counter(selected)
    counts = [draws[c] for c in trained]
    if 0 in counts:
        raise RuntimeError(f"cluster2: clients {[c for c in trained if not draws[c]]} trained but were never drawn")
    total = sum(counts)
    return [count / total for count in counts]


class Cluster2(Strategy):
    name = "cluster2"
    # Cluster2 is a sampling method (Fraboni et al. Alg. 2): with any other selection it would silently be FedProx
    # with uniform weights.
    required_selection = REQUIRED_SELECTION
    reads_client_losses = False  # F_i feed only the engine's Ψ telemetry (training.loss_telemetry)
    Params = Cluster2Params

    def configure(self, ctx: RoundContext, phase_index: int, prior: Sequence[list[ClientResult]]) -> PhasePlan | None:
        return fedprox_plan(ctx, self.params.mu) if phase_index == 0 else None

    def aggregate(self, ctx: RoundContext, phases: Sequence[list[ClientResult]]) -> AggregateOutcome:
        results = train_results(phases)
        weights = draw_weights(ctx.selected, [r.client_id for r in results])
        delta = weighted_sum([r.payloads[UPDATE] for r in results], weights)
        return AggregateOutcome(
            params=ctx.params + self.server_lr * delta,
            weights={r.client_id: w for r, w in zip(results, weights, strict=True)},
            metrics=weight_entropy_metrics(weights),
        )
