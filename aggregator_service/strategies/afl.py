"""Agnostic Federated Learning (Mohri, Sivek, Suresh, ICML 2019): min_x max_{λ∈Δ} Σ_i λ_i F_i(x).

The server keeps a mixture λ over *all* clients. Each round:
  1. aggregation weights are λ restricted to the round's clients S, renormalised: w_i = λ_i / Σ_{j∈S} λ_j, and
     x_{t+1} = x_t + server_lr · Σ_{i∈S} w_i Δ_i (the descent step on Σ λ_i F_i, estimated from S);
  2. ascent on λ, whose gradient is (F_i(x_t))_i: an exponentiated-gradient (entropic mirror ascent) step
     λ_i ← λ_i · exp(η_λ F_i) for i ∈ S, then λ ← λ / Σ λ over all clients. F_i = F_i(x_t) = loss_before.
Mohri et al. use projected gradient ascent; the mirror step keeps λ strictly inside the simplex without a projection
(a standard substitute for simplex-constrained ascent). η_λ is `lambda_lr`, the "λ" of FedEBA+'s AFL grid
{0.1, 0.5, 0.7}.

The strategy is not told the client count, so λ is sized lazily to max(client id) + 1. When a larger id appears, λ
grows to the new size N' with mass 1/N' for every new client and the old entries scaled by N/N' (their relative
mixture is kept). With contiguous ids 0..N−1 the first round usually fixes N; otherwise unseen ids start uniform.
λ is kept as log λ (no underflow over long runs); state_dict holds it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from aggregator_service.strategies.fedfair import require_finite
from fairfl.metrics.fairness import weight_entropy, weight_entropy_metrics
from fairfl.protocol import UPDATE, ClientResult
from fairfl.strategy import AggregateOutcome, RoundContext, Strategy, train_results, weighted_sum


@dataclass
class AFLParams:
    lambda_lr: float = 0.1  # η_λ, the mixture's step size

    def validate(self, path: str) -> None:
        from fairfl.schema import ConfigError

        require_finite(path, lambda_lr=self.lambda_lr)
        if self.lambda_lr < 0:
            raise ConfigError(f"{path}.lambda_lr: must be >= 0, got {self.lambda_lr}")


def _normalise_log(log_w: np.ndarray) -> np.ndarray:
    """log of w / Σ w, computed with log-sum-exp."""
    top = float(log_w.max())
    return log_w - (top + math.log(float(np.exp(log_w - top).sum())))


class AFL(Strategy):
    name = "afl"
    Params = AFLParams

    def __init__(self, params: AFLParams, server_lr: float) -> None:
        super().__init__(params, server_lr)
        self.log_lambda = np.zeros(0, dtype=np.float64)

    @property
    def mixture(self) -> np.ndarray:
        """λ over all clients known so far (sums to 1)."""
        return np.exp(self.log_lambda)

    def _grow(self, size: int) -> None:
        known = self.log_lambda.size
        if size <= known:
            return
        old = self.log_lambda + math.log(known / size) if known else self.log_lambda
        self.log_lambda = np.concatenate([old, np.full(size - known, -math.log(size))])

    def aggregate(self, ctx: RoundContext, phases: Sequence[list[ClientResult]]) -> AggregateOutcome:
        results = train_results(phases)
        ids = np.array([r.client_id for r in results], dtype=np.int64)
        self._grow(int(ids.max()) + 1)
        # 1. descent step with λ restricted to the round's clients, renormalised.
        weights = np.exp(_normalise_log(self.log_lambda[ids])).tolist()
        step = weighted_sum([r.payloads[UPDATE] for r in results], weights)
        # 2. mirror ascent on λ: the gradient of Σ λ_i F_i(x_t) in λ_i is F_i(x_t).
        losses = np.array([r.loss_before for r in results], dtype=np.float64)
        self.log_lambda[ids] += self.params.lambda_lr * losses
        self.log_lambda = _normalise_log(self.log_lambda)
        mixture = self.mixture
        metrics = weight_entropy_metrics(weights)
        metrics["lambda_entropy"] = weight_entropy(mixture)
        metrics["lambda_max"] = float(mixture.max())
        return AggregateOutcome(
            params=ctx.params + self.server_lr * step,
            weights={int(i): w for i, w in zip(ids, weights, strict=True)},
            metrics=metrics,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"log_lambda": torch.from_numpy(self.log_lambda.copy())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        log_lambda = state.get("log_lambda")
        self.log_lambda = (
            np.zeros(0, dtype=np.float64)
            if log_lambda is None
            else torch.as_tensor(log_lambda, dtype=torch.float64).numpy().copy()
        )
