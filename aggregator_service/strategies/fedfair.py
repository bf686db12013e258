"""FedFair (FedFDP paper, Algorithm 1, non-DP; shared/specs/seed-fedfdp.md §1.2).

The server keeps the global loss F and broadcasts it with the model; clients scale their step size by
max(0, 1 + λ(F_i − F)) (Eq. 11, done in client_agent/trainer.py via `fair_step`). Aggregation is plain FedAvg with
p_i = n_i / Σ n (Alg. 1 line 7), and F is refreshed from the clients' post-training losses (line 8):
F ← Σ p_i F_i(w_{t+1}^i), F_i on local *training* data, i.e. ClientResult.loss_after. F starts at
`initial_global_loss` = 0.0 (spec §9.11, the reference code's Initial()). λ = 0 is FedAvg bit for bit.

With privacy.enabled this is FedFDP (Algorithm 2): the engine puts DP-SGD into every task, λ goes into the clients'
fair clipping coefficient min(max(1 + λΔ_i^j, 0), C/‖g‖) (Eq. 15) and F is aggregated from the noisy losses F̃_i.

Ψ telemetry (psi, psi_before, psi_noisy: fairfl.metrics.fairness.psi_telemetry) is the engine's, for every strategy;
FedFair's own non-DP `psi` replaces the telemetry form: Eq. 7, Σ p_i (F_i(w_{t+1}^i) − F)² around the F it keeps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fairfl.fold import ResultFold, sample_weighted
from fairfl.metrics.fairness import psi, weight_entropy_metrics
from fairfl.protocol import TRAIN, ClientResult
from fairfl.strategy import (
    AggregateOutcome,
    PhasePlan,
    RoundContext,
    Strategy,
    phase_folds,
    train_phase,
)
from fairfl.v1 import federation_pb2


def require_finite(path: str, **values: float) -> None:
    from fairfl.schema import ConfigError

    for name, value in values.items():
        if not math.isfinite(value):
            raise ConfigError(f"{path}.{name}: must be a finite number, got {value}")


@dataclass
class FedFairParams:
    fair_lambda: float = 0.1  # spec §1.2: the paper never states λ; the reference code's default is 0.1
    initial_global_loss: float = 0.0  # F(w_0), spec §9.11

    def validate(self, path: str) -> None:
        from fairfl.schema import ConfigError

        require_finite(path, fair_lambda=self.fair_lambda, initial_global_loss=self.initial_global_loss)
        if self.fair_lambda < 0:
            raise ConfigError(f"{path}.fair_lambda: must be >= 0 (paper §4), got {self.fair_lambda}")
        if self.initial_global_loss < 0:
            raise ConfigError(f"{path}.initial_global_loss: a loss is >= 0, got {self.initial_global_loss}")


class FedFair(Strategy):
    name = "fedfair"
    privacy_principals = frozenset({"client"})  # FedFDP (Algorithm 2): DP-SGD with fair clipping
    needs_loss_release_under_dp = True  # F is aggregated from the clients' noisy losses
    Params = FedFairParams

    def __init__(self, params: FedFairParams, server_lr: float) -> None:
        super().__init__(params, server_lr)
        self.global_loss = params.initial_global_loss

    def configure(self, ctx: RoundContext, phase_index: int, prior: Sequence[list[ClientResult]]) -> PhasePlan | None:
        if phase_index > 0:
            return None
        cfg = federation_pb2.LocalTrainingConfig()
        cfg.CopyFrom(ctx.train_config)
        cfg.fair_step.SetInParent()  # present even when both values are 0
        cfg.fair_step.global_loss = self.global_loss
        cfg.fair_step.fair_lambda = self.params.fair_lambda
        if cfg.HasField("dp"):  # FedFDP: λ enters the per-sample clipping coefficient (Eq. 15), not the step size
            cfg.dp.fair_lambda = self.params.fair_lambda
        return PhasePlan(phase=TRAIN, train=cfg)

    def folds(self, ctx: RoundContext, phase_index: int, plan: PhasePlan) -> list[ResultFold]:
        return [sample_weighted(ctx.params.numel())] if plan.phase == TRAIN else []

    def aggregate(self, ctx: RoundContext, phases: Sequence[list[ClientResult]]) -> AggregateOutcome:
        index = train_phase(phases)
        results = phases[index]
        # Alg. 1 line 7: the same arithmetic as FedAvg, so λ = 0 reproduces FedAvg bit for bit.
        (fold,) = phase_folds(ctx, phases, index, lambda: [sample_weighted(ctx.params.numel())])
        delta = fold.sum.weighted_mean()
        by_client = fold.weights_by_client()
        weights = [by_client[r.client_id] for r in results]
        metrics = weight_entropy_metrics(weights)
        if ctx.train_config.HasField("dp"):
            # FedFDP Alg. 2 line 8: F(w_{t+1}) = Σ p_i F̃_i, the clients' noisy losses (post-processing of DP
            # releases, so it may be broadcast). Ψ stays the engine's telemetry form (loss_after around its own mean).
            released = [(w, r.noisy_loss) for w, r in zip(weights, results, strict=True) if math.isfinite(r.noisy_loss)]
            if released:  # a client that released no loss is left out, p renormalised over the others
                mass = math.fsum(w for w, _ in released)
                self.global_loss = math.fsum(w * f for w, f in released) / mass
        else:
            # Alg. 1 line 8: F(w_{t+1}) = Σ p_i F_i(w_{t+1}^i), the post-training losses.
            self.global_loss = math.fsum(w * r.loss_after for w, r in zip(weights, results, strict=True))
            metrics["psi"] = psi([r.loss_after for r in results], weights, global_loss=self.global_loss)  # Eq. 7
        metrics["global_loss"] = self.global_loss
        return AggregateOutcome(
            params=ctx.params + self.server_lr * delta,
            weights=by_client,
            metrics=metrics,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"global_loss": self.global_loss}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_loss = float(state.get("global_loss", self.params.initial_global_loss))
