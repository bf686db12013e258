"""FedEBA family: the paper's identities (spec seed-fedeba.md §2, §8) and the strategies' update rules."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from aggregator_service.strategies.fedeba import (
    FedEBA,
    FedEBAParams,
    FedEBAPlus,
    FedEBAPlusParams,
    PracFedEBAPlus,
    eba_weights,
)
from fairfl.metrics.fairness import loss_angle_degrees
from fairfl.protocol import FIRST_STEP_UPDATE, GRADIENT, PROBE, TRAIN, UPDATE, ClientResult
from fairfl.strategy import RoundContext
from fairfl.v1 import federation_pb2, tensor_pb2


def _free_energy(p: np.ndarray, f: np.ndarray, tau: float) -> float:
    """H(p) + <p, F>/τ: the objective whose maximiser over the simplex is the EBA weights (Eq. 16-19)."""
    p = np.clip(p, 1e-300, None)
    return float(-(p * np.log(p)).sum() + (p * f).sum() / tau)


@pytest.mark.parametrize("tau", [0.1, 0.5, 1.0, 5.0])
def test_eba_weights_are_the_maximum_entropy_solution(tau: float) -> None:
    rng = np.random.default_rng(3)
    f = rng.uniform(0.2, 2.5, size=7)
    p, tau_eff = eba_weights(f, tau)
    assert tau_eff == tau
    log_z = math.log(np.exp(f / tau).sum())
    # The optimum's value is the log-partition log Z (Eq. 19).
    assert _free_energy(p, f, tau) == pytest.approx(log_z, rel=1e-12, abs=1e-12)
    # A generic optimiser over the simplex finds the same point, and no random simplex point does better.
    res = minimize(
        lambda x: -_free_energy(x, f, tau),
        np.full(7, 1 / 7),
        method="SLSQP",
        bounds=[(0, 1)] * 7,
        constraints=[{"type": "eq", "fun": lambda x: x.sum() - 1}],
        options={"ftol": 1e-14, "maxiter": 500},
    )
    assert np.abs(res.x - p).max() < 1e-4
    for q in rng.dirichlet(np.ones(7), size=200):
        assert _free_energy(q, f, tau) <= log_z + 1e-12


def test_temperature_limits() -> None:
    f = np.array([0.3, 1.7, 0.9, 2.4, 0.1])
    uniform, _ = eba_weights(f, 1e9)
    assert np.abs(uniform - 0.2).max() < 1e-8  # τ → ∞: FedAvg's uniform weights
    greedy, _ = eba_weights(f, 1e-4)
    assert greedy[3] > 1 - 1e-12 and greedy.argmax() == int(f.argmax())  # τ → 0: all weight on the worst client
    assert np.all(np.diff(eba_weights(np.sort(f), 0.5)[0]) > 0)  # higher loss, higher weight


def test_prior_multiplies_weights() -> None:
    f = np.array([1.0, 1.0, 2.0])
    q = np.array([1.0, 3.0, 4.0])
    p, _ = eba_weights(f, 1.0, prior=q)
    expected = q * np.exp(f)
    np.testing.assert_allclose(p, expected / expected.sum(), rtol=1e-12)


def test_clamp_keeps_min_weight_above_eps() -> None:
    f = np.array([0.05, 3.0, 40.0, 2.2])  # τ = 0.1 would put ~e^-400 on the best client
    raw, _ = eba_weights(f, 0.1)
    assert raw.min() < 1e-100
    eps = 1e-6
    p, tau_eff = eba_weights(f, 0.1, clamp_eps=eps)
    assert tau_eff == pytest.approx((f.max() - f.min()) / math.log(1 / (len(f) * eps)))
    assert p.min() >= eps * (1 - 1e-9)
    # The clamp only ever raises τ: with a small spread it leaves τ alone.
    _, untouched = eba_weights(np.array([1.0, 1.01]), 0.1, clamp_eps=eps)
    assert untouched == 0.1


def test_eba_is_overflow_safe_and_validates() -> None:
    p, _ = eba_weights([500.0, 400.0], 0.1)  # exp(5000) overflows without log-sum-exp
    assert p[0] == 1.0 and np.isfinite(p).all()
    with pytest.raises(ValueError, match="finite"):
        eba_weights([1.0, float("nan")], 1.0)
    with pytest.raises(ValueError, match="tau"):
        eba_weights([1.0], 0.0)


def test_loss_angle_is_arctan_of_the_loss_cv() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        losses = rng.uniform(0.0, 3.0, size=rng.integers(2, 20))
        cv = losses.std() / losses.mean()
        assert loss_angle_degrees(losses) == pytest.approx(math.degrees(math.atan(cv)), abs=1e-9)


# -- strategy update rules on hand-made results --------------------------------------------------------------------


def _ctx(params: torch.Tensor, lr: float = 0.1, steps: int = 10) -> RoundContext:
    cfg = federation_pb2.LocalTrainingConfig(local_steps=steps, batch_size=50, lr=lr)
    published: list[torch.Tensor] = []

    def publish(t: torch.Tensor) -> tensor_pb2.BlobRef:
        published.append(t.clone())
        return tensor_pb2.BlobRef(sha256=f"blob{len(published)}")

    ctx = RoundContext("run", 1, params, [0, 1, 2], cfg, publish)
    ctx.published = published  # type: ignore[attr-defined]
    return ctx


def _results(
    phase: int,
    deltas: list[torch.Tensor],
    before: list[float],
    after: list[float],
    kind: int = UPDATE,
    sizes: list[int] | None = None,
    first: list[torch.Tensor] | None = None,
    steps: float = 10.0,
) -> list[ClientResult]:
    out = []
    for i, (d, b, a) in enumerate(zip(deltas, before, after, strict=True)):
        r = ClientResult(
            task_id=f"t{i}",
            run_id="run",
            round=1,
            client_id=i,
            phase=phase,
            num_samples=(sizes or [100] * len(deltas))[i],
            loss_before=b,
            loss_after=a,
            metrics={"local_steps": steps},
        )
        r.payloads[kind] = d
        if first is not None:
            r.payloads[FIRST_STEP_UPDATE] = first[i]
        out.append(r)
    return out


DELTAS = [torch.tensor([1.0, -2.0, 0.5]), torch.tensor([0.0, 1.0, 1.0]), torch.tensor([-1.0, 0.5, 2.0])]


def test_fedeba_aggregates_with_softmax_of_post_training_losses() -> None:
    x = torch.tensor([0.1, 0.2, 0.3])
    results = _results(TRAIN, DELTAS, [2.0, 1.0, 0.5], [1.2, 0.4, 0.9])
    out = FedEBA(FedEBAParams(tau=0.5), server_lr=1.0).aggregate(_ctx(x), [results])
    p = np.exp(np.array([1.2, 0.4, 0.9]) / 0.5)
    p /= p.sum()
    expected = x + sum(float(w) * d for w, d in zip(p, DELTAS, strict=True))
    torch.testing.assert_close(out.params, expected, rtol=0, atol=1e-6)
    assert out.weights[0] == pytest.approx(p[0])


def test_fedeba_plus_builds_the_fair_gradient_from_pre_training_losses() -> None:
    x = torch.zeros(3)
    strategy = FedEBAPlus(FedEBAPlusParams(tau=1.0, alpha=0.9), server_lr=1.0)
    ctx = _ctx(x)
    plan0 = strategy.configure(ctx, 0, [])
    assert plan0 is not None and plan0.phase == PROBE and plan0.probe.want_gradient
    grads = [torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0]), torch.tensor([0.0, 0.0, 1.0])]
    probe = _results(PROBE, grads, [0.5, 1.5, 1.0], [math.nan] * 3, kind=GRADIENT)
    plan1 = strategy.configure(ctx, 1, [probe])
    assert plan1 is not None and plan1.phase == TRAIN
    assert plan1.train.alignment.alpha == pytest.approx(0.9) and plan1.train.alignment.fair_gradient.sha256
    p_tilde = np.exp(np.array([0.5, 1.5, 1.0]))
    p_tilde /= p_tilde.sum()
    torch.testing.assert_close(ctx.published[-1], torch.tensor(p_tilde, dtype=torch.float32), rtol=0, atol=1e-7)
    assert strategy.configure(ctx, 2, [probe, []]) is None


def test_model_alignment_mixes_one_step_updates() -> None:
    x = torch.zeros(3)
    first = [d / 10 for d in DELTAS]
    results = _results(TRAIN, DELTAS, [1.0, 1.0, 1.0], [1.0, 2.0, 3.0], sizes=[100, 100, 200], first=first)
    strategy = FedEBAPlus(FedEBAPlusParams(tau=1.0, alpha=0.5, mode="model"), server_lr=1.0)
    plan = strategy.configure(_ctx(x), 0, [])
    assert plan is not None and plan.train.record_first_step
    out = strategy.aggregate(_ctx(x), [results])
    p = np.exp(np.array([1.0, 2.0, 3.0]))
    p /= p.sum()
    shares = np.array([0.25, 0.25, 0.5])
    expected = sum(0.5 * float(w) * d for w, d in zip(p, DELTAS, strict=True)) + sum(
        0.5 * float(s) * f for s, f in zip(shares, first, strict=True)
    )
    torch.testing.assert_close(out.params, expected, rtol=0, atol=1e-6)


def test_adaptive_switch_follows_the_loss_angle() -> None:
    strategy = FedEBAPlus(FedEBAPlusParams(mode="adaptive", theta_degrees=15.0), server_lr=1.0)
    ctx = _ctx(torch.zeros(3))
    assert not strategy.configure(ctx, 0, []).probe.want_gradient
    fair = _results(PROBE, [torch.zeros(3)] * 3, [1.0, 1.1, 0.95], [math.nan] * 3, kind=GRADIENT)  # angle ~3.7°
    unfair = _results(PROBE, [torch.zeros(3)] * 3, [0.2, 2.0, 1.0], [math.nan] * 3, kind=GRADIENT)  # angle ~36°
    model_branch = strategy.configure(ctx, 1, [fair])
    assert model_branch.phase == TRAIN and model_branch.train.record_first_step
    grad_branch = strategy.configure(ctx, 1, [unfair])
    assert grad_branch.phase == PROBE and grad_branch.probe.want_gradient
    assert strategy.configure(ctx, 2, [unfair, unfair]).phase == TRAIN


def test_prac_fedeba_plus_equals_the_algorithm_box_under_plain_sgd() -> None:
    """Alg. 3: g̃ = Σ p̃_j·(1/K)Σ_k ∇F_j, Δ̂_i = (1−α)Δ_i − α·η_L·K·g̃, Δ = Σ p_i·Δ̂_i; with plain SGD the mean local
    gradient of client j is −Δ_j/(η_L·K), so the result must equal (1−α)Σ p_iΔ_i + αΣ p̃_jΔ_j."""
    lr, k, alpha, tau = 0.1, 10, 0.9, 0.3
    x = torch.tensor([0.5, -0.5, 1.0])
    before, after = [2.0, 0.7, 1.1], [1.5, 0.3, 1.0]
    results = _results(TRAIN, DELTAS, before, after, steps=float(k))
    out = PracFedEBAPlus(FedEBAPlusParams(tau=tau, alpha=alpha), server_lr=1.0).aggregate(_ctx(x, lr, k), [results])

    p = np.exp(np.array(after) / tau)
    p /= p.sum()
    pt = np.exp(np.array(before) / tau)
    pt /= pt.sum()
    deltas = [d.double() for d in DELTAS]
    mean_grads = [-d / (lr * k) for d in deltas]
    g_fair = sum(float(w) * g for w, g in zip(pt, mean_grads, strict=True))
    box = sum(float(w) * ((1 - alpha) * d - alpha * lr * k * g_fair) for w, d in zip(p, deltas, strict=True))
    closed = (1 - alpha) * sum(float(w) * d for w, d in zip(p, deltas, strict=True)) + alpha * sum(
        float(w) * d for w, d in zip(pt, deltas, strict=True)
    )
    torch.testing.assert_close(box, closed, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.params.double(), x.double() + box, rtol=0, atol=1e-6)


def test_params_validation_names_the_field() -> None:
    from fairfl.config import ConfigError

    with pytest.raises(ConfigError, match=r"strategy\.params\.alpha"):
        FedEBAPlusParams(alpha=1.5).validate("strategy.params")
    with pytest.raises(ConfigError, match=r"strategy\.params\.mode"):
        FedEBAPlusParams(mode="both").validate("strategy.params")
    with pytest.raises(ConfigError, match=r"strategy\.params\.tau"):
        FedEBAParams(tau=0).validate("strategy.params")


def test_fedeba_plus_without_alignment_is_fedeba_exactly() -> None:
    """α = 0 turns the aligned step into the plain one; the probe shares the round's seed, so the training batches and
    therefore the whole run are identical to FedEBA's."""
    from aggregator_service.engine import RoundEngine
    from fairfl.compose.inprocess import InProcessTransport
    from fairfl.compose.local_privacy import LocalPrivacy
    from fairfl.compose.local_selection import LocalSelector
    from fairfl.config import experiment_from_dict

    finals = []
    for name, params in (("fedeba", {"tau": 0.5}), ("fedeba_plus", {"tau": 0.5, "alpha": 0.0})):
        config = experiment_from_dict(
            {
                "rounds": 3,
                "data": {"dataset": "synthetic", "num_clients": 8},
                "model": {"params": {"hidden": [16]}},
                "training": {"local_steps": 4, "batch_size": 10},
                "selection": {"clients_per_round": 3},
                "strategy": {"name": name, "params": params},
                "evaluation": {"every": 3},
            }
        )
        engine = RoundEngine("r", config, InProcessTransport(), LocalSelector("random"), LocalPrivacy(), lambda e: None)
        finals.append(engine.run().final_params)
    assert torch.equal(finals[0], finals[1])
