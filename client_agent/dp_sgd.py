"""DP-SGD with FedFDP's fair clipping and the noisy loss release (seed-fedfdp §1.3), as functions of one client.

One DP-SGD step on a Poisson(q) batch B (Alg. 2 lines 14–20):
    g_j = ∇ℓ(w; ξ_j)                          per-sample: torch.func vmap(grad(...)) or per-layer grad-sample
    c_j = min(max(1 + λ(ℓ_j − F), 0), C/(‖g_j‖ + 1e-6))   Eq. 15 with the guard against negative coefficients
    ĝ   = (Σ_j c_j g_j + N(0, σ²C²I)) / b      b = the normaliser (expected q|D_i| by default, §9.6)
Every ‖c_j g_j‖ ≤ C, so the sum has sensitivity C under add/remove-one. λ = 0 gives c_j = min(1, C/(‖g_j‖+1e-6)),
standard DP-SGD clipping (Abadi et al.; Opacus uses the same 1e-6).

Noisy loss (lines 22–28), on an independent Poisson(q) batch B' (§2.6 a) or on the last gradient batch (joint mode):
    F̃ = (Σ_j min(C_l, max(0, ℓ_j(w_{t+1}))) + σ_l C_l N(0, 1)) / b,   C_l = max(loss_clip, loss_clip_min).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from fairfl.params import to_device
from fairfl.v1 import federation_pb2

# Samples per vmap call: bounds the per-sample gradient memory (CHUNK × model size × 4 bytes). A constant, so the
# summation order, and hence every bit of the result, does not depend on the device or the batch size.
CHUNK = 64
LAYERWISE_CHUNK = 256  # the layerwise path stores per-sample gradients of conv layers only
NORM_EPS = 1e-6  # added to ‖g‖ in C/‖g‖, as in the reference code and Opacus
LOSS_BATCH = 2048


class PolicyRefusal(ValueError):
    """A task asks for less privacy than this agent's local policy allows; the task is refused, nothing is sent."""


@dataclass(frozen=True)
class DpPolicy:
    """The weakest DP a client agent accepts (its owner's policy, not the server's). 0 / inf = no limit.

    With any limit set, TRAIN tasks without DP-SGD and PROBE tasks (raw gradients) are refused too.
    """

    min_noise_multiplier: float = 0.0
    min_loss_noise_multiplier: float = 0.0
    max_sample_rate: float = 1.0
    max_clip_norm: float = math.inf
    max_local_steps: int = 0  # 0 = no limit

    @property
    def active(self) -> bool:
        return (
            self.min_noise_multiplier > 0
            or self.min_loss_noise_multiplier > 0
            or self.max_sample_rate < 1.0
            or math.isfinite(self.max_clip_norm)
            or self.max_local_steps > 0
        )

    def check(self, task: federation_pb2.Task) -> None:
        """Raise PolicyRefusal naming the parameter when `task` would release more than the policy allows."""
        if not self.active:
            return
        kind = task.WhichOneof("config")
        if task.phase == federation_pb2.PHASE_PROBE or kind == "probe":
            raise PolicyRefusal("a probe releases raw gradients and losses without noise; this agent requires DP")
        if task.phase != federation_pb2.PHASE_TRAIN:
            return  # evaluation: test-split accuracy and loss, experiment telemetry
        if not task.train.HasField("dp"):
            raise PolicyRefusal("training without DP-SGD; this agent requires DP (task has no dp settings)")
        dp = task.train.dp
        problems = []
        if dp.noise_multiplier < self.min_noise_multiplier:
            problems.append(f"noise_multiplier {dp.noise_multiplier:g} < policy minimum {self.min_noise_multiplier:g}")
        if dp.loss_noise_multiplier > 0 and dp.loss_noise_multiplier < self.min_loss_noise_multiplier:
            problems.append(
                f"loss_noise_multiplier {dp.loss_noise_multiplier:g} < policy minimum "
                f"{self.min_loss_noise_multiplier:g}"
            )
        if not 0 < dp.sample_rate <= self.max_sample_rate:
            problems.append(f"sample_rate {dp.sample_rate:g} outside (0, {self.max_sample_rate:g}]")
        if not 0 < dp.clip_norm <= self.max_clip_norm:
            problems.append(f"clip_norm {dp.clip_norm:g} outside (0, {self.max_clip_norm:g}]")
        steps = task.train.local_steps if task.train.WhichOneof("budget") == "local_steps" else 0
        if task.train.WhichOneof("budget") != "local_steps":
            problems.append("DP-SGD needs local_steps (epochs are not Poisson steps)")
        if dp.plaintext_telemetry:
            problems.append("plaintext_telemetry asks for noiseless training losses (experiment-only telemetry)")
        elif self.max_local_steps and steps > self.max_local_steps:
            problems.append(f"local_steps {steps} > policy maximum {self.max_local_steps}")
        if problems:
            raise PolicyRefusal("weaker than this agent's privacy policy: " + "; ".join(problems))

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        env = os.environ.get
        parser.add_argument(
            "--min-noise-multiplier",
            type=float,
            default=float(env("FAIRFL_MIN_NOISE_MULTIPLIER", "0")),
            help="refuse DP tasks with a smaller gradient noise multiplier σ; any limit also refuses non-DP training",
        )
        parser.add_argument(
            "--min-loss-noise-multiplier",
            type=float,
            default=float(env("FAIRFL_MIN_LOSS_NOISE_MULTIPLIER", "0")),
            help="refuse DP tasks whose loss release has a smaller σ_l",
        )
        parser.add_argument(
            "--max-sample-rate",
            type=float,
            default=float(env("FAIRFL_MAX_SAMPLE_RATE", "1")),
            help="refuse DP tasks with a larger Poisson sampling rate q",
        )
        parser.add_argument(
            "--max-clip-norm",
            type=float,
            default=float(env("FAIRFL_MAX_CLIP_NORM", "inf")),
            help="refuse DP tasks with a larger clipping bound C",
        )
        parser.add_argument(
            "--max-local-steps",
            type=int,
            default=int(env("FAIRFL_MAX_LOCAL_STEPS", "0")),
            help="refuse DP tasks with more DP-SGD steps per round (0 = no limit)",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DpPolicy:
        policy = cls(
            args.min_noise_multiplier,
            args.min_loss_noise_multiplier,
            args.max_sample_rate,
            args.max_clip_norm,
            args.max_local_steps,
        )
        for name in ("min_noise_multiplier", "min_loss_noise_multiplier", "max_clip_norm"):
            if not getattr(policy, name) >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(policy, name)}")
        if not 0 < policy.max_sample_rate <= 1:
            raise ValueError(f"--max-sample-rate must be in (0, 1], got {policy.max_sample_rate}")
        if policy.max_local_steps < 0:
            raise ValueError(f"--max-local-steps must be >= 0, got {policy.max_local_steps}")
        return policy


# --- pieces -----------------------------------------------------------------------------------------------------------


def poisson_sample(n: int, rate: float, gen: torch.Generator) -> torch.Tensor:
    """Indices of a Poisson(rate) subsample of range(n): each one independently with probability `rate`."""
    return torch.nonzero(torch.rand(n, generator=gen, dtype=torch.float64) < rate).reshape(-1)


def fair_clip_coefficients(
    losses: torch.Tensor, norms: torch.Tensor, clip_norm: float, fair_lambda: float, global_loss: float
) -> torch.Tensor:
    """Eq. 15 with the guard: c_j = min(max(1 + λ(ℓ_j − F), 0), C/(‖g_j‖ + 1e-6)), so ‖c_j g_j‖ ≤ C always."""
    fair = (1.0 + fair_lambda * (losses - global_loss)).clamp(min=0.0)
    return torch.minimum(fair, clip_norm / (norms + NORM_EPS))


def per_sample_grad_fn(model: nn.Module) -> Callable[..., tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """(params, buffers, x, y) → ({name: per-sample gradients}, per-sample losses), vectorised with torch.func."""

    def sample_loss(
        params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = functional_call(model, (params, buffers), (x.unsqueeze(0),))
        loss = F.cross_entropy(logits, y.unsqueeze(0))
        return loss, loss.detach()

    return vmap(grad(sample_loss, has_aux=True), in_dims=(None, None, 0, 0))  # type: ignore[return-value]


@dataclass
class ClippedSum:
    sums: dict[str, torch.Tensor]  # Σ_j c_j g_j per parameter
    batch: int  # |B|
    # Σ_j ℓ_j (telemetry, not released): a float64 scalar on the batch's device, summed chunk by chunk in the order
    # float() of each chunk's sum would add them, so reading it is the only wait for the device (see loss_sum)
    loss_total: torch.Tensor

    @property
    def loss_sum(self) -> float:
        return float(self.loss_total)


def layerwise_supported(model: nn.Module) -> bool:
    """True when every parameter belongs to an nn.Linear or a plain nn.Conv2d (the models of fairfl.models)."""
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if not own:
            continue
        if isinstance(module, nn.Linear):
            continue
        if isinstance(module, nn.Conv2d) and module.groups == 1 and module.padding_mode == "zeros":
            if isinstance(module.padding, str):
                return False
            continue
        return False
    return True


def clipped_gradient_sum(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    clip_norm: float,
    fair_lambda: float = 0.0,
    global_loss: float = 0.0,
    prox: dict[str, torch.Tensor] | None = None,
    chunk: int | None = None,
    method: str = "auto",
) -> ClippedSum:
    """Σ_j c_j g_j over the batch (x, y), in chunks of `chunk` samples. `prox` (FedProx: μ(w − x_t), the same for
    every sample) is added to each per-sample gradient before clipping, as the reference code does.

    method "vmap": per-sample gradients with torch.func (any model). "layerwise": Opacus-style per-layer grad-sample
    from the layers' inputs and output gradients of one batched backward; a Linear layer's per-sample norm is
    ‖a_j‖·‖δ_j‖ and its clipped sum (c ⊙ δ)ᵀa, so its per-sample gradients are never stored ("ghost clipping"),
    a Conv2d's come from unfold; a prox term p enters through ‖g_j + p‖² = ‖g_j‖² + 2⟨g_j, p⟩ + ‖p‖² and
    Σ_j c_j (g_j + p) = Σ_j c_j g_j + (Σ_j c_j) p. Same result up to float rounding, 1.5–3× faster for the CNNs on a
    CPU. "auto" takes layerwise when every parameter is in a Linear or Conv2d, else vmap.
    """
    if method == "auto":
        method = "layerwise" if layerwise_supported(model) else "vmap"
    if method == "layerwise":
        if not layerwise_supported(model):
            raise ValueError("layerwise clipping needs a model whose parameters are all in Linear/Conv2d layers")
        return _layerwise_clipped_sum(model, x, y, clip_norm, fair_lambda, global_loss, prox, chunk or LAYERWISE_CHUNK)
    if method != "vmap":
        raise ValueError(f"unknown per-sample gradient method {method!r}; use auto, vmap or layerwise")
    chunk = chunk or CHUNK
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    fn = per_sample_grad_fn(model)
    sums = {k: torch.zeros_like(v) for k, v in params.items()}
    loss_total = torch.zeros((), dtype=torch.float64, device=y.device)
    for start in range(0, len(y), chunk):
        grads, losses = fn(params, buffers, x[start : start + chunk], y[start : start + chunk])
        if prox is not None:
            grads = {k: g + prox[k] for k, g in grads.items()}
        # ‖g_j‖ over all parameters from per-tensor norms (vector_norm reads each gradient once: no squared copy)
        norms = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.reshape(len(g), -1), dim=1) for g in grads.values()], dim=1), dim=1
        )
        coef = fair_clip_coefficients(losses, norms, clip_norm, fair_lambda, global_loss)
        for k, g in grads.items():
            sums[k] += torch.tensordot(coef, g, dims=1)
        loss_total += losses.sum()
    return ClippedSum(sums, len(y), loss_total)


def _layerwise_clipped_sum(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    clip_norm: float,
    fair_lambda: float,
    global_loss: float,
    prox: dict[str, torch.Tensor] | None,
    chunk: int,
) -> ClippedSum:
    layers = [m for m in model.modules() if isinstance(m, nn.Linear | nn.Conv2d)]
    names = {id(p): k for k, p in model.named_parameters()}
    sums = {k: torch.zeros_like(p.detach()) for k, p in model.named_parameters()}
    if prox is not None and not any(bool(p.any()) for p in prox.values()):
        prox = None  # a zero prox term (the first step from x_t) is no prox term, to the last bit
    # With a prox term, ‖g_j + p‖² = ‖g_j‖² + 2⟨g_j, p⟩ + ‖p‖² cancels when p is near −g_j: its terms are summed in
    # float64, so the per-sample norm, and with it the bound ‖c_j (g_j + p)‖ ≤ C, keeps float32's relative precision.
    acc = torch.float64 if prox is not None else torch.float32
    prox_acc = {k: p.to(acc) for k, p in prox.items()} if prox is not None else None  # once, not per chunk
    # ‖p‖² over every parameter, a layer that did not run included (its g_j is 0, its p_j is not)
    prox_sq = _squared_norm(prox_acc.values()) if prox_acc is not None else None
    loss_total = torch.zeros((), dtype=torch.float64, device=y.device)
    for start in range(0, len(y), chunk):
        xb, yb = x[start : start + chunk], y[start : start + chunk]
        captured: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}

        def keep(
            module: nn.Module,
            inputs: tuple[torch.Tensor, ...],
            output: torch.Tensor,
            captured: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = captured,
        ) -> None:
            if module in captured:
                raise ValueError("layerwise clipping needs every layer to run once per forward pass")
            captured[module] = (inputs[0].detach(), output)

        hooks = [m.register_forward_hook(keep) for m in layers]
        try:
            losses = F.cross_entropy(model(xb), yb, reduction="none")
        finally:
            for h in hooks:
                h.remove()
        used = [m for m in layers if m in captured]
        # δ = ∂(Σ_j ℓ_j)/∂(layer output): row j depends on sample j only, so it is sample j's output gradient.
        deltas = torch.autograd.grad(losses.sum(), [captured[m][1] for m in used])
        b = len(yb)
        sq = torch.zeros(b, dtype=acc, device=losses.device)
        parts = []
        for m, delta in zip(used, deltas, strict=True):
            a = captured[m][0]
            p_weight = prox_acc[names[id(m.weight)]] if prox_acc is not None else None
            p_bias = prox_acc[names[id(m.bias)]] if prox_acc is not None and m.bias is not None else None
            if isinstance(m, nn.Linear):
                if a.dim() != 2:
                    raise ValueError("layerwise clipping supports Linear layers on (batch, features) inputs only")
                d = delta.detach()
                a_acc, d_acc = a.to(acc), d.to(acc)  # the same tensors without a prox term
                dn = d_acc.pow(2).sum(1)
                sq += a_acc.pow(2).sum(1) * dn + (dn if m.bias is not None else 0.0)
                if p_weight is not None:  # ⟨δ_j a_jᵀ, P⟩ = (δ_j P)·a_j, without forming δ_j a_jᵀ
                    sq += 2.0 * ((d_acc @ p_weight) * a_acc).sum(1)
                parts.append((m, a, d))
                bias_grad = d_acc
            else:
                u = F.unfold(a, m.kernel_size, dilation=m.dilation, padding=m.padding, stride=m.stride)
                d = delta.detach().reshape(b, delta.shape[1], -1)
                g = torch.bmm(d, u.transpose(1, 2))  # per-sample weight gradients, (b, C_out, C_in·kh·kw)
                gb = d.sum(2)
                g_acc, bias_grad = g.reshape(b, -1).to(acc), gb.to(acc)
                sq += torch.linalg.vector_norm(g_acc, dim=1).pow(2)
                if m.bias is not None:
                    sq += bias_grad.pow(2).sum(1)
                if p_weight is not None:
                    sq += 2.0 * (g_acc @ p_weight.reshape(-1))
                parts.append((m, g, gb))
            if p_bias is not None:
                sq += 2.0 * (bias_grad @ p_bias)
        if prox_sq is not None:
            sq = (sq + prox_sq).clamp(min=0.0)  # ‖g_j + p‖² ≥ 0: no rounding below zero before the square root
        norms = sq.sqrt().to(torch.float32)
        coef = fair_clip_coefficients(losses.detach(), norms, clip_norm, fair_lambda, global_loss)
        for m, first, second in parts:
            if isinstance(m, nn.Linear):
                sums[names[id(m.weight)]] += (second * coef[:, None]).t() @ first
                if m.bias is not None:
                    sums[names[id(m.bias)]] += coef @ second
            else:
                sums[names[id(m.weight)]] += torch.tensordot(coef, first, dims=1).reshape(m.weight.shape)
                if m.bias is not None:
                    sums[names[id(m.bias)]] += coef @ second
        if prox is not None:
            weight = coef.sum()
            for k, p in prox.items():
                sums[k] += weight * p
        loss_total += losses.detach().sum()
    return ClippedSum(sums, len(y), loss_total)


def _squared_norm(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.pow(2).sum() for t in tensors]).sum()


def gaussian_like(tensors: dict[str, torch.Tensor], std: float, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """N(0, std²) per coordinate, drawn on the CPU generator (same numbers on every device), moved to each tensor's
    device (asynchronously on CUDA: the host draws the next tensor's noise while this one is copied)."""
    return {k: to_device(torch.normal(0.0, std, t.shape, generator=gen), t.device) for k, t in tensors.items()}


@torch.no_grad()
def noisy_loss(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_clip: float,
    noise_multiplier: float,
    divisor: float,
    gen: torch.Generator,
) -> float:
    """F̃ = (Σ_j min(C_l, max(0, ℓ_j)) + σ_l C_l N(0, 1)) / divisor on the batch (x, y) (Alg. 2 lines 23–28)."""
    total = torch.zeros((), dtype=torch.float64, device=y.device)
    for start in range(0, len(y), LOSS_BATCH):
        losses = F.cross_entropy(model(x[start : start + LOSS_BATCH]), y[start : start + LOSS_BATCH], reduction="none")
        total += losses.clamp(0.0, loss_clip).double().sum()
    noise = float(torch.normal(0.0, 1.0, (1,), generator=gen, dtype=torch.float64)) * noise_multiplier * loss_clip
    return (float(total) + noise) / divisor
