"""Fairness baselines (FedProx, FedFair, q-FFL, AFL, FedMGDA+, TERM): update rules against hand computations on
small vectors, parameter validation, and the acceptance identities on real training with the in-process engine:
FedFair with λ = 0 is FedAvg bit for bit, q-FFL with q = 0 is FedAvg within 1e-6 (equal client sizes, or any sizes
with `weighting: samples`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from aggregator_service.engine import RoundEngine, initial_model
from aggregator_service.strategies.fedmgda import min_norm_weights, project_capped_simplex
from client_agent.trainer import ClientRuntime
from fairfl.compose import inprocess
from fairfl.compose.inprocess import InProcessTransport
from fairfl.compose.local_privacy import LocalPrivacy
from fairfl.compose.local_selection import LocalSelector
from fairfl.config import ConfigError, ExperimentConfig, experiment_from_dict
from fairfl.data import FederatedData, load_run_data
from fairfl.data.datasets import ArrayDataset, DatasetNotFoundError, load_dataset
from fairfl.metrics.fairness import psi_telemetry
from fairfl.protocol import TRAIN, UPDATE, ClientResult
from fairfl.strategy import STRATEGIES, AggregateOutcome, RoundContext, Strategy, build_strategy
from fairfl.v1 import control_pb2, federation_pb2, tensor_pb2

# --- helpers --------------------------------------------------------------------------------------------------------


def result(cid: int, update: Sequence[float], loss_before: float, loss_after: float = 0.5, n: int = 10) -> ClientResult:
    return ClientResult(
        task_id=f"t{cid}",
        run_id="r",
        round=1,
        client_id=cid,
        phase=TRAIN,
        num_samples=n,
        loss_before=loss_before,
        loss_after=loss_after,
        payloads={UPDATE: torch.tensor(update, dtype=torch.float32)},
    )


def context(params: Sequence[float], clients: Sequence[int], lr: float = 0.1) -> RoundContext:
    cfg = federation_pb2.LocalTrainingConfig(local_steps=3, batch_size=8, lr=lr, momentum=0.5)
    return RoundContext(
        "r", 1, torch.tensor(params, dtype=torch.float32), list(clients), cfg, lambda _: tensor_pb2.BlobRef()
    )


def strategy(name: str, server_lr: float = 1.0, **params: Any) -> Strategy:
    return build_strategy(name, params, server_lr)


def aggregate(s: Strategy, ctx: RoundContext, results: list[ClientResult]) -> AggregateOutcome:
    return s.aggregate(ctx, [results])


def stack(results: Sequence[ClientResult]) -> torch.Tensor:
    return torch.stack([r.payloads[UPDATE] for r in results]).double()


X0 = [0.5, -1.0, 2.0]
THREE = [
    result(0, [0.1, 0.2, -0.3], loss_before=0.4, loss_after=0.3, n=10),
    result(1, [-0.2, 0.05, 0.1], loss_before=1.2, loss_after=0.9, n=30),
    result(2, [0.3, -0.1, 0.2], loss_before=2.5, loss_after=1.6, n=60),
]


def test_registry_has_every_baseline() -> None:
    for name in ("fedavg", "fedprox", "fedfair", "qffl", "afl", "fedmgda_plus", "term"):
        assert STRATEGIES.load(name, "strategy.name").name == name


def test_defaults() -> None:
    assert strategy("fedprox").params.mu == 0.01
    assert strategy("fedfair").params.fair_lambda == 0.1
    assert strategy("fedfair").params.initial_global_loss == 0.0
    assert (strategy("qffl").params.q, strategy("qffl").params.lipschitz) == (0.1, 0.0)
    assert strategy("afl").params.lambda_lr == 0.1
    assert (strategy("fedmgda_plus").params.epsilon, strategy("fedmgda_plus").params.normalize) == (0.1, True)
    assert strategy("term").params.tilt == 1.0


# --- parameter validation -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "params", "field"),
    [
        ("fedprox", {"mu": -0.1}, "mu"),
        ("fedprox", {"server_momentum": 1.0}, "server_momentum"),
        ("fedfair", {"fair_lambda": -1.0}, "fair_lambda"),
        ("fedfair", {"fair_lambda": float("inf")}, "fair_lambda"),
        ("fedfair", {"initial_global_loss": -0.5}, "initial_global_loss"),
        ("qffl", {"q": -0.1}, "q"),
        ("qffl", {"q": float("nan")}, "q"),
        ("qffl", {"lipschitz": -1.0}, "lipschitz"),
        ("qffl", {"weighting": "clients"}, "weighting"),
        ("afl", {"lambda_lr": -0.1}, "lambda_lr"),
        ("fedmgda_plus", {"epsilon": 1.5}, "epsilon"),
        ("fedmgda_plus", {"epsilon": -0.01}, "epsilon"),
        ("fedmgda_plus", {"normalize": "yes"}, "normalize"),
        ("term", {"tilt": float("nan")}, "tilt"),
        ("term", {"tilt": "big"}, "tilt"),
    ],
)
def test_invalid_params_are_named(name: str, params: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        experiment_from_dict({"strategy": {"name": name, "params": params}})
    assert str(info.value).startswith(f"strategy.params.{field}:"), str(info.value)


def test_unknown_param_lists_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"strategy\.params: unknown parameter 'lambda'.*lambda_lr"):
        experiment_from_dict({"strategy": {"name": "afl", "params": {"lambda": 0.5}}})


def test_valid_params_build() -> None:
    cfg = experiment_from_dict({"strategy": {"name": "term", "params": {"tilt": -2}}})
    assert strategy(cfg.strategy.name, **cfg.strategy.params).params.tilt == -2.0
    assert strategy("fedmgda_plus", epsilon=0, normalize=False).params.epsilon == 0.0


# --- FedProx --------------------------------------------------------------------------------------------------------


def test_fedprox_sets_prox_mu_and_aggregates_like_fedavg() -> None:
    ctx = context(X0, [0, 1, 2])
    plan = strategy("fedprox", mu=0.3).configure(ctx, 0, [])
    assert plan is not None and plan.phase == TRAIN and plan.train is not None
    assert plan.train.prox_mu == pytest.approx(0.3)
    assert (plan.train.lr, plan.train.local_steps, plan.train.momentum) == (ctx.train_config.lr, 3, 0.5)
    assert ctx.train_config.prox_mu == 0.0, "the round's config must not be modified"
    assert strategy("fedprox").configure(ctx, 1, [THREE]) is None
    got = aggregate(strategy("fedprox", mu=0.3), ctx, THREE)
    want = aggregate(strategy("fedavg"), ctx, THREE)
    assert torch.equal(got.params, want.params)
    assert got.weights == want.weights
    assert got.metrics == want.metrics and set(got.metrics) == {"weight_entropy"}  # Ψ is the engine's telemetry


# --- FedFair --------------------------------------------------------------------------------------------------------


def test_fedfair_broadcasts_global_loss_and_reports_psi() -> None:
    ctx = context(X0, [0, 1, 2])
    s = strategy("fedfair", fair_lambda=0.7)
    plan = s.configure(ctx, 0, [])
    assert plan is not None and plan.train is not None and plan.train.HasField("fair_step")
    assert (plan.train.fair_step.global_loss, plan.train.fair_step.fair_lambda) == (0.0, pytest.approx(0.7))
    assert not ctx.train_config.HasField("fair_step")
    out = aggregate(s, ctx, THREE)
    # Hand computation: p = (0.1, 0.3, 0.6), F = Σ p_i F_i(w_{t+1}^i) over loss_after, Ψ = Σ p_i (F_i − F)².
    p = [0.1, 0.3, 0.6]
    f_after = [0.3, 0.9, 1.6]
    big_f = sum(pi * fi for pi, fi in zip(p, f_after, strict=True))
    assert big_f == pytest.approx(1.26)
    psi = sum(pi * (fi - big_f) ** 2 for pi, fi in zip(p, f_after, strict=True))
    assert psi == pytest.approx(0.1 * 0.96**2 + 0.3 * 0.36**2 + 0.6 * 0.34**2)
    assert out.metrics["global_loss"] == pytest.approx(big_f, abs=1e-12)
    assert out.metrics["psi"] == pytest.approx(psi, abs=1e-12)  # FedFair's own Eq. 7, which the engine keeps
    # psi_before is the engine's telemetry (fairfl.metrics.fairness.psi_telemetry), no longer the strategy's.
    assert "psi_before" not in out.metrics
    f_before = [0.4, 1.2, 2.5]
    mean_before = sum(pi * fi for pi, fi in zip(p, f_before, strict=True))
    psi_before = sum(pi * (fi - mean_before) ** 2 for pi, fi in zip(p, f_before, strict=True))
    assert psi_telemetry(THREE)["psi_before"] == pytest.approx(psi_before, abs=1e-12)
    assert out.weights == pytest.approx({0: 0.1, 1: 0.3, 2: 0.6})
    assert torch.equal(out.params, aggregate(strategy("fedavg"), ctx, THREE).params)
    # The next round broadcasts the new F, and the state survives a checkpoint.
    assert s.configure(ctx, 0, []).train.fair_step.global_loss == pytest.approx(big_f, abs=1e-12)
    restored = strategy("fedfair", fair_lambda=0.7)
    restored.load_state_dict(s.state_dict())
    assert restored.configure(ctx, 0, []).train.fair_step.global_loss == pytest.approx(big_f, abs=1e-12)


def test_fedfair_initial_loss_and_zero_lambda_still_sends_fair_step() -> None:
    plan = strategy("fedfair", fair_lambda=0.0, initial_global_loss=2.0).configure(context(X0, [0]), 0, [])
    assert plan.train.HasField("fair_step")
    assert (plan.train.fair_step.global_loss, plan.train.fair_step.fair_lambda) == (2.0, 0.0)


# --- q-FFL ----------------------------------------------------------------------------------------------------------


def qffl_by_hand(
    x: Sequence[float], results: Sequence[ClientResult], q: float, lipschitz: float, by_samples: bool = False
) -> torch.Tensor:
    """The q-FedAvg update exactly as printed (Li et al. 2020, Algorithm 3), in float64; `by_samples` weighs each
    client's Δ_k^q and h_k by its n_k (p_k under uniform sampling)."""
    x_t = torch.tensor(x, dtype=torch.float64)
    deltas, hs = [], []
    for r in results:
        x_k = x_t + r.payloads[UPDATE].double()
        dw = lipschitz * (x_t - x_k)
        f = r.loss_before
        p = r.num_samples if by_samples else 1
        deltas.append(p * f**q * dw)
        hs.append(p * (q * f ** (q - 1) * float(dw @ dw) + lipschitz * f**q))
    return x_t - sum(deltas) / sum(hs)


@pytest.mark.parametrize(("q", "lr", "lipschitz"), [(0.5, 0.1, 0.0), (2.0, 0.05, 0.0), (1.0, 0.1, 3.0), (15.0, 0.1, 0)])
def test_qffl_matches_hand_computation(q: float, lr: float, lipschitz: float) -> None:
    ctx = context(X0, [0, 1, 2], lr=lr)
    out = aggregate(strategy("qffl", q=q, lipschitz=lipschitz), ctx, THREE)
    big_l = lipschitz or 1.0 / lr
    want = qffl_by_hand(X0, THREE, q, big_l)
    assert torch.allclose(out.params.double(), want, atol=1e-6, rtol=0)
    assert out.metrics["lipschitz"] == pytest.approx(big_l)
    assert 0 < out.metrics["step_scale"] <= 1.0


@pytest.mark.parametrize("q", [0.5, 2.0])
def test_qffl_weighted_by_samples_matches_hand_computation(q: float) -> None:
    ctx = context(X0, [0, 1, 2], lr=0.1)
    out = aggregate(strategy("qffl", q=q, weighting="samples"), ctx, THREE)
    assert torch.allclose(out.params.double(), qffl_by_hand(X0, THREE, q, 10.0, by_samples=True), atol=1e-6, rtol=0)
    uniform = aggregate(strategy("qffl", q=q), ctx, THREE)
    assert out.weights[2] / out.weights[0] == pytest.approx(6.0 * uniform.weights[2] / uniform.weights[0])  # n: 60/10


def test_qffl_weighted_by_samples_with_q0_is_fedavg_and_equal_shares_change_nothing() -> None:
    ctx = context(X0, [0, 1, 2])
    fedavg = aggregate(strategy("fedavg"), ctx, THREE)
    out = aggregate(strategy("qffl", q=0.0, weighting="samples"), ctx, THREE)
    assert torch.allclose(out.params, fedavg.params, atol=1e-7, rtol=0)
    assert out.weights == pytest.approx({0: 0.1, 1: 0.3, 2: 0.6})
    equal = [dataclasses.replace(r, num_samples=600) for r in THREE]
    by_samples = aggregate(strategy("qffl", q=1.0, weighting="samples"), ctx, equal)
    assert torch.equal(by_samples.params, aggregate(strategy("qffl", q=1.0), ctx, equal).params)


def test_qffl_two_clients_closed_form() -> None:
    # q = 1, L = 10: h_k = F_k^0 ‖Δw_k‖² + L F_k; Δ_1 = (0.1, 0), Δ_2 = (0, 0.2), F = (1, 2).
    results = [result(0, [0.1, 0.0], 1.0), result(1, [0.0, 0.2], 2.0)]
    out = aggregate(strategy("qffl", q=1.0), context([0.0, 0.0], [0, 1], lr=0.1), results)
    sum_h = (1.0 + 10.0) + (4.0 + 20.0)  # ‖Δw_1‖² = 1, ‖Δw_2‖² = 4
    want = torch.tensor([10 * 1.0 * 0.1 / sum_h, 10 * 2.0 * 0.2 / sum_h])
    assert torch.allclose(out.params, want, atol=1e-7, rtol=0)
    assert out.weights == pytest.approx({0: 10 / sum_h, 1: 20 / sum_h})


def test_dp_qffl_takes_the_dp_noise_energy_out_of_h() -> None:
    """DP-q-FFL: each update is a signal s_k plus DP-SGD noise ν_k (orthogonal here: s_k on coordinate 0, ν_k on the
    rest) with ‖ν_k‖² equal to its public expectation d (ησC/(q n_k))² (K = 1, plain SGD). With the correction h_k
    sees ‖s_k‖² (over- or under-subtracting moves the weights); without it, ‖s_k‖² + ‖ν_k‖². F_k is noisy_loss."""
    dim, lr, n = 4000, 1.0, (200, 800)
    dp = federation_pb2.DpSgd(sample_rate=0.05, noise_multiplier=2.0, clip_norm=0.1, loss_noise_multiplier=5.0)
    cfg = federation_pb2.LocalTrainingConfig(local_steps=1, lr=lr, dp=dp)
    ctx = RoundContext("r", 1, torch.zeros(dim), [0, 1], cfg, lambda _: tensor_pb2.BlobRef())
    energies = [dim * (lr * 2.0 * 0.1 / (0.05 * k)) ** 2 for k in n]  # 1.6 and 0.1
    signals, losses = (0.6, 0.3), (1.0, 2.0)
    gen = torch.Generator().manual_seed(0)
    results = []
    for cid, (k, energy) in enumerate(zip(n, energies, strict=True)):
        noise = torch.randn(dim, generator=gen)
        noise[0] = 0.0
        update = noise * math.sqrt(energy) / noise.norm()
        update[0] = signals[cid]
        r = result(cid, update.tolist(), loss_before=9.0, n=k)
        r.noisy_loss = losses[cid]  # F̃: the DP release q-FFL weighs by under DP
        results.append(r)

    def weights(sq_norms: Sequence[float]) -> dict[int, float]:  # q = 1, L = 1/η = 1: h_k = ‖Δ_k‖² + F_k
        total = sum(sq + f for sq, f in zip(sq_norms, losses, strict=True))
        return {cid: f / total for cid, f in enumerate(losses)}

    corrected = aggregate(strategy("qffl", q=1.0), ctx, results)
    raw = aggregate(strategy("qffl", q=1.0, dp_noise_correction=False), ctx, results)
    assert corrected.weights == pytest.approx(weights([x * x for x in signals]), rel=1e-5)
    assert raw.weights == pytest.approx(weights([x * x + e for x, e in zip(signals, energies, strict=True)]), rel=1e-5)
    assert corrected.metrics["step_scale"] == pytest.approx(3.0 / 3.45, rel=1e-5)  # ΣF / (Σ‖s‖² + ΣF)
    assert raw.metrics["step_scale"] == pytest.approx(3.0 / 5.15, rel=1e-5)  # the noise (1.7) dwarfs the signal


def test_dp_qffl_noise_correction_needs_sgd() -> None:
    base = {
        "data": {"dataset": "synthetic", "num_clients": 4},
        "strategy": {"name": "qffl"},
        "selection": {"clients_per_round": 4},
        "training": {"local_steps": 1, "optimizer": "adam", "lr": 0.01},
        "privacy": {"enabled": True, "epsilon": 8.0, "sample_rate": 0.1, "noise_multiplier": 1.5, "clip_norm": 1.0},
    }
    with pytest.raises(ConfigError, match=r"strategy\.params\.dp_noise_correction: .*training\.optimizer adam"):
        experiment_from_dict(base)
    base["strategy"]["params"] = {"dp_noise_correction": False}
    assert experiment_from_dict(base).strategy.name == "qffl"


def test_qffl_q0_is_uniform_average() -> None:
    out = aggregate(strategy("qffl", q=0.0), context(X0, [0, 1, 2]), THREE)
    want = torch.tensor(X0, dtype=torch.float64) + stack(THREE).mean(0)
    assert torch.allclose(out.params.double(), want, atol=1e-7, rtol=0)
    assert out.weights == pytest.approx({0: 1 / 3, 1: 1 / 3, 2: 1 / 3}, abs=1e-15)


def test_qffl_zero_loss_guard() -> None:
    results = [result(0, [0.1, 0.2, -0.3], 0.0), result(1, [-0.2, 0.05, 0.1], 1.0)]
    out = aggregate(strategy("qffl", q=0.5), context(X0, [0, 1]), results)
    assert torch.isfinite(out.params).all()
    assert out.weights[0] == 0.0 and out.weights[1] > 0
    # q = 0 with a zero loss: F^0 = 1 and the curvature term vanishes, so it is still the plain average.
    out0 = aggregate(strategy("qffl", q=0.0), context(X0, [0, 1]), results)
    assert out0.weights == pytest.approx({0: 0.5, 1: 0.5})
    # Every client at zero loss: no step at all.
    zero = [result(0, [0.1, 0.2, -0.3], 0.0), result(1, [-0.2, 0.05, 0.1], 0.0)]
    out_zero = aggregate(strategy("qffl", q=0.5), context(X0, [0, 1]), zero)
    assert torch.equal(out_zero.params, torch.tensor(X0))


# --- AFL ------------------------------------------------------------------------------------------------------------


def test_afl_moves_weight_to_high_loss_clients_and_stays_on_simplex() -> None:
    s = strategy("afl", lambda_lr=0.5)
    ctx = context(X0, [0, 1, 2])
    first = aggregate(s, ctx, THREE)
    assert first.weights == pytest.approx({0: 1 / 3, 1: 1 / 3, 2: 1 / 3})  # λ starts uniform
    want = torch.tensor(X0, dtype=torch.float64) + stack(THREE).mean(0)
    assert torch.allclose(first.params.double(), want, atol=1e-7, rtol=0)
    lam = s.mixture
    assert lam.sum() == pytest.approx(1.0, abs=1e-12) and (lam > 0).all()
    # λ_i ∝ exp(η F_i): the hand value, ordered like the losses.
    e = np.exp(0.5 * np.array([0.4, 1.2, 2.5]))
    np.testing.assert_allclose(lam, e / e.sum(), rtol=1e-12)
    second = aggregate(s, ctx, THREE)
    assert second.weights[0] < second.weights[1] < second.weights[2]
    assert sum(second.weights.values()) == pytest.approx(1.0)
    assert second.metrics["lambda_max"] == pytest.approx(float(s.mixture.max()))
    # Partial participation: weights are λ restricted to the round's clients, renormalised.
    lam_before = s.mixture.copy()
    third = aggregate(s, context(X0, [0, 2]), [THREE[0], THREE[2]])
    assert third.weights[0] == pytest.approx(lam_before[0] / (lam_before[0] + lam_before[2]))
    assert s.mixture.sum() == pytest.approx(1.0, abs=1e-12)


def test_afl_grows_lambda_for_new_clients_and_restores_state() -> None:
    s = strategy("afl", lambda_lr=0.0)  # η = 0: λ only changes by growth
    aggregate(s, context(X0, [0, 1]), THREE[:2])
    np.testing.assert_allclose(s.mixture, [0.5, 0.5])
    aggregate(s, context(X0, [3]), [result(3, [0.0, 0.0, 1.0], 1.0)])
    np.testing.assert_allclose(s.mixture, [0.25, 0.25, 0.25, 0.25])  # ids 2 and 3 join with uniform mass
    s2 = strategy("afl", lambda_lr=1.0)
    aggregate(s2, context(X0, [0, 1]), THREE[:2])
    lam = s2.mixture.copy()
    aggregate(s2, context(X0, [3]), [result(3, [0.0, 0.0, 1.0], 0.0)])  # F = 0: ascent leaves λ_3's mass alone
    np.testing.assert_allclose(s2.mixture, [lam[0] / 2, lam[1] / 2, 0.25, 0.25], rtol=1e-12)
    restored = strategy("afl", lambda_lr=1.0)
    restored.load_state_dict(s2.state_dict())
    np.testing.assert_array_equal(restored.mixture, s2.mixture)


# --- FedMGDA+ -------------------------------------------------------------------------------------------------------


def random_results(m: int, d: int, seed: int) -> list[ClientResult]:
    gen = torch.Generator().manual_seed(seed)
    scales = torch.rand(m, generator=gen) * 2 + 0.1
    return [result(i, (torch.randn(d, generator=gen) * scales[i]).tolist(), loss_before=float(i + 1)) for i in range(m)]


def normalised(results: Sequence[ClientResult]) -> torch.Tensor:
    d = stack(results)
    return d / d.norm(dim=1, keepdim=True)


def lam_of(out: AggregateOutcome, results: Sequence[ClientResult]) -> np.ndarray:
    return np.array([out.weights[r.client_id] for r in results])


def check_capped_kkt(lam: np.ndarray, gram: np.ndarray, lo: float, hi: float, tol: float = 1e-7) -> None:
    """KKT of min λᵀGλ on {Σλ = 1, lo ≤ λ ≤ hi}: free coordinates share (Gλ)_i = μ, those at lo have (Gλ)_i ≥ μ,
    those at hi have (Gλ)_i ≤ μ."""
    grad = gram @ lam
    at_lo, at_hi = lam <= lo + 1e-9, lam >= hi - 1e-9
    free = ~(at_lo | at_hi)
    # A multiplier μ must exist: μ ≤ every (Gλ)_i at lo, μ ≥ every (Gλ)_i at hi, μ = every free (Gλ)_i.
    upper = min(grad[at_lo].min(initial=np.inf), grad[free].min(initial=np.inf))
    lower = max(grad[at_hi].max(initial=-np.inf), grad[free].max(initial=-np.inf))
    assert lower <= upper + tol


def test_fedmgda_eps0_is_uniform_average_of_normalised_updates() -> None:
    results = random_results(5, 12, seed=1)
    x0 = [0.0] * 12
    out = aggregate(strategy("fedmgda_plus", epsilon=0.0), context(x0, range(5)), results)
    want = normalised(results).mean(0)
    assert torch.allclose(out.params.double(), want, atol=1e-6, rtol=0)
    np.testing.assert_allclose(lam_of(out, results), 0.2)
    raw = aggregate(strategy("fedmgda_plus", epsilon=0.0, normalize=False), context(x0, range(5)), results)
    assert torch.allclose(raw.params.double(), stack(results).mean(0), atol=1e-6, rtol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fedmgda_eps1_is_the_min_norm_point(seed: int) -> None:
    results = random_results(6, 10, seed=seed)
    out = aggregate(strategy("fedmgda_plus", epsilon=1.0, server_lr=0.5), context([0.0] * 10, range(6)), results)
    lam = lam_of(out, results)
    assert lam.sum() == pytest.approx(1.0, abs=1e-12) and (lam >= 0).all()
    d = normalised(results)
    gram = (d @ d.T).numpy()
    check_capped_kkt(lam, gram, 0.0, 1.0)
    # An independent solver agrees on the optimal value.
    ref = minimize(
        lambda v: v @ gram @ v,
        np.full(6, 1 / 6),
        jac=lambda v: 2 * gram @ v,
        bounds=[(0, 1)] * 6,
        constraints=[{"type": "eq", "fun": lambda v: v.sum() - 1}],
        method="SLSQP",
        options={"ftol": 1e-15, "maxiter": 1000},
    )
    assert lam @ gram @ lam <= ref.fun + 1e-10
    assert out.metrics["direction_norm"] == pytest.approx(math.sqrt(lam @ gram @ lam), rel=1e-9)
    # x_{t+1} = x_t + server_lr Σ λ_i d_i
    assert torch.allclose(out.params.double(), 0.5 * (torch.from_numpy(lam) @ d), atol=1e-6, rtol=0)


@pytest.mark.parametrize("epsilon", [0.03, 0.08, 0.1])
def test_fedmgda_respects_bounds_and_is_optimal_within_them(epsilon: float) -> None:
    m = 6
    results = random_results(m, 4, seed=7)  # d < m: G is singular, the hard case for the solver
    out = aggregate(strategy("fedmgda_plus", epsilon=epsilon), context([0.0] * 4, range(m)), results)
    lam = lam_of(out, results)
    lo, hi = max(0.0, 1 / m - epsilon), 1 / m + epsilon
    assert lam.sum() == pytest.approx(1.0, abs=1e-12)
    assert (lam >= lo - 1e-12).all() and (lam <= hi + 1e-12).all()
    d = normalised(results)
    check_capped_kkt(lam, (d @ d.T).numpy(), lo, hi, tol=1e-6)


def test_fedmgda_two_clients_closed_form_and_determinism() -> None:
    # Without normalisation, u1 = (1, 0), u2 = (0, 2): λ1 = (u2 − u1)·u2 / ‖u1 − u2‖² = 4/5.
    results = [result(0, [1.0, 0.0], 1.0), result(1, [0.0, 2.0], 1.0)]
    s = strategy("fedmgda_plus", epsilon=1.0, normalize=False)
    out = aggregate(s, context([0.0, 0.0], [0, 1]), results)
    assert out.weights == pytest.approx({0: 0.8, 1: 0.2}, abs=1e-9)
    assert torch.allclose(out.params, torch.tensor([0.8, 0.4]), atol=1e-7)
    again = aggregate(s, context([0.0, 0.0], [0, 1]), results)
    assert torch.equal(out.params, again.params) and out.weights == again.weights


def test_fedmgda_zero_update_and_single_client() -> None:
    results = [result(0, [0.0, 0.0, 0.0], 1.0), result(1, [1.0, 2.0, 3.0], 1.0)]
    out = aggregate(strategy("fedmgda_plus", epsilon=1.0), context(X0, [0, 1]), results)
    assert torch.isfinite(out.params).all()
    assert torch.allclose(out.params, torch.tensor(X0), atol=1e-7)  # the zero vector is the min-norm point
    one = aggregate(strategy("fedmgda_plus"), context(X0, [4]), [result(4, [3.0, 0.0, 4.0], 1.0)])
    assert torch.allclose(one.params, torch.tensor(X0) + torch.tensor([0.6, 0.0, 0.8]), atol=1e-7)
    assert one.weights == {4: 1.0}


def test_capped_simplex_projection_against_bisection() -> None:
    rng = np.random.default_rng(3)
    for _ in range(50):
        m = int(rng.integers(2, 30))
        y = rng.normal(0, 1, m)
        eps = float(rng.uniform(0, 1))
        lo, hi = max(0.0, 1 / m - eps), min(1.0, 1 / m + eps)
        got = project_capped_simplex(y, lo, hi)
        a, b = float(y.min() - hi - 1), float(y.max() - lo + 1)
        for _ in range(200):
            mid = (a + b) / 2
            a, b = (mid, b) if np.clip(y - mid, lo, hi).sum() > 1 else (a, mid)
        np.testing.assert_allclose(got, np.clip(y - (a + b) / 2, lo, hi), atol=1e-12)
        assert got.sum() == pytest.approx(1.0, abs=1e-12)
    # Ties (every knot repeated) and a point already inside the set.
    np.testing.assert_allclose(project_capped_simplex(np.zeros(7), 0.0, 0.5), np.full(7, 1 / 7), atol=1e-15)
    inside = np.array([0.2, 0.3, 0.5])
    np.testing.assert_allclose(project_capped_simplex(inside, 0.1, 0.6), inside, atol=1e-15)


def test_min_norm_weights_scales_to_hundreds_of_clients() -> None:
    rng = np.random.default_rng(0)
    d = rng.normal(size=(300, 50))
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    lam, iterations = min_norm_weights(d @ d.T, 1.0)
    assert lam.sum() == pytest.approx(1.0, abs=1e-12) and (lam >= 0).all() and iterations > 0
    check_capped_kkt(lam, d @ d.T, 0.0, 1.0, tol=1e-6)


# --- TERM -----------------------------------------------------------------------------------------------------------


def test_term_tilt0_is_uniform_and_large_tilt_follows_worst_client() -> None:
    ctx = context(X0, [0, 1, 2])
    uniform = aggregate(strategy("term", tilt=0.0), ctx, THREE)
    assert uniform.weights == {0: 1 / 3, 1: 1 / 3, 2: 1 / 3}
    assert torch.allclose(uniform.params.double(), torch.tensor(X0).double() + stack(THREE).mean(0), atol=1e-7)
    worst = aggregate(strategy("term", tilt=200.0), ctx, THREE)  # exp(200·F) overflows without log-sum-exp
    assert worst.weights[2] == pytest.approx(1.0, abs=1e-12)
    assert torch.allclose(worst.params, torch.tensor(X0) + THREE[2].payloads[UPDATE], atol=1e-7)
    best = aggregate(strategy("term", tilt=-200.0), ctx, THREE)
    assert best.weights[0] == pytest.approx(1.0, abs=1e-12)


def test_term_weights_by_hand() -> None:
    out = aggregate(strategy("term", tilt=0.8), context(X0, [0, 1, 2]), THREE)
    e = [math.exp(0.8 * f) for f in (0.4, 1.2, 2.5)]
    want = {i: v / sum(e) for i, v in enumerate(e)}
    # Streaming aggregation rounds each weight's mantissa to float32 (exact products, fairfl/fold.py).
    assert out.weights == pytest.approx(want, rel=2**-23)
    expected = torch.tensor(X0).double() + sum(want[i] * THREE[i].payloads[UPDATE].double() for i in range(3))
    assert torch.allclose(out.params.double(), expected, atol=1e-7)
    assert out.metrics["weight_entropy"] == pytest.approx(-sum(w * math.log(w) for w in want.values()))


# --- acceptance identities on real training -------------------------------------------------------------------------


def equal_size_data(num_clients: int = 6, train: int = 40, test: int = 10, seed: int = 0) -> FederatedData:
    """Synthetic-shaped (60 features, 10 classes) clients of identical size, each with its own linear teacher."""
    rng = np.random.default_rng(seed)
    xs_tr, ys_tr, xs_te, ys_te = [], [], [], []
    for _ in range(num_clients):
        w = rng.normal(size=(60, 10))
        x = rng.normal(rng.normal(), 1.0, size=(train + test, 60)).astype(np.float32)
        y = np.argmax(x @ w, axis=1).astype(np.int64)
        xs_tr.append(x[:train])
        ys_tr.append(y[:train])
        xs_te.append(x[train:])
        ys_te.append(y[train:])
    tr = ArrayDataset(np.concatenate(xs_tr), np.concatenate(ys_tr), 10, "equal-train")
    te = ArrayDataset(np.concatenate(xs_te), np.concatenate(ys_te), 10, "equal-test")
    return FederatedData(
        tr,
        te,
        [np.arange(k * train, (k + 1) * train) for k in range(num_clients)],
        [np.arange(k * test, (k + 1) * test) for k in range(num_clients)],
    )


def config(name: str, params: dict[str, Any], **data: Any) -> ExperimentConfig:
    return experiment_from_dict(
        {
            "name": "baselines",
            "seed": 11,
            "rounds": 3,
            "data": {"dataset": "synthetic", "num_clients": 6, **data},
            "model": {"name": "logreg"},
            "training": {"local_steps": 4, "batch_size": 8, "lr": 0.1},
            "selection": {"clients_per_round": 4},
            "strategy": {"name": name, "params": params},
            "evaluation": {"every": 3},
        }
    )


def run_oracle(cfg: ExperimentConfig) -> tuple[torch.Tensor, list[control_pb2.RoundEvent]]:
    events: list[control_pb2.RunEvent] = []
    engine = RoundEngine(
        "oracle", cfg, InProcessTransport(), LocalSelector(cfg.selection.method), LocalPrivacy(), events.append
    )
    summary = engine.run()
    assert summary.state == control_pb2.RUN_STATE_COMPLETED, summary.message
    return summary.final_params, [e.round for e in events if e.HasField("round")]


def test_fedfair_lambda0_is_fedavg_bit_for_bit_end_to_end() -> None:
    want, want_rounds = run_oracle(config("fedavg", {}))  # synthetic: unequal client sizes, p_i = n_i / Σ n
    got, got_rounds = run_oracle(config("fedfair", {"fair_lambda": 0.0}))
    assert torch.equal(got, want)
    for g, w in zip(got_rounds, want_rounds, strict=True):
        assert list(g.aggregation_weights) == list(w.aggregation_weights)
        assert g.model_sha256 == w.model_sha256
        metrics = {m.name: m.value for m in g.strategy_metrics}
        assert {"global_loss", "psi", "psi_before", "weight_entropy"} <= set(metrics)
    # With λ > 0 the fair step size is live, so the model differs.
    fair, _ = run_oracle(config("fedfair", {"fair_lambda": 1.0}))
    assert not torch.equal(fair, want)


def test_qffl_q0_matches_fedavg_on_real_client_results() -> None:
    cfg = config("fedavg", {})
    x0 = initial_model(cfg)[1]
    data = equal_size_data()
    runtime = ClientRuntime(cfg, data, list(range(data.num_clients)), torch.device("cpu"), lambda _: x0)
    train = federation_pb2.LocalTrainingConfig(local_steps=5, batch_size=8, lr=0.1)
    ctx = RoundContext("r", 1, x0, [0, 2, 3, 5], train, lambda _: tensor_pb2.BlobRef())
    results = [
        runtime.run(
            federation_pb2.Task(
                task_id=f"t{c}", run_id="r", round=1, phase=TRAIN, client_id=c, seed=100 + c, train=train
            )
        )
        for c in ctx.selected
    ]
    assert len({r.num_samples for r in results}) == 1
    fedavg = aggregate(strategy("fedavg"), ctx, results)
    qffl = aggregate(strategy("qffl", q=0.0), ctx, results)
    assert not torch.equal(fedavg.params, x0)
    assert float((qffl.params - fedavg.params).abs().max()) <= 1e-6
    assert qffl.weights == pytest.approx(fedavg.weights, abs=1e-12)


def test_qffl_q0_matches_fedavg_end_to_end_on_equal_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inprocess, "load_run_data", lambda cfg: equal_size_data(cfg.data.num_clients))
    want, _ = run_oracle(config("fedavg", {}))
    got, got_rounds = run_oracle(config("qffl", {"q": 0.0}))
    assert not torch.equal(got, initial_model(config("qffl", {"q": 0.0}))[1]), "training must move the model"
    assert float((got - want).abs().max()) <= 1e-6
    assert all(w == pytest.approx(0.25, abs=1e-12) for r in got_rounds for w in r.aggregation_weights)


def fashion_mnist_available() -> bool:
    try:
        load_dataset("fashion_mnist", "test")
    except DatasetNotFoundError:
        return False
    return True


def test_fedfair_and_qffl_match_fedavg_on_fashion_mnist_iid() -> None:
    if not fashion_mnist_available():
        pytest.skip("Fashion-MNIST is not installed (Debian package dataset-fashion-mnist)")

    def fmnist(name: str, params: dict[str, Any]) -> ExperimentConfig:
        cfg = config(name, params, dataset="fashion_mnist", partition="iid", num_clients=10)
        cfg.model.name = "mlp"
        cfg.model.params = {"hidden": [32]}
        return cfg

    data = load_run_data(fmnist("fedavg", {}))
    assert len({len(i) for i in data.train_indices}) == 1, "iid must give equal client sizes for q = 0 ≡ FedAvg"
    want, _ = run_oracle(fmnist("fedavg", {}))
    fair, _ = run_oracle(fmnist("fedfair", {"fair_lambda": 0.0}))
    qffl, _ = run_oracle(fmnist("qffl", {"q": 0.0}))
    assert torch.equal(fair, want)
    assert float((qffl - want).abs().max()) <= 1e-6


def test_loss_passes_run_only_where_the_losses_are_read() -> None:
    """FedAvg reads no F_i: its tasks skip the loss passes (so no Ψ telemetry) and train the same model bit for bit;
    training.loss_telemetry brings the passes and Ψ back."""
    skipped, skipped_rounds = run_oracle(config("fedavg", {}))
    data = config("fedavg", {}).to_dict()
    data["training"]["loss_telemetry"] = True
    measured, measured_rounds = run_oracle(experiment_from_dict(data))
    assert torch.equal(skipped, measured)  # the passes never touch the model
    for event in skipped_rounds:
        assert not {m.name for m in event.strategy_metrics} & {"psi", "psi_before"}
    for event in measured_rounds:
        metrics = {m.name: m.value for m in event.strategy_metrics}
        assert metrics["psi"] > 0 and metrics["psi_before"] > 0


def test_the_timed_wrapper_reports_what_its_strategy_reads() -> None:
    """The aggregator server wraps every strategy in TimedStrategy: the wrapper must not answer with the default."""
    from aggregator_service.monitoring import TimedStrategy

    assert TimedStrategy(strategy("fedavg")).reads_client_losses is False
    assert TimedStrategy(strategy("qffl", q=1.0)).reads_client_losses is True


@pytest.mark.parametrize(
    ("name", "params", "skips"),
    [
        ("fedavg", {}, True),
        ("fedprox", {"mu": 0.01}, True),
        ("fedmgda_plus", {}, True),
        ("qffl", {"q": 1.0}, False),  # weights by loss_before
        ("fairfed", {}, False),  # by accuracy_before
        ("fedeba_plus", {}, False),  # by loss_after and loss_before
    ],
)
def test_tasks_skip_the_loss_passes_by_what_the_strategy_reads(name: str, params: dict[str, Any], skips: bool) -> None:
    engine = RoundEngine(
        "x", config(name, params), InProcessTransport(), LocalSelector("random"), LocalPrivacy(), lambda e: None
    )
    assert engine._round_train_config(1).skip_losses is skips
