"""FedAvg (McMahan et al. 2017): average of client updates weighted by sample count, with server lr and momentum."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fairfl.fold import ResultFold, sample_weighted
from fairfl.metrics.fairness import weight_entropy_metrics
from fairfl.protocol import TRAIN, ClientResult
from fairfl.schema import ConfigError
from fairfl.strategy import (
    AggregateOutcome,
    PhasePlan,
    RoundContext,
    Strategy,
    phase_folds,
    train_phase,
)

if TYPE_CHECKING:
    from fairfl.config import ExperimentConfig


@dataclass
class FedAvgParams:
    server_momentum: float = 0.0

    def validate(self, path: str) -> None:
        if not 0.0 <= self.server_momentum < 1.0:
            raise ConfigError(f"{path}.server_momentum: must be in [0, 1), got {self.server_momentum}")


class FedAvg(Strategy):
    name = "fedavg"
    reads_client_losses = False  # F_i feed only the engine's Ψ telemetry (training.loss_telemetry)
    Params = FedAvgParams
    # DP-FedAvg: record-level DP-SGD on the clients, or client-level DP where the engine's clipped noisy average
    # (aggregator_service/dp.py) replaces this weighted one.
    privacy_principals = frozenset({"client", "federation"})

    @classmethod
    def validate_run(cls, cfg: ExperimentConfig, params: Any) -> None:
        if cfg.privacy.enabled and cfg.privacy.principal == "federation" and params.server_momentum:
            # The client-level aggregate is the engine's (no momentum); a momentum setting would be silently ignored.
            raise ConfigError("strategy.params.server_momentum: must be 0 with privacy.principal federation")

    def __init__(self, params: FedAvgParams, server_lr: float) -> None:
        super().__init__(params, server_lr)
        self.velocity: torch.Tensor | None = None

    def folds(self, ctx: RoundContext, phase_index: int, plan: PhasePlan) -> list[ResultFold]:
        return [sample_weighted(ctx.params.numel())] if plan.phase == TRAIN else []

    def aggregate(self, ctx: RoundContext, phases: Sequence[list[ClientResult]]) -> AggregateOutcome:
        index = train_phase(phases)
        results = phases[index]
        (fold,) = phase_folds(ctx, phases, index, lambda: [sample_weighted(ctx.params.numel())])
        delta = fold.sum.weighted_mean()  # Σ n_i Δ_i / Σ n_i
        by_client = fold.weights_by_client()
        weights = [by_client[r.client_id] for r in results]
        if self.params.server_momentum > 0:
            if self.velocity is None:
                self.velocity = torch.zeros_like(delta)
            self.velocity.mul_(self.params.server_momentum).add_(delta)
            delta = self.velocity
        return AggregateOutcome(
            params=ctx.params + self.server_lr * delta,
            weights=by_client,
            metrics=weight_entropy_metrics(weights),  # Ψ is the engine's (psi_telemetry)
        )

    def state_dict(self) -> dict[str, Any]:
        return {"velocity": self.velocity}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.velocity = state.get("velocity")
