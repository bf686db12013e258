"""FedProx + FairFed, the model re-weighting baseline of Equitable-FL (seed-equitable.md §4.6; Ezzeldin et al.,
AAAI 2023). There are no sensitive attributes here, so FairFed's local fairness metric falls back to accuracy:

  Δ_i = |Acc_i(w_k) − Acc_global(w_k)|,  Acc_global = Σ_{S_k} N_i Acc_i / Σ_{S_k} N_i
  ω_i ← max(ω_i − β (Δ_i − mean_{S_k} Δ), 0)      (the Equitable-FL paper clips FairFed's negative weights at 0)
  w_{k+1} = w_k + Σ_{S_k} (ω_i / Σ_{S_k} ω_j) Δw_i

Acc_i(w_k) is the global model's accuracy on client i's local training data, measured by the client before training
(`accuracy_before`, a fraction here). ω starts at N_i / N for every client (FairFed's ω⁰). The server learns N_i
only when a client first participates, so N is estimated then as num_clients × the mean N_j of that round's
participants: exact when clients hold equal amounts, and ω stays on FairFed's scale (Σ ω ≈ 1) for β to act on.
β is not given by the paper: spec §4.6 takes 1 (tune over {0.1, 0.5, 1}).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

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

log = logging.getLogger(__name__)


@dataclass
class FairFedParams:
    beta: float = 1.0  # fairness budget β
    mu: float = 0.01  # FedProx μ, as for Equitable-FL

    def validate(self, path: str) -> None:
        from fairfl.schema import ConfigError

        require_finite(path, beta=self.beta, mu=self.mu)
        if self.beta < 0:
            raise ConfigError(f"{path}.beta: must be >= 0, got {self.beta}")
        if self.mu < 0:
            raise ConfigError(f"{path}.mu: must be >= 0, got {self.mu}")


def fairfed_update(
    omega: np.ndarray, accuracy: np.ndarray, num_samples: np.ndarray, beta: float
) -> tuple[np.ndarray, np.ndarray, float]:
    """One FairFed step over the round's participants: (new clipped ω, the gaps Δ, Acc_global). Accuracies in [0, 1]."""
    global_accuracy = float(num_samples @ accuracy / num_samples.sum())
    gaps = np.abs(accuracy - global_accuracy)
    return np.maximum(omega - beta * (gaps - gaps.mean()), 0.0), gaps, global_accuracy


class FairFed(Strategy):
    name = "fairfed"
    Params = FairFedParams

    def __init__(self, params: FairFedParams, server_lr: float) -> None:
        super().__init__(params, server_lr)
        self.omega: dict[int, float] = {}

    def configure(self, ctx: RoundContext, phase_index: int, prior: Sequence[list[ClientResult]]) -> PhasePlan | None:
        return fedprox_plan(ctx, self.params.mu) if phase_index == 0 else None

    def aggregate(self, ctx: RoundContext, phases: Sequence[list[ClientResult]]) -> AggregateOutcome:
        results = train_results(phases)
        missing = [r.client_id for r in results if "accuracy_before" not in r.metrics]
        if missing:
            raise RuntimeError(f"fairfed: clients {missing} reported no accuracy_before (their local Acc_i(w_k))")
        samples = np.array([r.num_samples for r in results], dtype=np.float64)
        accuracy = np.array([r.metrics["accuracy_before"] / 100.0 for r in results])
        population = ctx.num_clients or len(results)
        scale = population * samples.mean()  # N, estimated when a client first appears (see the module docstring)
        omega = np.array([self.omega.get(r.client_id, r.num_samples / scale) for r in results])
        omega, gaps, global_accuracy = fairfed_update(omega, accuracy, samples, self.params.beta)
        self.omega.update({r.client_id: float(w) for r, w in zip(results, omega, strict=True)})
        if omega.sum() > 0:
            weights = omega / omega.sum()
        else:  # every participant clipped to 0: nothing to normalise, so fall back to FedProx's sample weights
            log.warning("round %d: every participant's FairFed weight is 0; using sample-size weights", ctx.round)
            weights = samples / samples.sum()
        delta = weighted_sum([r.payloads[UPDATE] for r in results], weights.tolist())
        metrics = weight_entropy_metrics(weights.tolist())
        metrics["fairfed_global_accuracy"] = global_accuracy
        metrics["fairfed_mean_gap"] = float(gaps.mean())
        metrics["fairfed_zero_weights"] = float((omega == 0).sum())
        return AggregateOutcome(
            params=ctx.params + self.server_lr * delta,
            weights={r.client_id: float(w) for r, w in zip(results, weights, strict=True)},
            metrics=metrics,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"omega": dict(self.omega)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.omega = {int(k): float(v) for k, v in state.get("omega", {}).items()}
