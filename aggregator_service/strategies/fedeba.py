"""FedEBA, FedEBA+ and Prac-FedEBA+ (Wang et al., "Entropy-driven Fair and Effective Federated Learning").

Spec: ../shared/specs/seed-fedeba.md. Implemented from the algorithm boxes and Eqs. (4), (8)-(12), not from the
inconsistent Eq. (6) derivation (spec §2.2 erratum). Updates are displacements Δ = x_new − x_old and the server applies
x_{t+1} = x_t + η·Δ_t.

- EBA weights (Eq. 4, 22): p = softmax(F/τ) over the round's clients, optionally times a data-size prior q_i, with
  V002's clamp τ_eff = max(τ, (F_max − F_min)/ln(1/(m·ε_p))) so that min p ≥ ε_p (App. I, Eq. 38).
- FedEBA+ gradient alignment (V002 Alg. 1): phase 1 asks every selected client for F_i(x_t) and ∇F_i(x_t); the server
  forms g̃ = Σ softmax(F_i(x_t)/τ)·∇F_i(x_t) and phase 2 trains with h = (1−α)∇F_i + α·g̃; aggregation by EBA on the
  post-training losses.
- Model alignment (Eq. 8-9): Δ = (1−α)·Σ p_i Δ_i + α·Σ (n_i/Σn)·(x_{t,1} − x_t).
- V000's adaptive switch: gradient alignment when the loss angle arccos(⟨L,1⟩/(‖L‖√n)) exceeds θ, else model alignment.
- Prac-FedEBA+ (Alg. 3, one exchange): g̃ ≈ Σ p̃_j·(mean local gradient of j) with p̃ from F_j(x_t), Δ̂_i = (1−α)Δ_i −
  α·η_L·K·g̃, Δ = Σ p_i Δ̂_i. Under plain SGD the mean local gradient is −Δ_j/(η_L·K), which gives the closed form
  Δ = Σ ((1−α)·p_i + α·p̃_i)·Δ_i used here. Its θ branch uses Δ_i/K as the one-step estimate (spec D7).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from fairfl.fold import ResultFold, sample_weighted, softmax_weighted
from fairfl.metrics.fairness import loss_angle_degrees, weight_entropy
from fairfl.protocol import FIRST_STEP_UPDATE, GRADIENT, PROBE, TRAIN, UPDATE, ClientResult
from fairfl.strategy import (
    AggregateOutcome,
    PhasePlan,
    RoundContext,
    Strategy,
    phase_folds,
    train_phase,
    train_results,
    weighted_sum,
)
from fairfl.v1 import federation_pb2

MODES = ("gradient", "adaptive", "model")
FAIR_GRADIENTS = ("gradient", "one_step_update")


def eba_weights(
    losses: Sequence[float] | np.ndarray,
    tau: float,
    prior: Sequence[float] | np.ndarray | None = None,
    clamp_eps: float = 0.0,
) -> tuple[np.ndarray, float]:
    """Entropy-based aggregation weights p ∝ q_i·exp(F_i/τ_eff) and the temperature actually used.

    Computed in float64 with the max subtracted (log-sum-exp), so τ = 0.1 with losses of tens does not overflow.
    The clamp (ε_p > 0, V002) raises τ just enough that every weight stays ≥ ε_p when no prior is used.
    """
    f = np.asarray(losses, dtype=np.float64)
    if f.ndim != 1 or f.size == 0:
        raise ValueError("eba_weights needs a non-empty vector of losses")
    if not np.isfinite(f).all():
        raise ValueError("eba_weights: losses must be finite")
    if not tau > 0:
        raise ValueError(f"eba_weights: tau must be > 0, got {tau}")
    tau_eff = float(tau)
    spread = float(f.max() - f.min())
    if clamp_eps > 0 and f.size * clamp_eps < 1 and spread > 0:
        tau_eff = max(tau_eff, spread / math.log(1.0 / (f.size * clamp_eps)))
    logits = f / tau_eff
    if prior is not None:
        q = np.asarray(prior, dtype=np.float64)
        if q.shape != f.shape or (q < 0).any() or q.sum() <= 0:
            raise ValueError("eba_weights: prior must be non-negative, one per loss, not all zero")
        with np.errstate(divide="ignore"):
            logits = logits + np.log(q / q.sum())
    logits = logits - logits.max()
    p = np.exp(logits)
    return p / p.sum(), tau_eff


@dataclass
class FedEBAParams:
    tau: float = 0.1
    use_prior: bool = False  # weight by data share q_i too (Eq. 22); the paper's experiments use Eq. 4 (no prior)
    clamp_eps: float = 0.0  # V002 τ clamp ε_p (e.g. 1e-6); 0 = off (V000)

    def validate(self, path: str) -> None:
        from fairfl.schema import ConfigError

        if not self.tau > 0 or not math.isfinite(self.tau):
            raise ConfigError(f"{path}.tau: must be > 0 and finite, got {self.tau}")
        if not 0 <= self.clamp_eps < 1:
            raise ConfigError(f"{path}.clamp_eps: must be in [0, 1), got {self.clamp_eps}")


@dataclass
class FedEBAPlusParams(FedEBAParams):
    alpha: float = 0.9
    mode: str = "gradient"  # gradient (V002), adaptive (V000 θ switch), model (model alignment every round)
    theta_degrees: float = 0.0  # adaptive switch threshold; 0 = gradient alignment unless all losses are equal
    fair_grad_batches: int = 1  # mini-batches averaged for ∇F_i(x_t) (spec D4)
    model_align_scale_by_k: bool = False  # Eq. 8 mixes a K-step and a 1-step displacement; True scales the latter by K
    # What "∇F_i(x_t)" is in h = (1−α)∇F_i + α·g̃: "gradient" (literal) or "one_step_update", the paper's "one local
    # update" reading (§4.2, V002 l.191-199): the magnitude of x_{t,1} − x_t, i.e. η_L·∇F_i(x_t). The literal reading
    # applies α·η_L·K·g̃ per round unshrunk and diverges on Table 1's setup (α = 0.9, K = 10, η_L = 0.1).
    fair_gradient: str = "gradient"

    def validate(self, path: str) -> None:
        from fairfl.schema import ConfigError

        super().validate(path)
        if not 0 <= self.alpha <= 1:
            raise ConfigError(f"{path}.alpha: must be in [0, 1], got {self.alpha}")
        if self.mode not in MODES:
            raise ConfigError(f"{path}.mode: {self.mode!r} is not one of {', '.join(MODES)}")
        if not 0 <= self.theta_degrees <= 90:
            raise ConfigError(f"{path}.theta_degrees: must be in [0, 90], got {self.theta_degrees}")
        if self.fair_gradient not in FAIR_GRADIENTS:
            raise ConfigError(f"{path}.fair_gradient: {self.fair_gradient!r} is not one of {', '.join(FAIR_GRADIENTS)}")
        if self.fair_grad_batches < 1:
            raise ConfigError(f"{path}.fair_grad_batches: must be >= 1, got {self.fair_grad_batches}")


def _losses(results: Sequence[ClientResult], attribute: str) -> np.ndarray:
    return np.array([getattr(r, attribute) for r in results], dtype=np.float64)


class FedEBA(Strategy):
    """EBA aggregation alone (α = 0): p = softmax(F_i(x_{t,K})/τ) over the round's clients.

    Streamed (fairfl/fold.py) with a running log-sum-exp, except under V002's τ clamp, whose τ_eff depends on the
    spread of every loss of the round: then the results are kept and folded once all are in (the same sums)."""

    name = "fedeba"
    Params = FedEBAParams

    def _eba(self, results: Sequence[ClientResult], attribute: str) -> tuple[np.ndarray, float]:
        prior = [r.num_samples for r in results] if self.params.use_prior else None
        return eba_weights(_losses(results, attribute), self.params.tau, prior, self.params.clamp_eps)

    def _tau_eff(self, results: Sequence[ClientResult], attribute: str) -> float:
        return self.params.tau if self.params.clamp_eps == 0 else self._eba(results, attribute)[1]

    def _eba_fold(self, ctx: RoundContext, kind: int, attribute: str, tau: float) -> ResultFold:
        """p_i ∝ exp(F_i/τ)·n_i^[use_prior] over payload `kind` (the prior's Σn cancels in the normalisation)."""
        use_prior = self.params.use_prior

        def log_weight(result: ClientResult) -> float:
            loss = getattr(result, attribute)
            if not math.isfinite(loss):
                raise ValueError(f"client {result.client_id}: {attribute} is {loss}; EBA weights need every loss")
            return loss / tau + (math.log(result.num_samples) if use_prior else 0.0)

        return softmax_weighted(ctx.params.numel(), kind, log_weight)

    def _train_folds(self, ctx: RoundContext, tau: float, first_step: bool) -> list[ResultFold]:
        """EBA over the updates; with model alignment also Σ (n_i/Σn)·(x_{t,1} − x_t)."""
        folds = [self._eba_fold(ctx, UPDATE, "loss_after", tau)]
        if first_step:
            folds.append(sample_weighted(ctx.params.numel(), FIRST_STEP_UPDATE))
        return folds

    def _folded(
        self,
        ctx: RoundContext,
        phases: Sequence[list[ClientResult]],
        index: int,
        attribute: str,
        make: Callable[[float], list[ResultFold]],
    ) -> tuple[list[ResultFold], float]:
        """The folds of phase `index` (streamed, or built now by `make(τ_eff)`) and the τ they used."""
        tau = self._tau_eff(phases[index], attribute)
        return phase_folds(ctx, phases, index, lambda: make(tau)), tau

    def folds(self, ctx: RoundContext, phase_index: int, plan: PhasePlan) -> list[ResultFold]:
        if plan.phase != TRAIN or self.params.clamp_eps != 0:
            return []
        return self._train_folds(ctx, self.params.tau, first_step=False)

    def aggregate(self, ctx: RoundContext, phases: Sequence[list[ClientResult]]) -> AggregateOutcome:
        index = train_phase(phases)
        results = phases[index]
        (fold,), tau_eff = self._folded(
            ctx, phases, index, "loss_after", lambda tau: self._train_folds(ctx, tau, first_step=False)
        )
        by_client = fold.weights_by_client()
        p = [by_client[r.client_id] for r in results]
        return AggregateOutcome(
            params=ctx.params + self.server_lr * fold.sum.weighted_mean(),
            weights=by_client,
            metrics={"tau_eff": tau_eff, "weight_entropy": weight_entropy(p)},
        )


class FedEBAPlus(FedEBA):
    """FedEBA+ with gradient alignment (two exchanges per round), model alignment, or V000's adaptive switch."""

    name = "fedeba_plus"
    max_phases = 3  # adaptive mode: a loss probe, a gradient probe, then the aligned training
    Params = FedEBAPlusParams

    def _train(self, ctx: RoundContext, **fields: object) -> federation_pb2.LocalTrainingConfig:
        cfg = federation_pb2.LocalTrainingConfig()
        cfg.CopyFrom(ctx.train_config)
        for key, value in fields.items():
            setattr(cfg, key, value)
        return cfg

    def _probe(self, ctx: RoundContext, want_gradient: bool) -> federation_pb2.ProbeConfig:
        return federation_pb2.ProbeConfig(
            want_gradient=want_gradient,
            gradient_batches=self.params.fair_grad_batches,
            batch_size=ctx.train_config.batch_size,
            loss_eval_batches=ctx.train_config.loss_eval_batches,
        )

    def _gradient_aligned_train(
        self, ctx: RoundContext, phases: Sequence[list[ClientResult]], probe_index: int
    ) -> PhasePlan:
        """g̃ = Σ p̃_i ∇F_i(x_t) with p̃ = softmax(F_i(x_t)/τ), from the probe's gradients (streamed or kept)."""
        (fold,), _ = self._folded(
            ctx, phases, probe_index, "loss_before", lambda tau: [self._eba_fold(ctx, GRADIENT, "loss_before", tau)]
        )
        scale = ctx.train_config.lr if self.params.fair_gradient == "one_step_update" else 1.0
        cfg = self._train(ctx)
        cfg.alignment.fair_gradient.CopyFrom(ctx.publish(fold.sum.weighted_mean(scale)))
        ctx.folds.pop(probe_index, None)  # g̃ is published: free the probe's accumulator before training
        cfg.alignment.alpha = self.params.alpha
        return PhasePlan(phase=TRAIN, train=cfg, clients=[r.client_id for r in phases[probe_index]])

    def folds(self, ctx: RoundContext, phase_index: int, plan: PhasePlan) -> list[ResultFold]:
        if self.params.clamp_eps != 0:
            return []
        if plan.phase == PROBE and plan.probe is not None and plan.probe.want_gradient:
            return [self._eba_fold(ctx, GRADIENT, "loss_before", self.params.tau)]
        if plan.phase != TRAIN:
            return []
        first_step = plan.train is not None and plan.train.record_first_step  # model alignment
        return self._train_folds(ctx, self.params.tau, first_step)

    def configure(self, ctx: RoundContext, phase_index: int, prior: Sequence[list[ClientResult]]) -> PhasePlan | None:
        mode = self.params.mode
        if mode == "model":
            return PhasePlan(phase=TRAIN, train=self._train(ctx, record_first_step=True)) if phase_index == 0 else None
        if mode == "gradient":
            if phase_index == 0:
                return PhasePlan(phase=PROBE, probe=self._probe(ctx, want_gradient=True))
            return self._gradient_aligned_train(ctx, prior, 0) if phase_index == 1 else None
        # adaptive (V000 Alg. 1): losses first, then the gradient only when the round looks unfair
        if phase_index == 0:
            return PhasePlan(phase=PROBE, probe=self._probe(ctx, want_gradient=False))
        if phase_index == 1:
            responders = [r.client_id for r in prior[0]]
            if self._unfair(prior[0]):
                return PhasePlan(phase=PROBE, probe=self._probe(ctx, want_gradient=True), clients=responders)
            return PhasePlan(phase=TRAIN, train=self._train(ctx, record_first_step=True), clients=responders)
        if phase_index == 2 and prior[-1][0].phase == PROBE:
            return self._gradient_aligned_train(ctx, prior, len(prior) - 1)
        return None

    def _unfair(self, results: Sequence[ClientResult]) -> bool:
        return loss_angle_degrees(_losses(results, "loss_before")) > self.params.theta_degrees

    def aggregate(self, ctx: RoundContext, phases: Sequence[list[ClientResult]]) -> AggregateOutcome:
        index = train_phase(phases)
        results = phases[index]
        # Model alignment trains after a loss-only probe (adaptive) or none (model); gradient alignment after a
        # gradient probe, whose clients already stepped along h.
        aligned = index > 0 and not _loss_only_probe(self.params, index)
        folds, tau_eff = self._folded(
            ctx, phases, index, "loss_after", lambda tau: self._train_folds(ctx, tau, first_step=not aligned)
        )
        by_client = folds[0].weights_by_client()
        p = np.array([by_client[r.client_id] for r in results])
        if aligned:  # alignment already happened in the clients' steps
            delta = folds[0].sum.weighted_mean()
        else:
            scale = _local_steps(results) if self.params.model_align_scale_by_k else 1.0
            alpha = self.params.alpha
            delta = folds[0].sum.weighted_mean(1 - alpha) + folds[1].sum.weighted_mean(alpha * scale)
        return AggregateOutcome(
            params=ctx.params + self.server_lr * delta,
            weights=by_client,
            metrics={
                "tau_eff": tau_eff,
                "weight_entropy": weight_entropy(p),
                "gradient_aligned": float(aligned),
                "loss_angle_deg": loss_angle_degrees(_losses(results, "loss_before")),
            },
        )


def _loss_only_probe(params: FedEBAPlusParams, train_index: int) -> bool:
    """Adaptive mode's first probe asks for losses only; a train phase right after it is model alignment."""
    return params.mode == "adaptive" and train_index == 1


def _local_steps(results: Sequence[ClientResult]) -> float:
    steps = {r.metrics.get("local_steps", 0.0) for r in results}
    if len(steps) != 1 or 0.0 in steps:
        raise ValueError("model_align_scale_by_k needs the same number of local steps on every client")
    return steps.pop()


class PracFedEBAPlus(FedEBAPlus):
    """Prac-FedEBA+: FedAvg's communication (one exchange), alignment done on the server after the fact."""

    name = "prac_fedeba_plus"
    max_phases = 1  # FedAvg's communication: alignment happens on the server
    Params = FedEBAPlusParams

    def configure(self, ctx: RoundContext, phase_index: int, prior: Sequence[list[ClientResult]]) -> PhasePlan | None:
        return PhasePlan(phase=TRAIN, train=self._train(ctx)) if phase_index == 0 else None

    def folds(self, ctx: RoundContext, phase_index: int, plan: PhasePlan) -> list[ResultFold]:
        return []  # not streamed: its weights mix two softmaxes and a branch chosen from every loss of the round

    def aggregate(self, ctx: RoundContext, phases: Sequence[list[ClientResult]]) -> AggregateOutcome:
        results = train_results(phases)
        alpha = self.params.alpha
        p, tau_eff = self._eba(results, "loss_after")
        updates = [r.payloads[UPDATE] for r in results]
        gradient_branch = self.params.mode != "adaptive" or self._unfair(results)
        if gradient_branch:  # Δ = Σ p_i[(1−α)Δ_i − α·η_L·K·g̃] = Σ ((1−α)p_i + α·p̃_i) Δ_i under plain SGD
            p_tilde, _ = self._eba(results, "loss_before")
            delta = weighted_sum(updates, (1 - alpha) * p + alpha * p_tilde)
        else:  # Eq. 8 with the mean per-step displacement Δ_i / K as the one-step estimate (spec D7)
            sizes = np.array([r.num_samples for r in results], dtype=np.float64)
            steps = np.array([max(r.metrics.get("local_steps", 1.0), 1.0) for r in results])
            delta = weighted_sum(updates, (1 - alpha) * p + alpha * (sizes / sizes.sum()) / steps)
        return AggregateOutcome(
            params=ctx.params + self.server_lr * delta,
            weights={r.client_id: float(w) for r, w in zip(results, p, strict=True)},
            metrics={
                "tau_eff": tau_eff,
                "weight_entropy": weight_entropy(p),
                "gradient_aligned": float(gradient_branch),
                "loss_angle_deg": loss_angle_degrees(_losses(results, "loss_before")),
            },
        )


__all__ = ["FedEBA", "FedEBAParams", "FedEBAPlus", "FedEBAPlusParams", "PracFedEBAPlus", "eba_weights"]
