"""Whether FedFDP's fairness factor can act on the clipping coefficients of a run (issue #22).

    python scripts/fedfdp_clip_binding.py RUN_DIR [RUN_DIR ...] [--sample 512] [--clip 0.1 1 10] [--lambda 5]
                                          [--json OUT.json] [--per-client]

FedFDP (record-level DP, paper Eq. 15, client_agent/dp_sgd.py `fair_clip_coefficients`) scales each per-sample
gradient g_j by

    c_j = min(max(1 + λ(ℓ_j − F), 0), C/(‖g_j‖ + 1e-6))        DP-SGD: d_j = min(1, C/(‖g_j‖ + 1e-6))

with λ = strategy.params.fair_lambda, C = privacy.clip_norm and F the server's global loss broadcast with the task.
The fairness factor 1 + λΔ_j (Δ_j = ℓ_j − F) changes anything only where it *binds*, i.e. where it is below C/‖g_j‖;
when C/‖g_j‖ is tiny (C = 0.1) it almost never is, and Eq. 15 is DP-SGD's C/‖g_j‖.

A run directory is what `fairfl run` writes: results.json (`config`, `rounds[*].strategy_metrics.global_loss`) and
model.safetensors (the final model); a directory without a results.json is searched for run directories below it.
The run's partition is rebuilt with FairFL's own data code (fairfl.data.run.load_run_data, the split every agent
derives from the config and seed; a client's DP-SGD data is its training split) and the model with the model registry:

- `initial`: the seeded initial model every process builds (fairfl.models.build_run_model, the engine's
  initial_model), with F = strategy.params.initial_global_loss (the F of round 1's tasks);
- `final`: model.safetensors (checked against results.json's final_model_sha256), with F = the last global_loss
  reported in results.json (the F the next round's tasks would carry). Skipped when the directory has no model file.

On each client's training data, or a uniform sample of `--sample` records per client (default 512, the same records at
both points; 0 = all), per-sample losses ℓ_j and gradient norms ‖g_j‖ come from torch.func (dp_sgd's
per_sample_grad_fn, the vmap path of the agents' DP-SGD). For the run's own (C, λ) and each --clip / --lambda
override it reports, pooled over the clients' samples:

- Δ>0: share of samples with ℓ_j > F; binds: share where max(1 + λΔ_j, 0) < C/(‖g_j‖ + 1e-6), so c_j is the fairness
  factor; zeroed: share with 1 + λΔ_j ≤ 0 (c_j = 0, the sample is dropped); ‖g‖≤C: share DP-SGD leaves unclipped
  (there FedFDP with Δ_j > 0 scales g_j *up*, to min(1 + λΔ_j, C/‖g_j‖)); differs: share with c_j ≠ d_j;
- the medians of C/(‖g_j‖ + 1e-6) and of the factor max(1 + λΔ_j, 0), the mean loss next to F;
- mean c_j/d_j and mean |c_j − d_j|/d_j over samples;
- per client, the clipped sums S_FDP = Σ c_j g_j and S_DP = Σ d_j g_j (exact, each one backward pass of the
  coefficient-weighted loss): ‖S_FDP − S_DP‖/‖S_DP‖ (mean and max over clients) and their cosine (mean);
- shift/noise: the expected difference of one step's noisy sums, q·n_i/m·‖S_FDP − S_DP‖ (q = privacy.sample_rate,
  n_i the client's records, m those sampled), over the norm of the step's Gaussian noise, σC√d (d parameters): the
  per-step size of what the fairness term changes relative to the DP noise (averaged over clients).

Output: a Markdown table on stdout (--per-client adds one row per client); --json writes every number.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # runlib's folder, also when loaded by file path

from runlib import find_runs, load_final_model, load_run_config  # puts the repository on the path

from client_agent.dp_sgd import CHUNK, NORM_EPS, fair_clip_coefficients, per_sample_grad_fn
from fairfl.config import ExperimentConfig

DEFAULT_SAMPLE = 512
SUM_CHUNK = 1024  # samples per backward pass of a coefficient-weighted sum


# --- the run's record -------------------------------------------------------------------------------------------------


@dataclass
class Run:
    label: str
    path: Path
    run_id: str
    config: ExperimentConfig
    fair_lambda: float
    initial_global_loss: float
    final_global_loss: float | None  # the last global_loss results.json reports, None if none
    final_global_loss_round: int | None
    final_model_sha256: str | None


def last_global_loss(rounds: Sequence[dict[str, Any]]) -> tuple[float | None, int | None]:
    """The last `strategy_metrics.global_loss` of results.json's rounds and its round (None, None when none)."""
    for entry in reversed(rounds):
        metrics = entry.get("strategy_metrics") or []  # [{"name": ..., "value": ...}], as the RoundEvent's
        if isinstance(metrics, dict):
            metrics = [{"name": k, "value": v} for k, v in metrics.items()]
        value = next((m["value"] for m in metrics if m.get("name") == "global_loss"), None)
        if value is not None:
            return float(value), int(entry["round"])
    return None, None


def load_run(path: Path) -> Run:
    """The run's config and FedFair parameters; a run not of FedFDP (fedfair + record-level DP) is refused."""
    from aggregator_service.strategies.fedfair import FedFairParams
    from fairfl.plugins import parse_params

    results = json.loads((path / "results.json").read_text())
    config = load_run_config(results["config"])  # older keys migrated
    if config.strategy.name != "fedfair":
        raise SystemExit(f"{path}: strategy {config.strategy.name!r}, not fedfair: FedFDP's Eq. 15 does not apply")
    if not (config.privacy.enabled and config.privacy.principal == "client"):
        raise SystemExit(f"{path}: not record-level DP (privacy.enabled, principal client): this is not FedFDP")
    params = parse_params(FedFairParams, config.strategy.params, "strategy.params")
    global_loss, global_round = last_global_loss(results.get("rounds", []))
    return Run(
        label=str(path),
        path=path,
        run_id=str(results.get("run_id", "")),
        config=config,
        fair_lambda=float(params.fair_lambda),
        initial_global_loss=float(params.initial_global_loss),
        final_global_loss=global_loss,
        final_global_loss_round=global_round,
        final_model_sha256=results.get("final_model_sha256"),
    )


# --- the clients' data and the two models -----------------------------------------------------------------------------


@dataclass
class ClientData:
    client: int
    records: int  # n_i, the client's training records
    x: torch.Tensor  # the sampled records (all when the sample is 0 or >= n_i)
    y: torch.Tensor


def client_data(config: ExperimentConfig, sample: int, seed: int) -> list[ClientData]:
    """Every client's training split as the agents build it (data.train rows at the client's train indices), each
    reduced to a uniform sample of `sample` records without replacement (0: all), drawn with numpy from `seed`."""
    from fairfl.data.run import load_run_data

    fed = load_run_data(config)
    rng = np.random.default_rng(seed)
    clients = []
    for cid, indices in enumerate(fed.train_indices):
        chosen = indices
        if 0 < sample < len(indices):
            chosen = np.sort(rng.choice(indices, size=sample, replace=False))
        clients.append(
            ClientData(
                client=cid,
                records=len(indices),
                x=torch.from_numpy(np.ascontiguousarray(fed.train.x[chosen])),
                y=torch.from_numpy(np.ascontiguousarray(fed.train.y[chosen])),
            )
        )
    return clients


def initial_model(config: ExperimentConfig) -> nn.Module:
    """The run's initial model, as the engine builds it (build_run_model seeds torch with the run seed)."""
    from fairfl.models import build_run_model

    with torch.random.fork_rng(devices=[]):
        return build_run_model(config)


def final_model(run: Run) -> tuple[nn.Module, int] | None:
    """The run's model file and its round, checked against results.json; None when the directory has none."""
    return load_final_model(run.path, run.run_id, run.final_model_sha256)


# --- per-sample losses, gradient norms and clipped sums ---------------------------------------------------------------


def per_sample_losses_and_norms(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int = CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """ℓ_j and ‖g_j‖ (over all parameters) of every sample, with the agents' vmap(grad) in chunks of `chunk`."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    fn = per_sample_grad_fn(model)
    losses, norms = [], []
    for start in range(0, len(y), chunk):
        grads, loss = fn(params, buffers, x[start : start + chunk], y[start : start + chunk])
        per_tensor = [torch.linalg.vector_norm(g.reshape(len(g), -1), dim=1) for g in grads.values()]
        norms.append(torch.linalg.vector_norm(torch.stack(per_tensor, dim=1), dim=1))
        losses.append(loss)
    return torch.cat(losses).double(), torch.cat(norms).double()


def weighted_gradient_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_j w_j g_j, flat: the gradient of Σ_j w_j ℓ_j (the weights held constant), one backward pass per chunk."""
    params = [p for p in model.parameters()]
    total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    for start in range(0, len(y), SUM_CHUNK):
        xb, yb = x[start : start + SUM_CHUNK], y[start : start + SUM_CHUNK]
        wb = weights[start : start + SUM_CHUNK].to(torch.float32)
        losses = F.cross_entropy(model(xb), yb, reduction="none")
        grads = torch.autograd.grad((wb * losses).sum(), params)
        total += torch.cat([g.reshape(-1) for g in grads]).double()
    return total


# --- the statistics ---------------------------------------------------------------------------------------------------


def coefficients(
    losses: torch.Tensor, norms: torch.Tensor, clip_norm: float, fair_lambda: float, global_loss: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(c, d): FedFDP's Eq. 15 coefficients (dp_sgd.fair_clip_coefficients) and DP-SGD's (the same with λ = 0)."""
    fdp = fair_clip_coefficients(losses, norms, clip_norm, fair_lambda, global_loss)
    dp = fair_clip_coefficients(losses, norms, clip_norm, 0.0, global_loss)
    return fdp, dp


@dataclass
class CoefficientStats:
    samples: int
    delta_positive: float  # share with ℓ_j > F
    binds: float  # share with max(1 + λΔ_j, 0) < C/(‖g_j‖ + eps): the fairness factor is the coefficient
    zeroed: float  # share with 1 + λΔ_j <= 0: coefficient 0
    unclipped: float  # share with C/(‖g_j‖ + eps) >= 1: DP-SGD leaves g_j as it is
    differs: float  # share with c_j != d_j (relative difference > 1e-9)
    median_clip_ratio: float  # median of C/(‖g_j‖ + eps)
    median_factor: float  # median of max(1 + λΔ_j, 0)
    delta_p05: float  # 5th percentile of Δ_j: the factor binds at C/‖g‖ = r only where Δ_j < (r − 1)/λ
    mean_loss: float
    mean_coef_ratio: float  # mean of c_j / d_j
    mean_rel_coef_diff: float  # mean of |c_j − d_j| / d_j


def coefficient_stats(
    losses: torch.Tensor, norms: torch.Tensor, clip_norm: float, fair_lambda: float, global_loss: float
) -> CoefficientStats:
    """The binding statistics of one set of samples (per-sample losses and gradient norms) under (C, λ, F)."""
    losses, norms = losses.double(), norms.double()
    delta = losses - global_loss
    factor = (1.0 + fair_lambda * delta).clamp(min=0.0)
    ratio = clip_norm / (norms + NORM_EPS)
    fdp, dp = coefficients(losses, norms, clip_norm, fair_lambda, global_loss)
    rel = (fdp - dp).abs() / dp

    def share(mask: torch.Tensor) -> float:
        return float(mask.double().mean()) if len(mask) else math.nan

    def quantile(values: torch.Tensor, q: float) -> float:
        return float(np.quantile(values.numpy(), q)) if len(values) else math.nan

    return CoefficientStats(
        samples=len(losses),
        delta_positive=share(delta > 0),
        binds=share(factor < ratio),
        zeroed=share(factor <= 0),
        unclipped=share(ratio >= 1),
        differs=share(rel > 1e-9),
        median_clip_ratio=quantile(ratio, 0.5),
        median_factor=quantile(factor, 0.5),
        delta_p05=quantile(delta, 0.05),
        mean_loss=float(losses.mean()) if len(losses) else math.nan,
        mean_coef_ratio=float((fdp / dp).mean()) if len(losses) else math.nan,
        mean_rel_coef_diff=float(rel.mean()) if len(losses) else math.nan,
    )


@dataclass
class SumStats:
    rel_diff: float  # ‖S_FDP − S_DP‖ / ‖S_DP‖
    norm_ratio: float  # ‖S_FDP‖ / ‖S_DP‖
    cosine: float  # cos(S_FDP, S_DP)
    shift_over_noise: float  # q·n_i/m·‖S_FDP − S_DP‖ / (σ C √d)
    signal_over_noise: float  # q·n_i/m·‖S_DP‖ / (σ C √d)


def sum_stats(s_fdp: torch.Tensor, s_dp: torch.Tensor, batch_scale: float, noise_norm: float) -> SumStats:
    """How different FedFDP's clipped sum is from DP-SGD's; `batch_scale` = q·n_i/m turns a sum over m sampled records
    into the expected sum over a Poisson(q) batch of the client's n_i, `noise_norm` = σC√d."""
    diff, n_fdp, n_dp = (float(torch.linalg.vector_norm(v)) for v in (s_fdp - s_dp, s_fdp, s_dp))
    cosine = float(s_fdp @ s_dp) / (n_fdp * n_dp) if n_fdp > 0 and n_dp > 0 else math.nan
    return SumStats(
        rel_diff=diff / n_dp if n_dp > 0 else math.nan,
        norm_ratio=n_fdp / n_dp if n_dp > 0 else math.nan,
        cosine=cosine,
        shift_over_noise=batch_scale * diff / noise_norm if noise_norm > 0 else math.inf,
        signal_over_noise=batch_scale * n_dp / noise_norm if noise_norm > 0 else math.inf,
    )


# --- one run ----------------------------------------------------------------------------------------------------------


@dataclass
class Setting:
    point: str  # "initial" or "final"
    model_round: int
    global_loss: float
    clip_norm: float
    fair_lambda: float
    run_values: bool  # the run's own C and λ (not an override)
    pooled: CoefficientStats
    sum_rel_diff_mean: float
    sum_rel_diff_max: float
    sum_cosine_mean: float
    shift_over_noise_mean: float
    signal_over_noise_mean: float
    clients: list[dict[str, Any]] = field(default_factory=list)


def settings_of(run: Run, clips: Sequence[float], lambdas: Sequence[float]) -> list[tuple[float, float, bool]]:
    """(C, λ, is the run's own) for the run's values first, then every override combination (deduplicated)."""
    own = (run.config.privacy.clip_norm, run.fair_lambda)
    combos = [own] + [(c, lam) for c in (clips or [own[0]]) for lam in (lambdas or [own[1]])]
    seen: list[tuple[float, float]] = []
    for combo in combos:
        if combo not in seen:
            seen.append(combo)
    return [(c, lam, (c, lam) == own) for c, lam in seen]


def measure_point(
    run: Run,
    point: str,
    model: nn.Module,
    model_round: int,
    global_loss: float,
    clients: list[ClientData],
    combos: list[tuple[float, float, bool]],
) -> list[Setting]:
    """Every (C, λ) setting of one model: per-sample losses and norms once, then the statistics of each setting."""
    model.eval()
    dims = sum(p.numel() for p in model.parameters())
    privacy = run.config.privacy
    per_client = [per_sample_losses_and_norms(model, c.x, c.y) for c in clients]
    all_losses = torch.cat([ln[0] for ln in per_client])
    all_norms = torch.cat([ln[1] for ln in per_client])
    settings = []
    for clip_norm, fair_lambda, own in combos:
        noise_norm = privacy.noise_multiplier * clip_norm * math.sqrt(dims)
        rows, sums = [], []
        for data, (losses, norms) in zip(clients, per_client, strict=True):
            fdp, dp = coefficients(losses, norms, clip_norm, fair_lambda, global_loss)
            s_fdp = weighted_gradient_sum(model, data.x, data.y, fdp)
            s_dp = weighted_gradient_sum(model, data.x, data.y, dp)
            scale = privacy.sample_rate * data.records / max(len(data.y), 1)
            summed = sum_stats(s_fdp, s_dp, scale, noise_norm)
            sums.append(summed)
            stats = coefficient_stats(losses, norms, clip_norm, fair_lambda, global_loss)
            rows.append({"client": data.client, "records": data.records, **asdict(stats), **asdict(summed)})
        rel = [s.rel_diff for s in sums]
        settings.append(
            Setting(
                point=point,
                model_round=model_round,
                global_loss=global_loss,
                clip_norm=clip_norm,
                fair_lambda=fair_lambda,
                run_values=own,
                pooled=coefficient_stats(all_losses, all_norms, clip_norm, fair_lambda, global_loss),
                sum_rel_diff_mean=float(np.mean(rel)),
                sum_rel_diff_max=float(np.max(rel)),
                sum_cosine_mean=float(np.mean([s.cosine for s in sums])),
                shift_over_noise_mean=float(np.mean([s.shift_over_noise for s in sums])),
                signal_over_noise_mean=float(np.mean([s.signal_over_noise for s in sums])),
                clients=rows,
            )
        )
    return settings


def measure(path: Path, sample: int, seed: int, clips: Sequence[float], lambdas: Sequence[float]) -> dict[str, Any]:
    run = load_run(path)
    clients = client_data(run.config, sample, seed)
    combos = settings_of(run, clips, lambdas)
    settings = measure_point(run, "initial", initial_model(run.config), 0, run.initial_global_loss, clients, combos)
    final = final_model(run)
    notes = []
    if final is None:
        notes.append("no model.safetensors: the final model is not measured")
    elif run.final_global_loss is None:
        notes.append("results.json reports no global_loss: the final model is not measured")
    else:
        model, model_round = final
        if run.final_global_loss_round != model_round:
            notes.append(f"F from round {run.final_global_loss_round}, the model is round {model_round}")
        settings += measure_point(run, "final", model, model_round, run.final_global_loss, clients, combos)
    return {
        "run": run.label,
        "run_id": run.run_id,
        "fair_lambda": run.fair_lambda,
        "clip_norm": run.config.privacy.clip_norm,
        "noise_multiplier": run.config.privacy.noise_multiplier,
        "sample_rate": run.config.privacy.sample_rate,
        "initial_global_loss": run.initial_global_loss,
        "final_global_loss": run.final_global_loss,
        "final_global_loss_round": run.final_global_loss_round,
        "sample_per_client": sample,
        "sample_seed": seed,
        "clients": [{"client": c.client, "records": c.records, "sampled": len(c.y)} for c in clients],
        "notes": notes,
        "settings": [asdict(s) for s in settings],
    }


# --- the report -------------------------------------------------------------------------------------------------------

COLUMNS = (
    "run | point | F | mean ℓ | Δ p5 | C | λ | Δ>0 | binds | zeroed | ‖g‖≤C | differs | med C/‖g‖ | med factor | "
    "mean c/d | mean \\|c−d\\|/d | ‖S_FDP−S_DP‖/‖S_DP‖ mean (max) | cos | shift/noise | DP signal/noise"
)


def _pct(x: float) -> str:
    return "—" if math.isnan(x) else f"{100 * x:.1f}%"


def _num(x: float) -> str:
    if math.isnan(x):
        return "—"
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:.3e}"


def _row(label: str, point: str, report: dict[str, Any], s: dict[str, Any], st: dict[str, Any], sums: list[str]) -> str:
    cells = [
        label,
        point,
        _num(s["global_loss"]),
        _num(st["mean_loss"]),
        _num(st["delta_p05"]),
        _num(s["clip_norm"]) + ("" if s["clip_norm"] == report["clip_norm"] else "*"),
        _num(s["fair_lambda"]) + ("" if s["fair_lambda"] == report["fair_lambda"] else "*"),
        _pct(st["delta_positive"]),
        _pct(st["binds"]),
        _pct(st["zeroed"]),
        _pct(st["unclipped"]),
        _pct(st["differs"]),
        _num(st["median_clip_ratio"]),
        _num(st["median_factor"]),
        _num(st["mean_coef_ratio"]),
        _num(st["mean_rel_coef_diff"]),
        *sums,
    ]
    return "| " + " | ".join(cells) + " |"


def markdown(reports: list[dict[str, Any]], per_client: bool) -> str:
    lines = ["| " + COLUMNS + " |", "|" + "---|" * len(COLUMNS.split(" | "))]
    for report in reports:
        for s in report["settings"]:
            point = f"{s['point']} (r{s['model_round']})"
            sums = [
                f"{_num(s['sum_rel_diff_mean'])} ({_num(s['sum_rel_diff_max'])})",
                _num(s["sum_cosine_mean"]),
                _num(s["shift_over_noise_mean"]),
                _num(s["signal_over_noise_mean"]),
            ]
            lines.append(_row(report["run"], point, report, s, s["pooled"], sums))
            if per_client:
                for c in s["clients"]:
                    cells = [_num(c["rel_diff"]), _num(c["cosine"]), _num(c["shift_over_noise"])]
                    cells.append(_num(c["signal_over_noise"]))
                    lines.append(_row(f"  client {c['client']}", point, report, s, c, cells))
    sampled = {r["sample_per_client"] for r in reports}
    notes = [
        "",
        "Pooled over "
        + ("every client's whole training split" if sampled == {0} else f"up to {max(sampled)} records per client")
        + "; * = an override, not the run's own value. F: initial = strategy.params.initial_global_loss, final = the "
        "last global_loss in results.json; Δ p5 = 5th percentile of ℓ − F. binds: max(1+λΔ, 0) < C/‖g‖; c = "
        "FedFDP's Eq. 15 coefficient, d = DP-SGD's min(1, C/‖g‖); S = Σ coef·g per client; "
        "shift/noise = q·n_i·‖S_FDP−S_DP‖/m over σC√d (one step).",
    ]
    for report in reports:
        notes += [f"{report['run']}: {note}" for note in report["notes"]]
    return "\n".join(lines + notes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (or directories holding them)")
    parser.add_argument(
        "--sample", type=int, default=DEFAULT_SAMPLE, help="records per client, uniform without replacement (0 = all)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the per-client samples")
    parser.add_argument("--clip", type=float, nargs="+", default=[], help="clip norms C to measure besides the run's")
    parser.add_argument(
        "--lambda", dest="lambdas", type=float, nargs="+", default=[], help="λ values to measure besides the run's"
    )
    parser.add_argument("--per-client", action="store_true", help="one Markdown row per client too")
    parser.add_argument("--json", type=Path, help="write every number here")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = parser.parse_args(argv)
    if args.sample < 0:
        parser.error("--sample must be >= 0")
    if any(c <= 0 for c in args.clip) or any(lam < 0 for lam in args.lambdas):
        parser.error("--clip values must be > 0 and --lambda values >= 0")
    torch.set_num_threads(args.threads)
    reports = [measure(path, args.sample, args.seed, args.clip, args.lambdas) for path in find_runs(args.runs)]
    print(markdown(reports, args.per_client))
    if args.json:
        args.json.write_text(json.dumps(reports, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
