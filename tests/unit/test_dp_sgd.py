"""DP-SGD in the client agent (seed-fedfdp §1.3): clipping, fair coefficients, noise scale, loss release, policy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import stats

from client_agent import dp_sgd
from client_agent.dp_sgd import DpPolicy, PolicyRefusal
from client_agent.trainer import ClientRuntime
from fairfl.codec import CodecError
from fairfl.config import experiment_from_dict
from fairfl.data.datasets import ArrayDataset
from fairfl.data.federated import FederatedData
from fairfl.models import build_model
from fairfl.params import flatten_parameters
from fairfl.privacy import noise_divisor, update_noise_energy
from fairfl.protocol import TRAIN, UPDATE, check_against_task
from fairfl.v1 import federation_pb2

C = 0.5


def small_cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("cnn", (1, 12, 12), 10, channels=(3, 4), hidden=16, kernel_size=3)


def batch(n: int = 20, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 12, 12, generator=g), torch.randint(0, 10, (n,), generator=g)


def loop_per_sample(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[list[torch.Tensor], list[float]]:
    """Reference: one backward per sample (what the vectorised path must equal)."""
    grads, losses = [], []
    for j in range(len(y)):
        model.zero_grad()
        loss = F.cross_entropy(model(x[j : j + 1]), y[j : j + 1])
        loss.backward()
        grads.append(torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()]))
        losses.append(float(loss.detach()))
    return grads, losses


def flat(sums: dict[str, torch.Tensor], model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([sums[k].reshape(-1) for k, _ in model.named_parameters()])


# --- per-sample gradients and clipping --------------------------------------------------------------------------------


def test_per_sample_gradients_equal_a_per_sample_loop() -> None:
    model = small_cnn()
    x, y = batch()
    fn = dp_sgd.per_sample_grad_fn(model)
    params = {k: v.detach() for k, v in model.named_parameters()}
    grads, losses = fn(params, {}, x, y)
    ref_grads, ref_losses = loop_per_sample(model, x, y)
    got = torch.cat([grads[k].reshape(len(y), -1) for k, _ in model.named_parameters()], dim=1)
    assert torch.allclose(got, torch.stack(ref_grads), atol=1e-6)
    assert losses.tolist() == pytest.approx(ref_losses, abs=1e-6)


METHODS = ("vmap", "layerwise")


@pytest.mark.parametrize("method", METHODS)
def test_lambda_zero_is_standard_dp_sgd_clipping(method: str) -> None:
    """λ = 0: Σ_j g_j · min(1, C/(‖g_j‖ + 1e-6)), whatever the global loss; chunking does not change the sum."""
    model = small_cnn()
    x, y = batch(37)
    ref_grads, _ = loop_per_sample(model, x, y)
    clip = float(torch.stack([g.norm() for g in ref_grads]).median())  # half the samples clipped, half not
    expected = sum(g * min(1.0, clip / (float(g.norm()) + 1e-6)) for g in ref_grads)
    for global_loss, chunk in ((0.0, 64), (123.0, 5), (-4.0, 1)):
        got = dp_sgd.clipped_gradient_sum(
            model, x, y, clip, fair_lambda=0.0, global_loss=global_loss, chunk=chunk, method=method
        )
        assert torch.allclose(flat(got.sums, model), expected, atol=1e-6)
        assert got.batch == 37


@pytest.mark.parametrize("method", METHODS)
def test_every_sample_contribution_is_bounded_by_c(method: str) -> None:
    """‖c_j g_j‖ ≤ C for every sample, including negative fair coefficients (the guard) and large ones."""
    model = small_cnn()
    x, y = batch(24)
    ref_grads, ref_losses = loop_per_sample(model, x, y)
    for lam, global_loss in ((0.0, 0.0), (0.1, 0.0), (50.0, 0.0), (5.0, 2.3), (100.0, 10.0)):
        for j in range(len(y)):
            one = dp_sgd.clipped_gradient_sum(model, x[j : j + 1], y[j : j + 1], C, lam, global_loss, method=method)
            norm = float(flat(one.sums, model).norm())
            assert norm <= C * (1 + 1e-5), (lam, global_loss, j, norm)
            # and the coefficient is exactly Eq. 15 with the guard
            coef = min(max(1 + lam * (ref_losses[j] - global_loss), 0.0), C / (float(ref_grads[j].norm()) + 1e-6))
            assert norm == pytest.approx(coef * float(ref_grads[j].norm()), rel=1e-4, abs=1e-7)


@pytest.mark.parametrize(
    ("name", "kwargs", "shape"),
    [
        ("cnn", {"channels": (3, 4), "hidden": 16, "kernel_size": 3}, (1, 12, 12)),
        ("cnn", {"channels": (2, 3), "hidden": 8, "kernel_size": 5}, (3, 16, 16)),
        ("mlp", {"hidden": (12, 7)}, (1, 12, 12)),
        ("logreg", {}, (1, 12, 12)),
    ],
)
def test_layerwise_and_vmap_equal_the_per_sample_loop(name: str, kwargs: dict, shape: tuple[int, ...]) -> None:
    """The fast per-layer path (ghost norms for Linear, unfold for Conv2d) against a one-backward-per-sample loop,
    with fair coefficients on both sides of 1 and the clip binding for some samples only."""
    torch.manual_seed(0)
    model = build_model(name, shape, 10, **kwargs)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(29, *shape, generator=g), torch.randint(0, 10, (29,), generator=g)
    ref_grads, ref_losses = loop_per_sample(model, x, y)
    clip = float(torch.stack([gr.norm() for gr in ref_grads]).median())
    lam, global_loss = 0.8, float(np.mean(ref_losses))
    expected = sum(
        gr * min(max(1 + lam * (loss - global_loss), 0.0), clip / (float(gr.norm()) + 1e-6))
        for gr, loss in zip(ref_grads, ref_losses, strict=True)
    )
    assert dp_sgd.layerwise_supported(model)
    for method in METHODS:
        got = dp_sgd.clipped_gradient_sum(model, x, y, clip, lam, global_loss, chunk=8, method=method)
        assert torch.allclose(flat(got.sums, model), expected, atol=2e-6), method
        assert got.loss_sum == pytest.approx(sum(ref_losses), rel=1e-5)


def test_auto_method_choice() -> None:
    model = small_cnn()
    x, y = batch(5)
    prox = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    with pytest.raises(ValueError, match="unknown per-sample gradient method"):
        dp_sgd.clipped_gradient_sum(model, x, y, C, method="loop")
    with_prox = dp_sgd.clipped_gradient_sum(model, x, y, C, prox=prox)  # auto: layerwise, a zero prox changes nothing
    plain = dp_sgd.clipped_gradient_sum(model, x, y, C, method="layerwise")
    assert all(torch.equal(with_prox.sums[k], plain.sums[k]) for k in plain.sums)
    unsupported = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(144, 10), torch.nn.LayerNorm(10))
    assert not dp_sgd.layerwise_supported(unsupported)
    with pytest.raises(ValueError, match="all in Linear/Conv2d layers"):
        dp_sgd.clipped_gradient_sum(unsupported, x, y, C, method="layerwise")
    auto = dp_sgd.clipped_gradient_sum(unsupported, x, y, C)  # auto: vmap
    vmap = dp_sgd.clipped_gradient_sum(unsupported, x, y, C, method="vmap")
    assert all(torch.equal(auto.sums[k], vmap.sums[k]) for k in vmap.sums)


def test_fair_coefficients_follow_eq15_with_the_guard() -> None:
    losses = torch.tensor([0.5, 1.0, 3.0, 0.0])
    norms = torch.tensor([0.01, 0.01, 0.01, 10.0])
    coef = dp_sgd.fair_clip_coefficients(losses, norms, clip_norm=1.0, fair_lambda=2.0, global_loss=1.0)
    # 1 + 2(0.5 − 1) = 0 → 0; 1 + 0 = 1; 1 + 4 = 5; row 4: 1 + 2(0 − 1) = −1 → guard 0
    assert coef.tolist() == pytest.approx([0.0, 1.0, 5.0, 0.0])
    small_c = dp_sgd.fair_clip_coefficients(losses, norms, clip_norm=0.001, fair_lambda=2.0, global_loss=1.0)
    assert small_c[2] == pytest.approx(0.001 / (0.01 + 1e-6))  # C/‖g‖ binds


@pytest.mark.parametrize("method", METHODS)
def test_prox_term_is_added_before_clipping(method: str) -> None:
    model = small_cnn()
    x, y = batch(6)
    prox = {k: torch.full_like(p, 0.01) for k, p in model.named_parameters()}
    ref_grads, _ = loop_per_sample(model, x, y)
    shift = torch.cat([prox[k].reshape(-1) for k, _ in model.named_parameters()])
    expected = sum((g + shift) * min(1.0, C / (float((g + shift).norm()) + 1e-6)) for g in ref_grads)
    got = dp_sgd.clipped_gradient_sum(model, x, y, C, prox=prox, method=method)
    assert torch.allclose(flat(got.sums, model), expected, atol=1e-6)


@pytest.mark.parametrize(
    ("name", "kwargs", "shape"),
    [
        ("cnn", {"channels": (3, 4), "hidden": 16, "kernel_size": 3}, (1, 12, 12)),
        ("mlp", {"hidden": (12, 7)}, (1, 12, 12)),
        ("logreg", {}, (1, 12, 12)),
    ],
)
def test_layerwise_prox_equals_the_per_sample_loop(name: str, kwargs: dict, shape: tuple[int, ...]) -> None:
    """FedProx under DP on the layerwise path: the prox term μ(w − x_t) enters every sample's norm through
    2⟨g_j, p⟩ + ‖p‖² and the clipped sum through (Σ_j c_j) p. A prox as large as the gradients, so it moves which
    samples the clip binds, with fair coefficients on both sides of 1."""
    torch.manual_seed(0)
    model = build_model(name, shape, 10, **kwargs)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(29, *shape, generator=g), torch.randint(0, 10, (29,), generator=g)
    ref_grads, ref_losses = loop_per_sample(model, x, y)
    scale = float(torch.stack([gr.norm() for gr in ref_grads]).median()) / math.sqrt(ref_grads[0].numel())
    prox = {k: scale * torch.randn(p.shape, generator=g) for k, p in model.named_parameters()}
    shift = torch.cat([prox[k].reshape(-1) for k, _ in model.named_parameters()])
    shifted = [gr + shift for gr in ref_grads]
    clip = float(torch.stack([s.norm() for s in shifted]).median())
    lam, global_loss = 0.8, float(np.mean(ref_losses))
    expected = sum(
        s * min(max(1 + lam * (loss - global_loss), 0.0), clip / (float(s.norm()) + 1e-6))
        for s, loss in zip(shifted, ref_losses, strict=True)
    )
    for method in METHODS:
        got = dp_sgd.clipped_gradient_sum(model, x, y, clip, lam, global_loss, prox=prox, chunk=8, method=method)
        assert torch.allclose(flat(got.sums, model), expected, atol=2e-6), method


def test_layerwise_prox_keeps_the_clip_bound_when_the_prox_term_nearly_cancels_the_gradient() -> None:
    """p ≈ −g: ‖g + p‖² = ‖g‖² + 2⟨g, p⟩ + ‖p‖² is a small difference of large terms, which float32 terms would get
    wrong by a share of ‖g‖² (8% over C measured); the layerwise path sums them in float64 and keeps ‖c (g + p)‖ ≤ C."""
    torch.manual_seed(0)
    model = build_model("mlp", (1, 12, 12), 10, hidden=(64, 32))
    x, y = batch(1)
    ref, _ = loop_per_sample(model, x, y)
    shift = -0.999 * ref[0]
    prox, at = {}, 0
    for k, p in model.named_parameters():
        prox[k] = shift[at : at + p.numel()].reshape(p.shape).clone()
        at += p.numel()
    clip = 0.1 * float((ref[0] + shift).norm())  # the clip binds on the small remainder
    got = dp_sgd.clipped_gradient_sum(model, x, y, clip, prox=prox, method="layerwise")
    want = dp_sgd.clipped_gradient_sum(model, x, y, clip, prox=prox, method="vmap")
    assert float(flat(got.sums, model).norm()) <= clip * (1 + 1e-5)
    assert torch.allclose(flat(got.sums, model), flat(want.sums, model), rtol=1e-4, atol=clip * 1e-5)


def test_layerwise_prox_reaches_a_layer_that_did_not_run() -> None:
    """A parameter whose layer is not on the forward path has g_j = 0 but p ≠ 0: it counts in ‖g_j + p‖ and its sum
    is (Σ_j c_j) p, as with vmap."""

    class Skips(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = torch.nn.Linear(144, 10)
            self.unused = torch.nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x.flatten(1))

    torch.manual_seed(0)
    model = Skips()
    x, y = batch(9)
    prox = {k: torch.full_like(p, 0.05) for k, p in model.named_parameters()}
    vmap = dp_sgd.clipped_gradient_sum(model, x, y, C, prox=prox, method="vmap")
    layerwise = dp_sgd.clipped_gradient_sum(model, x, y, C, prox=prox, method="layerwise")
    for k in vmap.sums:
        assert torch.allclose(layerwise.sums[k], vmap.sums[k], atol=1e-6), k
    assert float(layerwise.sums["unused.weight"].abs().min()) > 0


def test_poisson_sampling_rate_and_determinism() -> None:
    sizes = [len(dp_sgd.poisson_sample(2000, 0.05, torch.Generator().manual_seed(s))) for s in range(200)]
    # Binomial(2000, 0.05): mean 100, std ≈ 9.75; the mean of 200 draws has std ≈ 0.69
    assert abs(np.mean(sizes) - 100) < 3.5
    assert 7.5 < np.std(sizes) < 12
    a = dp_sgd.poisson_sample(2000, 0.05, torch.Generator().manual_seed(3))
    b = dp_sgd.poisson_sample(2000, 0.05, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and bool((a[1:] > a[:-1]).all())


def test_normalizers() -> None:
    dp = federation_pb2.DpSgd(sample_rate=0.05, fixed_batch=64)
    assert noise_divisor(dp, 1000, 37) == pytest.approx(50.0)
    dp.grad_normalizer = federation_pb2.GRAD_NORMALIZER_REALIZED
    assert noise_divisor(dp, 1000, 37) == 37.0 and noise_divisor(dp, 1000, 0) == 1.0
    dp.grad_normalizer = federation_pb2.GRAD_NORMALIZER_FIXED
    assert noise_divisor(dp, 1000, 37) == 64.0


# --- noise: the statistical checks -----------------------------------------------------------------------------------


def synthetic_runtime(model: str = "mlp", randomness: str = "task", policy: DpPolicy | None = None) -> ClientRuntime:
    g = np.random.default_rng(0)
    n = 400
    train = ArrayDataset(g.normal(size=(n, 20)).astype(np.float32), g.integers(0, 10, n).astype(np.int64), 10, "t")
    test = ArrayDataset(g.normal(size=(50, 20)).astype(np.float32), g.integers(0, 10, 50).astype(np.int64), 10, "t")
    data = FederatedData(train, test, [np.arange(n)], [np.arange(50)])
    config = experiment_from_dict(
        {
            "data": {"dataset": "synthetic", "num_clients": 1},
            "model": {"name": model, "params": {"hidden": [128]} if model == "mlp" else {}},
            "selection": {"clients_per_round": 1},
            "runtime": {"agents": 1},
        }
    )
    blobs: dict[str, torch.Tensor] = {}
    runtime = ClientRuntime(
        config, data, [0], torch.device("cpu"), lambda ref: blobs[ref.sha256], policy, dp_randomness=randomness
    )
    blobs["x0"] = flatten_parameters(runtime.model)
    return runtime


def dp_task(seed: int = 5, steps: int = 1, **dp: float) -> federation_pb2.Task:
    settings = {"sample_rate": 0.1, "noise_multiplier": 2.0, "clip_norm": C, "loss_noise_multiplier": 5.0}
    settings.update(dp)
    task = federation_pb2.Task(task_id="t", run_id="r", round=1, phase=TRAIN, client_id=0, seed=seed)
    task.model.sha256 = "x0"
    task.train.local_steps = steps
    task.train.lr = 1.0
    task.train.batch_size = 50
    task.train.loss_eval_batches = 1
    task.train.dp.CopyFrom(federation_pb2.DpSgd(loss_clip=2.5, loss_clip_min=0.1, **settings))  # type: ignore[arg-type]
    return task


def test_noise_scale_on_a_zero_gradient_model() -> None:
    """Every clipped contribution is 0 (the fair coefficient is clamped: 1 + λ(ℓ − F) < 0 for F huge), so the update is
    −η Σ_k N(0, σ²C²I)/b: its coordinates must be i.i.d. N(0, K σ²C²/b²) (KS test) with the right std."""
    runtime = synthetic_runtime()
    task = dp_task(steps=3, noise_multiplier=2.0)
    task.train.dp.fair_lambda = 1.0
    task.train.fair_step.global_loss = 1e6
    task.train.fair_step.fair_lambda = 1.0
    update = runtime.run(task).payloads[UPDATE].double().numpy()
    b = 0.1 * 400
    std = math.sqrt(3) * 2.0 * C / b
    assert update.size > 3000
    assert np.std(update) == pytest.approx(std, rel=0.05)  # std of the estimate ≈ 1/√(2·size) ≈ 1.5%
    assert abs(np.mean(update)) < 5 * std / math.sqrt(update.size)
    assert stats.kstest(update / std, "norm").pvalue > 1e-3


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_update_noise_energy_is_what_the_trainer_adds(momentum: float) -> None:
    """The zero-gradient model above, with SGD momentum: the update is DP noise alone, and ‖update‖² must match
    fairfl.privacy.update_noise_energy, the public expectation DP-q-FFL subtracts (K = 3 steps; relative std of the
    squared norm of d ≈ 4,000 Gaussians ≈ √(2/d) ≈ 2%)."""
    runtime = synthetic_runtime()
    task = dp_task(steps=3, noise_multiplier=2.0)
    task.train.momentum = momentum
    task.train.dp.fair_lambda = 1.0
    task.train.fair_step.global_loss = 1e6
    task.train.fair_step.fair_lambda = 1.0
    update = runtime.run(task).payloads[UPDATE].double()
    expected = update_noise_energy(task.train, 400, update.numel())
    assert float(update @ update) == pytest.approx(expected, rel=0.08)
    # by hand, η = 1, b = q·n = 40: plain SGD Σ_s a_s² = K = 3; momentum 0.9 carries step 0's noise into all three
    # updates (gain 1 + 0.9 + 0.81 = 2.71), step 1's into two (1.9), step 2's into one: 2.71² + 1.9² + 1 = 11.9541
    per_coordinate = (2.0 * C / 40) ** 2
    gain = 11.9541 if momentum else 3.0
    assert expected == pytest.approx(update.numel() * per_coordinate * gain, rel=1e-12)


def test_update_noise_energy_with_weight_decay_and_refusing_adam() -> None:
    # K = 2, η = 0.5, wd = 0.2: step 0's unit moves p by −η, then decay pulls back η·wd·η: a_0 = −η(1 − η wd), a_1 = −η
    train = federation_pb2.LocalTrainingConfig(local_steps=2, lr=0.5, weight_decay=0.2)
    train.dp.CopyFrom(federation_pb2.DpSgd(sample_rate=0.1, noise_multiplier=1.0, clip_norm=1.0))
    gain = 0.25 * ((1 - 0.5 * 0.2) ** 2 + 1)
    assert update_noise_energy(train, 100, 10) == pytest.approx(10 * (1.0 / 10) ** 2 * gain, rel=1e-12)
    train.dp.grad_normalizer = federation_pb2.GRAD_NORMALIZER_FIXED
    train.dp.fixed_batch = 20
    assert update_noise_energy(train, 100, 10) == pytest.approx(10 * (1.0 / 20) ** 2 * gain, rel=1e-12)
    train.optimizer = federation_pb2.OPTIMIZER_ADAM
    with pytest.raises(ValueError, match="SGD, not Adam"):
        update_noise_energy(train, 100, 10)


def test_noisy_loss_noise_scale() -> None:
    """On an empty batch F̃ = σ_l C_l N(0,1)/b: check its std over many draws."""
    model = small_cnn()
    x, y = batch(0)
    draws = [dp_sgd.noisy_loss(model, x, y, 2.5, 5.0, 40.0, torch.Generator().manual_seed(s)) for s in range(4000)]
    assert np.std(draws) == pytest.approx(5.0 * 2.5 / 40.0, rel=0.05)
    assert abs(np.mean(draws)) < 5 * (5.0 * 2.5 / 40.0) / math.sqrt(4000)


def test_noisy_loss_clips_each_loss_to_the_bound() -> None:
    model = small_cnn()
    x, y = batch(30)
    with torch.no_grad():
        losses = F.cross_entropy(model(x), y, reduction="none")
    clip = float(losses.median())
    gen = torch.Generator().manual_seed(0)
    expected_noise = float(
        torch.normal(0.0, 1.0, (1,), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    )
    got = dp_sgd.noisy_loss(model, x, y, clip, 5.0, 30.0, gen)
    assert got == pytest.approx((float(losses.clamp(max=clip).sum()) + 5.0 * clip * expected_noise) / 30.0, rel=1e-6)


# --- the trainer's DP task --------------------------------------------------------------------------------------------


def test_dp_task_releases_a_noisy_loss_and_is_reproducible_under_task_randomness() -> None:
    runtime = synthetic_runtime()
    first = runtime.run(dp_task())
    second = runtime.run(dp_task())
    assert torch.equal(first.payloads[UPDATE], second.payloads[UPDATE])
    assert first.noisy_loss == second.noisy_loss and math.isfinite(first.noisy_loss)
    assert first.metrics["loss_clip"] == 2.5
    other = runtime.run(dp_task(seed=6))
    assert not torch.equal(first.payloads[UPDATE], other.payloads[UPDATE])


def test_secure_randomness_is_not_reproducible() -> None:
    runtime = synthetic_runtime(randomness="secure")
    assert not torch.equal(runtime.run(dp_task()).payloads[UPDATE], runtime.run(dp_task()).payloads[UPDATE])


def test_loss_clip_floor_applies() -> None:
    runtime = synthetic_runtime()
    task = dp_task()
    task.train.dp.loss_clip = -3.0  # e.g. a negative noisy loss carried as the next bound
    assert runtime.run(task).metrics["loss_clip"] == 0.1


def test_noiseless_losses_leave_only_as_opted_in_telemetry() -> None:
    runtime = synthetic_runtime()
    private = runtime.run(dp_task())
    assert math.isnan(private.loss_before) and math.isnan(private.loss_after) and "train_loss" not in private.metrics
    check_against_task(private, dp_task())  # withheld losses are what a DP task without telemetry expects
    opted_in = dp_task(plaintext_telemetry=True)
    telemetry = runtime.run(opted_in)
    assert min(telemetry.loss_before, telemetry.loss_after, telemetry.metrics["train_loss"]) > 0
    assert torch.equal(telemetry.payloads[UPDATE], private.payloads[UPDATE])  # telemetry does not change training
    with pytest.raises(CodecError, match="loss_before is missing"):
        check_against_task(private, opted_in)


def test_without_loss_release_there_is_no_noisy_loss() -> None:
    result = synthetic_runtime().run(dp_task(loss_noise_multiplier=0.0))
    assert math.isnan(result.noisy_loss) and "loss_clip" not in result.metrics


# --- the agent's local policy -----------------------------------------------------------------------------------------


def test_policy_refuses_weaker_tasks_and_names_the_parameter() -> None:
    policy = DpPolicy(min_noise_multiplier=1.5, min_loss_noise_multiplier=4.0, max_sample_rate=0.1, max_clip_norm=1.0)
    policy.check(dp_task())  # σ 2, σ_l 5, q 0.1, C 0.5: fine
    cases = {
        "noise_multiplier 1 < policy minimum 1.5": dp_task(noise_multiplier=1.0),
        "loss_noise_multiplier 2 < policy minimum 4": dp_task(loss_noise_multiplier=2.0),
        "sample_rate 0.2 outside (0, 0.1]": dp_task(sample_rate=0.2),
        "clip_norm 5 outside (0, 1]": dp_task(clip_norm=5.0),
        "plaintext_telemetry asks for noiseless training losses": dp_task(plaintext_telemetry=True),
    }
    for message, task in cases.items():
        with pytest.raises(PolicyRefusal, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            policy.check(task)
    plain = dp_task()
    plain.train.ClearField("dp")
    with pytest.raises(PolicyRefusal, match="without DP-SGD"):
        policy.check(plain)
    probe = federation_pb2.Task(phase=federation_pb2.PHASE_PROBE)
    probe.probe.want_gradient = True
    with pytest.raises(PolicyRefusal, match="probe"):
        policy.check(probe)
    policy.check(federation_pb2.Task(phase=federation_pb2.PHASE_EVALUATE))  # evaluation is allowed
    DpPolicy().check(plain)  # no policy: anything goes


def test_runtime_refuses_before_training() -> None:
    runtime = synthetic_runtime(policy=DpPolicy(min_noise_multiplier=3.0))
    before = flatten_parameters(runtime.model).clone()
    with pytest.raises(PolicyRefusal):
        runtime.run(dp_task(noise_multiplier=2.0))
    assert torch.equal(flatten_parameters(runtime.model), before)


def test_agent_logs_a_refusal_and_submits_nothing(caplog: pytest.LogCaptureFixture) -> None:
    from client_agent.agent import Agent

    agent = Agent("127.0.0.1:1", [0], device="cpu", dp_policy=DpPolicy(min_noise_multiplier=3.0))
    runtime = synthetic_runtime(policy=agent.dp_policy)
    agent.runtimes = {"r": runtime}
    submitted = []
    agent.stub = type("Stub", (), {"SubmitResult": lambda self, *a, **k: submitted.append(a)})()
    with caplog.at_level("ERROR"):
        agent._handle(dp_task(noise_multiplier=2.0))
    assert not submitted
    assert (
        "refused by this agent's privacy policy" in caplog.text
        and "noise_multiplier 2 < policy minimum 3" in caplog.text
    )
    agent.channel.close()


def test_policy_command_line() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    DpPolicy.add_arguments(parser)
    policy = DpPolicy.from_args(parser.parse_args(["--min-noise-multiplier", "1.5", "--max-sample-rate", "0.1"]))
    assert policy == DpPolicy(1.5, 0.0, 0.1, math.inf, 0) and policy.active
    assert not DpPolicy.from_args(parser.parse_args([])).active
    with pytest.raises(ValueError, match="--max-sample-rate"):
        DpPolicy.from_args(parser.parse_args(["--max-sample-rate", "0"]))


def test_a_cohosting_agent_with_os_randomness_refuses_dp_tasks(caplog: pytest.LogCaptureFixture) -> None:
    from client_agent.agent import Agent

    # A DP task re-sent after an aggregator restart may reach another co-host: with OS noise that would be a second,
    # uncounted release, so such an agent runs no DP-SGD (task-seeded noise releases the same values anywhere).
    agent = Agent("127.0.0.1:1", [0], device="cpu", shared=True)
    runtime = synthetic_runtime(policy=agent.dp_policy)
    agent.runtimes = {"r": runtime}
    before = flatten_parameters(runtime.model).clone()
    with caplog.at_level("ERROR"):
        agent._handle(dp_task(noise_multiplier=2.0))
    assert "co-hosts its clients" in caplog.text and not agent.uploads._in_flight
    assert torch.equal(flatten_parameters(runtime.model), before)
    agent.channel.close()
    seeded = Agent("127.0.0.1:1", [0], device="cpu", shared=True, dp_randomness="task")
    seeded.runtimes = {"r": runtime}
    assert seeded._result(runtime, dp_task(noise_multiplier=2.0)).payloads  # trains: the release is reproducible
    seeded.channel.close()
