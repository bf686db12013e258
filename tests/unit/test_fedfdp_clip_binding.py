"""scripts/fedfdp_clip_binding.py: binding statistics on hand-made losses and norms, per-sample gradient norms and
clipped sums against single-sample autograd, and one end-to-end run directory on the synthetic dataset."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fairfl.config import experiment_from_dict
from fairfl.model_file import save_run_model
from fairfl.models import build_model
from fairfl.params import ParamLayout, flatten_parameters

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fedfdp_clip_binding.py"


@pytest.fixture(scope="module")
def binding() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fedfdp_clip_binding", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# --- the statistics on hand-made samples --------------------------------------------------------------------------


def test_coefficient_stats_known_fractions(binding: ModuleType) -> None:
    # C = 0.1, λ = 1, F = 1. Per sample: factor = max(1 + (ℓ − 1), 0) = max(ℓ, 0); ratio = C/(‖g‖ + 1e-6).
    #   A: ℓ 2,   ‖g‖ 1     factor 2,   ratio ≈ 0.1: DP-SGD's clip binds, c = d ≈ 0.1
    #   B: ℓ 0.5, ‖g‖ 0.01  factor 0.5, ratio ≈ 10:  the factor binds, c = 0.5, d = 1 (unclipped)
    #   C: ℓ 0,   ‖g‖ 1     factor 0,   ratio ≈ 0.1: the factor binds, zeroed, c = 0, d ≈ 0.1
    #   D: ℓ 3,   ‖g‖ 0.05  factor 3,   ratio ≈ 2:   the clip binds, c ≈ 2 > d = 1 (FedFDP scales g up)
    losses = torch.tensor([2.0, 0.5, 0.0, 3.0])
    norms = torch.tensor([1.0, 0.01, 1.0, 0.05])
    stats = binding.coefficient_stats(losses, norms, clip_norm=0.1, fair_lambda=1.0, global_loss=1.0)
    assert stats.samples == 4
    assert stats.delta_positive == 0.5  # A, D
    assert stats.binds == 0.5  # B, C
    assert stats.zeroed == 0.25  # C
    assert stats.unclipped == 0.5  # B, D
    assert stats.differs == 0.75  # B, C, D
    assert stats.median_clip_ratio == pytest.approx((0.1 + 2.0) / 2, rel=1e-4)
    assert stats.median_factor == pytest.approx(1.25)
    assert stats.mean_loss == pytest.approx(1.375)
    assert stats.mean_coef_ratio == pytest.approx((1 + 0.5 + 0 + 2) / 4, rel=1e-4)
    assert stats.mean_rel_coef_diff == pytest.approx((0 + 0.5 + 1 + 1) / 4, rel=1e-4)


def test_coefficient_stats_paper_clip_never_binds_above_global_loss(binding: ModuleType) -> None:
    # Every Δ > 0 (factor > 1) and every ‖g‖ > C (ratio < 1): Eq. 15 is DP-SGD's C/‖g‖ for every sample.
    gen = torch.Generator().manual_seed(0)
    losses = 1.0 + torch.rand(200, generator=gen)
    norms = 0.5 + 5 * torch.rand(200, generator=gen)
    stats = binding.coefficient_stats(losses, norms, clip_norm=0.1, fair_lambda=5.0, global_loss=0.5)
    assert (stats.delta_positive, stats.binds, stats.zeroed, stats.unclipped, stats.differs) == (1, 0, 0, 0, 0)
    assert stats.mean_coef_ratio == pytest.approx(1.0)
    assert stats.mean_rel_coef_diff == 0.0


def test_coefficient_stats_lambda_zero_is_dp_sgd(binding: ModuleType) -> None:
    gen = torch.Generator().manual_seed(1)
    losses, norms = 3 * torch.rand(100, generator=gen), 2 * torch.rand(100, generator=gen)
    stats = binding.coefficient_stats(losses, norms, clip_norm=1.0, fair_lambda=0.0, global_loss=1.0)
    assert stats.differs == 0.0
    assert stats.binds == pytest.approx(stats.unclipped)  # factor 1 < C/‖g‖ exactly where DP-SGD does not clip
    fdp, dp = binding.coefficients(losses.double(), norms.double(), 1.0, 0.0, 1.0)
    assert torch.equal(fdp, dp)
    assert torch.allclose(dp, torch.clamp(1.0 / (norms.double() + 1e-6), max=1.0))


def test_sum_stats(binding: ModuleType) -> None:
    s_dp = torch.tensor([3.0, 4.0], dtype=torch.float64)  # norm 5
    s_fdp = torch.tensor([6.0, 8.0], dtype=torch.float64)  # twice S_DP
    stats = binding.sum_stats(s_fdp, s_dp, batch_scale=0.5, noise_norm=10.0)
    assert stats.rel_diff == pytest.approx(1.0)
    assert stats.norm_ratio == pytest.approx(2.0)
    assert stats.cosine == pytest.approx(1.0)
    assert stats.shift_over_noise == pytest.approx(0.5 * 5 / 10)
    assert stats.signal_over_noise == pytest.approx(0.5 * 5 / 10)


def test_last_global_loss_and_settings(binding: ModuleType) -> None:
    rounds: list[dict[str, Any]] = [
        {"round": 5, "strategy_metrics": [{"name": "global_loss", "value": 2.0}]},
        {"round": 10, "strategy_metrics": [{"name": "psi", "value": 0.1}, {"name": "global_loss", "value": 1.5}]},
        {"round": 12, "strategy_metrics": []},
    ]
    assert binding.last_global_loss(rounds) == (1.5, 10)
    assert binding.last_global_loss([{"round": 3, "strategy_metrics": {"global_loss": 0.7}}]) == (0.7, 3)
    assert binding.last_global_loss([]) == (None, None)


# --- per-sample gradients against a loop of single-sample autograd ------------------------------------------------


def _tiny_models() -> list[nn.Module]:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(144, 5), nn.Tanh(), nn.Linear(5, 3))
    cnn = build_model("cnn", (1, 12, 12), 3, channels=[2, 3], hidden=4, kernel_size=3)
    return [mlp, cnn]


def _loop_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses, flat per-sample gradients (n, d)) with one autograd pass per sample."""
    losses, grads = [], []
    for j in range(len(y)):
        loss = F.cross_entropy(model(x[j : j + 1]), y[j : j + 1])
        g = torch.autograd.grad(loss, list(model.parameters()))
        losses.append(loss.detach())
        grads.append(torch.cat([t.reshape(-1) for t in g]))
    return torch.stack(losses).double(), torch.stack(grads).double()


@pytest.mark.parametrize("which", [0, 1])
def test_per_sample_norms_match_single_sample_autograd(binding: ModuleType, which: int) -> None:
    model = _tiny_models()[which]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(70, 1, 12, 12, generator=gen)  # 70 > CHUNK: two chunks
    y = torch.randint(0, 3, (70,), generator=gen)
    losses, norms = binding.per_sample_losses_and_norms(model, x, y)
    ref_losses, ref_grads = _loop_grads(model, x, y)
    assert torch.allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert torch.allclose(norms, ref_grads.norm(dim=1), rtol=1e-4, atol=1e-6)

    # the clipped sums: Σ_j c_j g_j from one backward pass of the weighted loss = the loop's weighted sum
    fdp, _ = binding.coefficients(losses, norms, 0.05, 5.0, float(losses.mean()))
    total = binding.weighted_gradient_sum(model, x, y, fdp)
    assert torch.allclose(total, (fdp[:, None] * ref_grads).sum(0), rtol=1e-4, atol=1e-6)


# --- one run directory, end to end ----------------------------------------------------------------------------------


def _write_run(path: Path, with_model: bool) -> dict[str, Any]:
    raw = {
        "name": "binding-test",
        "seed": 3,
        "rounds": 2,
        "data": {"dataset": "synthetic", "num_clients": 3},
        "model": {"name": "mlp", "params": {"hidden": [8]}},
        "training": {"local_steps": 1},
        "strategy": {"name": "fedfair", "params": {"fair_lambda": 5.0}},
        "selection": {"method": "full", "clients_per_round": 3},
        "privacy": {"enabled": True, "epsilon": 50.0, "clip_norm": 0.1},
    }
    config = experiment_from_dict(raw)
    rounds = [{"round": 2, "strategy_metrics": [{"name": "global_loss", "value": 1.2}]}]
    results: dict[str, Any] = {"run_id": "binding-test-1", "config": config.to_dict(), "rounds": rounds}
    if with_model:
        from fairfl.models import build_run_model

        model = build_run_model(config)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        flat = flatten_parameters(model)
        written = save_run_model(path / "model.safetensors", config, "binding-test-1", 2, ParamLayout.of(model), flat)
        results["final_model_sha256"] = written.sha256
    path.mkdir(parents=True, exist_ok=True)
    (path / "results.json").write_text(json.dumps(results))
    return results


def test_end_to_end_run_directory(binding: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_run(tmp_path / "with", with_model=True)
    _write_run(tmp_path / "without", with_model=False)
    out = tmp_path / "out.json"
    rc = binding.main([str(tmp_path), "--sample", "40", "--clip", "0.1", "10", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| run | point |" in text and "no model.safetensors" in text
    reports = json.loads(out.read_text())
    assert [Path(r["run"]).name for r in reports] == ["with", "without"]
    full, initial_only = reports
    assert [(s["point"], s["clip_norm"]) for s in full["settings"]] == [
        ("initial", 0.1),
        ("initial", 10.0),
        ("final", 0.1),
        ("final", 10.0),
    ]
    assert [s["point"] for s in initial_only["settings"]] == ["initial", "initial"]
    assert [c["sampled"] for c in full["clients"]] == [min(40, c["records"]) for c in full["clients"]]
    initial, final = full["settings"][0], full["settings"][2]
    assert initial["global_loss"] == 0.0 and initial["fair_lambda"] == 5.0 and initial["model_round"] == 0
    assert final["global_loss"] == 1.2 and final["model_round"] == 2
    # F = 0 at the initial model: every Δ = ℓ > 0
    assert initial["pooled"]["delta_positive"] == 1.0
    assert initial["pooled"]["samples"] == sum(c["sampled"] for c in full["clients"])
    for setting in full["settings"]:
        pooled = setting["pooled"]
        if pooled["differs"] == 0.0:
            assert setting["sum_rel_diff_max"] == pytest.approx(0.0, abs=1e-6)
        assert len(setting["clients"]) == 3
        assert all(math.isfinite(c["rel_diff"]) for c in setting["clients"])


def test_refuses_non_fedfdp_runs(binding: ModuleType, tmp_path: Path) -> None:
    results = _write_run(tmp_path / "run", with_model=False)
    results["config"]["strategy"] = {"name": "fedavg", "server_lr": 1.0, "params": {}}
    (tmp_path / "run" / "results.json").write_text(json.dumps(results))
    with pytest.raises(SystemExit, match="not fedfair"):
        binding.load_run(tmp_path / "run")


def test_legacy_config_keys_are_moved_to_params(binding: ModuleType) -> None:
    raw = experiment_from_dict(
        {"data": {"dataset": "synthetic", "num_clients": 3}, "selection": {"clients_per_round": 3}}
    ).to_dict()
    raw["data"].pop("params")
    raw["data"].update(synthetic_alpha=0.5, synthetic_beta=1.0)
    raw["model"] = {"name": "cnn", "hidden": [200, 200], "cnn_channels": [8, 16], "cnn_hidden": 64}
    before = json.dumps(raw, sort_keys=True)
    config = binding.load_run_config(raw)  # runlib's, as the script reads results.json
    assert config.model.params == {"channels": [8, 16], "hidden": 64}  # the old model.hidden was the MLP's: dropped
    assert config.data.params == {"alpha": 0.5, "beta": 1.0}
    assert json.dumps(raw, sort_keys=True) == before
