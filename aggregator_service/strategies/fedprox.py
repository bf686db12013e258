"""FedProx (Li et al., MLSys 2020): each client minimises F_i(w) + (μ/2)‖w − x_t‖² locally; the server aggregates
exactly as FedAvg (sample-weighted updates, server lr and optional server momentum). The proximal term itself is
applied by the client trainer (`LocalTrainingConfig.prox_mu`); this strategy only sets μ for every training task."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aggregator_service.strategies.fedavg import FedAvg, FedAvgParams
from aggregator_service.strategies.fedfair import require_finite
from fairfl.protocol import TRAIN, ClientResult
from fairfl.strategy import PhasePlan, RoundContext
from fairfl.v1 import federation_pb2


@dataclass
class FedProxParams(FedAvgParams):
    mu: float = 0.01  # proximal coefficient μ; FedEBA+'s Tables 10/11 use 0.1, μ = 0 is FedAvg

    def validate(self, path: str) -> None:
        from fairfl.schema import ConfigError

        super().validate(path)
        require_finite(path, mu=self.mu)
        if self.mu < 0:
            raise ConfigError(f"{path}.mu: must be >= 0, got {self.mu}")


class FedProx(FedAvg):
    name = "fedprox"
    Params = FedProxParams
    privacy_principals = frozenset({"client"})  # DP-SGD with the proximal term; client-level DP is FedAvg's alone

    def configure(self, ctx: RoundContext, phase_index: int, prior: Sequence[list[ClientResult]]) -> PhasePlan | None:
        if phase_index > 0:
            return None
        cfg = federation_pb2.LocalTrainingConfig()
        cfg.CopyFrom(ctx.train_config)
        cfg.prox_mu = self.params.mu  # overrides training.prox_mu: the strategy owns μ
        return PhasePlan(phase=TRAIN, train=cfg)
