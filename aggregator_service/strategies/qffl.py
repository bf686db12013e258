"""q-FFL via q-FedAvg (Li, Sanjabi, Beirami, Smith, "Fair Resource Allocation in Federated Learning", ICLR 2020,
Algorithm 3). Objective Σ p_k F_k^{q+1}/(q+1): larger q gives high-loss clients more say; q = 0 is uniform averaging.

With L the Lipschitz estimate (1/η of the round's client lr unless `lipschitz` is set), F_k = F_k(x_t) the loss at
the global model (ClientResult.loss_before) and x_k the local model after training:
    Δw_k   = L (x_t − x_k) = −L Δ_k                      (Δ_k = payloads[UPDATE] = x_k − x_t)
    Δ_k^q  = F_k^q Δw_k
    h_k    = q F_k^{q−1} ‖Δw_k‖² + L F_k^q
    x_{t+1} = x_t − Σ_k Δ_k^q / Σ_k h_k  =  x_t + Σ_k c_k Δ_k,   c_k = L F_k^q / Σ_j h_j.
The second form is what runs: one weighted fold of the raw updates. `server_lr` multiplies the step (1.0 = paper).
Reported weights are the c_k (they sum to ≤ 1: Σ h also carries the curvature term); `step_scale` = Σ c_k.
`weighting` says how the objective's p_k enter. The paper samples client k with probability p_k = n_k / n and sums
uniformly. Under uniform sampling (`random`) or full participation, `uniform` (the default, and Flower's QFedAvg)
optimises Σ F_k^{q+1}/(q+1) over clients, and `samples` weighs each participant's Δ_k^q and h_k by its n_k,
    x_{t+1} = x_t − Σ_k n_k Δ_k^q / Σ_k n_k h_k,
which is the paper's Σ p_k F_k^{q+1}/(q+1); with q = 0 it is FedAvg. The two agree when clients hold equal shares
(Table 1's shards). A sampler that already draws clients in proportion to n_k (clustered sampling, power-of-choice's
candidates) counts n_k once more under `samples`.
Under privacy.enabled (DP-q-FFL) F_k is the client's noisy loss release F̃_k, clamped at 0: the plaintext loss_before is
not a DP release. And ‖Δ_k‖² of a DP-SGD update is mostly the DP noise's: with the paper's FedAvgCNN (582,026
parameters, σ = 2, C = 0.1, q = 0.05) a client's noise energy E‖ν_k‖² = d (ησC/(q n_k))² is 0.03 to 28 against at most
C² = 0.01 of clipped signal, so left in h_k it shrinks every step to Σ F_k / (Σ F_k + 62). `dp_noise_correction`
(default on) subtracts that public expectation (fairfl.privacy.update_noise_energy; clamped at 0), an estimate of the
signal's ‖Δ_k‖²: post-processing, no privacy cost. The expectation uses the client's reported n_k, as FedAvg's
weights do: a client that understates it raises its noise estimate, lowers its h_k and so gains weight (and under
`weighting: samples` one that overstates it gains weight as in FedAvg). FedFDP's own
DP-q-FFL baseline is a different procedure (q-FedSGD per sample inside the client's DP-SGD, seed-fedfdp §8.1); this
one is q-FedAvg on the server, fed with DP releases.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from aggregator_service.strategies.fedfair import require_finite
from fairfl.metrics.fairness import weight_entropy_metrics
from fairfl.privacy import update_noise_energy
from fairfl.protocol import UPDATE, ClientResult
from fairfl.schema import ConfigError
from fairfl.strategy import AggregateOutcome, RoundContext, Strategy, train_results, weighted_sum

if TYPE_CHECKING:
    from fairfl.config import ExperimentConfig


WEIGHTINGS = ("uniform", "samples")


@dataclass
class QFFLParams:
    q: float = 0.1  # FedEBA+ grid {0.001, 0.01, 0.1, 0.5, 10, 15}; FedFDP's reference code uses 1.0
    lipschitz: float = 0.0  # L; 0 = 1 / (the round's client lr), as in the paper's q-FedAvg
    dp_noise_correction: bool = True  # under DP: h_k's ‖Δ_k‖² less the DP noise's expected energy (module docstring)
    weighting: str = "uniform"  # how p_k enters: "uniform" over participants, or "samples" (∝ n_k; module docstring)

    def validate(self, path: str) -> None:
        require_finite(path, q=self.q, lipschitz=self.lipschitz)
        if self.weighting not in WEIGHTINGS:
            raise ConfigError(f"{path}.weighting: {self.weighting!r} is not one of {', '.join(WEIGHTINGS)}")
        if self.q < 0:
            raise ConfigError(f"{path}.q: must be >= 0, got {self.q}")
        if self.lipschitz < 0:
            raise ConfigError(f"{path}.lipschitz: must be >= 0 (0 = 1/lr), got {self.lipschitz}")


def qffl_coefficients(
    losses: np.ndarray, sq_norms: np.ndarray, q: float, lipschitz: float, shares: np.ndarray | None = None
) -> np.ndarray:
    """c_k = ω_k L F_k^q / Σ_j ω_j h_j in float64 (see the module docstring), ω the clients' shares (1 each when
    None; their scale cancels); all zeros when Σ ω h = 0 (every F_k = 0)."""
    shares = np.ones_like(losses) if shares is None else shares
    fq = np.power(losses, q)  # 0^0 = 1: with q = 0 every client counts once
    if q == 0:
        curvature = np.zeros_like(losses)  # q F^{q-1} with q = 0 vanishes, even at F = 0
    else:
        # q < 1 and F_k = 0 would give 0·∞: for a smooth non-negative loss ‖∇F‖² ≤ 2L·F, so the term
        # q F^{q−1}‖Δw‖² behaves like F^q → 0; take that limit. For q ≥ 1 the power is finite at 0 anyway.
        positive = losses > 0
        base = np.where(positive, losses, 1.0)
        at_zero = 1.0 if q == 1 else 0.0
        power = np.where(positive, np.power(base, q - 1.0), at_zero)
        curvature = q * power * lipschitz**2 * sq_norms  # ‖Δw_k‖² = L² ‖Δ_k‖²
    h = curvature + lipschitz * fq
    total = float((shares * h).sum())  # with ones, h.sum() to the bit (a BLAS dot can round otherwise)
    if total <= 0:
        return np.zeros_like(losses)
    return shares * lipschitz * fq / total


class QFFL(Strategy):
    name = "qffl"
    privacy_principals = frozenset({"client"})
    needs_loss_release_under_dp = True  # q-FFL weights by the clients' (noisy) losses
    Params = QFFLParams

    @classmethod
    def validate_run(cls, cfg: ExperimentConfig, params: QFFLParams) -> None:
        if cfg.privacy.enabled and params.dp_noise_correction and cfg.training.optimizer != "sgd":
            raise ConfigError(
                f"strategy.params.dp_noise_correction: the DP noise's energy in an update is known for SGD only, "
                f"not training.optimizer {cfg.training.optimizer}; use sgd, or set dp_noise_correction: false"
            )

    def aggregate(self, ctx: RoundContext, phases: Sequence[list[ClientResult]]) -> AggregateOutcome:
        results = train_results(phases)
        updates = [r.payloads[UPDATE] for r in results]
        lipschitz = self.params.lipschitz or 1.0 / ctx.train_config.lr
        if ctx.train_config.HasField("dp"):
            # DP-q-FFL: F_k must be a DP release, so the client's noisy loss F̃_k (of its updated model, on an
            # independent Poisson batch) stands in for F_k(x_t); negative noise is clamped (post-processing).
            # A client that released no loss (NaN) gets F = 0, i.e. no q-FFL weight, rather than failing the round.
            losses = np.array(
                [max(r.noisy_loss, 0.0) if math.isfinite(r.noisy_loss) else 0.0 for r in results], dtype=np.float64
            )
        else:
            losses = np.array([r.loss_before for r in results], dtype=np.float64)
        # One scalar per client (a loop over clients): ‖Δ_k‖² accumulated in float64.
        sq_norms = np.array([float(torch.dot(u.double(), u.double())) for u in updates], dtype=np.float64)
        if ctx.train_config.HasField("dp") and self.params.dp_noise_correction:
            dim = ctx.params.numel()
            noise = np.array([update_noise_energy(ctx.train_config, r.num_samples, dim) for r in results])
            sq_norms = np.maximum(sq_norms - noise, 0.0)
        shares = None
        if self.params.weighting == "samples":
            sizes = np.array([r.num_samples for r in results], dtype=np.float64)
            shares = sizes / sizes.mean()  # mean 1: the same scale as uniform's ones
        coefs = qffl_coefficients(losses, sq_norms, self.params.q, lipschitz, shares).tolist()
        step = weighted_sum(updates, coefs)
        metrics = weight_entropy_metrics(coefs)
        metrics["step_scale"] = math.fsum(coefs)
        metrics["lipschitz"] = lipschitz
        return AggregateOutcome(
            params=ctx.params + self.server_lr * step,
            weights={r.client_id: c for r, c in zip(results, coefs, strict=True)},
            metrics=metrics,
        )
