"""FairFL's own pieces of the local-training loop: each algorithm's client-side behaviour as a LocalProcedure.

The task's typed fields choose them (prox_mu, alignment, fair_step, want_activation, record_first_step,
want_bias_update); `builtin_pieces` builds them in the loop's fixed order, ahead of the task's user procedures.
A DP-SGD task (train.dp) runs one piece, `DpSgd`, which takes over the loop's batches and gradients through the
internal `LoopOwner` hooks. Each keeps the arithmetic, and its order, of the branch of the former single training
function it replaces, so the built-in algorithms train bit for bit as before.

The model head (penultimate features, output layer, its bias) is fairfl.models.model_head's: a model's declared
`features(x)` and `classifier`, else its last nn.Linear.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from client_agent import dp_sgd
from client_agent.rows import row_chunks
from fairfl.models import model_head
from fairfl.params import ParamLayout, flatten_on_device, to_device, to_host
from fairfl.privacy import dp_seed, noise_divisor
from fairfl.procedure import LocalProcedure, LocalState
from fairfl.protocol import FIRST_STEP_UPDATE, ClientResult
from fairfl.v1 import federation_pb2, tensor_pb2

EVAL_BATCH = 2048  # samples per forward pass of an evaluation (no gradients): bounds activation memory


class ProximalTerm(LocalProcedure):
    """FedProx: the objective gains (μ/2)·‖w − x_t‖²."""

    @dataclass(frozen=True)
    class Params:
        mu: float = 0.0

    def begin(self, state: LocalState) -> None:
        self.anchor = [p.detach().clone() for p in state.params]

    def objective(self, state: LocalState, loss: torch.Tensor) -> torch.Tensor:
        prox = sum(((p - a) ** 2).sum() for p, a in zip(state.params, self.anchor, strict=True))
        return loss + 0.5 * self.params.mu * prox


class GradientAlignment(LocalProcedure):
    """FedEBA+ gradient alignment: g ← (1 − α)·g + α·∇f̃ (the server's fair gradient, in the model's layout)."""

    @dataclass(frozen=True)
    class Params:
        alpha: float = 0.0

    def __init__(self, params: Params, fair_gradient: list[torch.Tensor]) -> None:
        super().__init__(params)
        self.fair_gradient = fair_gradient

    def after_backward(self, state: LocalState) -> None:
        alpha = self.params.alpha
        for p, g in zip(state.params, self.fair_gradient, strict=True):
            p.grad.mul_(1.0 - alpha).add_(g, alpha=alpha)


class FairStep(LocalProcedure):
    """FedFair Eq. 11: η_i = η·(1 + λ·(F_i(w, b) − F)) from this batch's loss (the step size is a host number, so it
    reads the loss every step: the one per-step wait for the device left)."""

    @dataclass(frozen=True)
    class Params:
        fair_lambda: float = 0.0
        global_loss: float = 0.0

    def step_lr(self, state: LocalState, loss: torch.Tensor) -> float | None:
        fair_lambda, global_loss = self.params.fair_lambda, self.params.global_loss
        return state.base_lr * max(0.0, 1.0 + fair_lambda * (float(loss.detach()) - global_loss))


class FirstStep(LocalProcedure):
    """FedEBA+ model alignment: releases x_{t,1} − x_t as the FIRST_STEP_UPDATE payload."""

    first: torch.Tensor | None = None

    def after_step(self, state: LocalState) -> None:
        if state.step == 0:
            self.first = flatten_on_device(state.model) - state.x0

    def finish(self, state: LocalState, result: ClientResult) -> None:
        if self.first is not None:
            result.payloads[FIRST_STEP_UPDATE] = to_host(self.first)


class BiasCapture(LocalProcedure):
    """HiCS-FL's signature: the output-layer bias part of the update."""

    def __init__(self, layout: ParamLayout, bias_name: str) -> None:
        super().__init__()
        self.layout, self.bias_name = layout, bias_name

    def finish(self, state: LocalState, result: ClientResult) -> None:
        assert state.update is not None
        offset = 0
        for name, size in zip(self.layout.names, self.layout.sizes, strict=True):
            if name == self.bias_name:
                result.bias_update = state.update[offset : offset + size].double().cpu().numpy()
            offset += size


class ActivationCapture(LocalProcedure):
    """Equitable-FL's activation vector (seed-equitable.md §1.4) from the penultimate layer's output h over the
    samples of the last local epoch's steps (a step budget: its last epoch's worth of steps), each at the model state
    of its own forward pass, so it costs no extra forward pass. final_epoch_mean (the spec's default) averages
    log_softmax(h), log_softmax_of_mean averages h; eval_pass runs its own pass after training."""

    @dataclass(frozen=True)
    class Params:
        mode: int = federation_pb2.ACTIVATION_MODE_FINAL_EPOCH_MEAN

        def validate(self, path: str) -> None:
            if self.mode not in federation_pb2.ActivationMode.values():
                raise ValueError(f"unknown activation_mode {self.mode}")

    def begin(self, state: LocalState) -> None:
        n, steps = len(state.y_train), state.steps
        window = self.params.mode != federation_pb2.ACTIVATION_MODE_EVAL_PASS
        self.start = steps - min(steps, math.ceil(n / state.batch_size)) if window else steps
        self.total = torch.zeros(state.head.feature_dim, dtype=torch.float64, device=state.device)
        self.count = 0

    def wants_features(self, state: LocalState) -> bool:
        return state.step >= self.start

    def after_forward(self, state: LocalState) -> None:
        if state.features is None:
            return
        hidden = state.features.detach()
        if self.params.mode == federation_pb2.ACTIVATION_MODE_LOG_SOFTMAX_OF_MEAN:
            self.total += hidden.sum(0, dtype=torch.float64)
        else:
            self.total += F.log_softmax(hidden, dim=1).sum(0, dtype=torch.float64)
        self.count += len(hidden)

    def finish(self, state: LocalState, result: ClientResult) -> None:
        result.activation = self._vector(state).cpu().numpy()

    @torch.no_grad()
    def _vector(self, state: LocalState) -> torch.Tensor:
        mode = self.params.mode
        if mode == federation_pb2.ACTIVATION_MODE_EVAL_PASS:
            x = state.x_train  # a device tensor, or an on-disk client's DiskRows (read chunk by chunk)
            state.model.eval()
            total = torch.zeros_like(self.total)
            for chunk in row_chunks(x, EVAL_BATCH):
                hidden = state.head.features(chunk)
                total += F.log_softmax(hidden, dim=1).sum(0, dtype=torch.float64)
            return total / len(x)
        if mode == federation_pb2.ACTIVATION_MODE_LOG_SOFTMAX_OF_MEAN:
            return F.log_softmax(self.total / self.count, dim=0)
        return self.total / self.count


@dataclass(frozen=True)
class Telemetry:
    """The loop's own noiseless measurements a task releases: F_i at x_t and x_K (`losses`), with Acc_i(x_t)
    (`accuracy`), and the mean training loss (`train_loss`)."""

    losses: bool
    accuracy: bool = True
    train_loss: bool = True


class LoopOwner(LocalProcedure):
    """Internal, not part of fairfl.procedure's public hooks: a built-in piece that takes over the loop's batches
    and gradients (DP-SGD). The loop calls these hooks on pieces of this class only, at most one per task, and such a
    task runs no other piece (user procedures would see what the owner keeps private).

        telemetry(cfg) -> Telemetry          which of the loop's noiseless measurements may leave
        draw_batch(state) -> indices         this step's batch, in place of the loop's shuffled epochs
        gradient(state) -> (loss sum, count) writes p.grad, in place of the loop's forward, objective and backward;
                                             the training loss is Σ loss sums / Σ counts over the steps
        release(state, result)               after training, before the loop's telemetry (noisy releases)
    """

    def telemetry(self, cfg: federation_pb2.LocalTrainingConfig) -> Telemetry:
        return Telemetry(losses=not cfg.skip_losses)

    def draw_batch(self, state: LocalState) -> torch.Tensor | None:
        """This step's sample indices on the device, or None for the loop's own batch."""
        return None

    def gradient(self, state: LocalState) -> tuple[torch.Tensor, int]:
        """Write this step's gradient to each parameter's `.grad` from state.inputs / state.targets."""
        raise NotImplementedError

    def release(self, state: LocalState, result: ClientResult) -> None:
        """Once, after training (`state.update` is set), before the loop's own telemetry."""


class DpSgd(LoopOwner):
    """FedFDP's LOCAL (Alg. 2): DP-SGD steps on Poisson(q) batches with fair clipping, then the noisy loss.

    λ = dp.fair_lambda (0 = standard DP-SGD), F = fair_step.global_loss (0 without one); FedProx's μ(w − x_t) is
    added to each per-sample gradient before clipping. Optimiser, momentum, weight decay and lr apply to the noisy
    gradient (post-processing). The update and the noisy loss are released; the noiseless losses only as opted-in
    experiment telemetry (dp.plaintext_telemetry), else NaN = withheld. See client_agent/dp_sgd.py.
    """

    def __init__(self, cfg: federation_pb2.LocalTrainingConfig, randomness: str) -> None:
        super().__init__()
        self.check(cfg)
        self.cfg, self.dp, self.randomness = cfg, cfg.dp, randomness
        self.global_loss = cfg.fair_step.global_loss if cfg.HasField("fair_step") else 0.0

    @staticmethod
    def check(cfg: federation_pb2.LocalTrainingConfig) -> None:
        """A DP-SGD task releases the noisy update and loss only: refuse settings that would release more."""
        dp = cfg.dp
        if cfg.WhichOneof("budget") != "local_steps":
            raise ValueError("DP-SGD needs local_steps: epochs are not Poisson-sampled steps")
        if not 0 < dp.sample_rate <= 1 or dp.noise_multiplier <= 0 or dp.clip_norm <= 0:
            raise ValueError(
                f"invalid DP-SGD settings: sample_rate={dp.sample_rate}, noise_multiplier={dp.noise_multiplier}, "
                f"clip_norm={dp.clip_norm}"
            )
        if cfg.HasField("alignment") or cfg.record_first_step or cfg.want_bias_update or cfg.want_activation:
            raise ValueError("DP-SGD tasks cannot also release alignment steps, bias updates or activations")
        if cfg.procedures:  # their hooks would see the non-private per-batch gradients and losses
            refs = ", ".join(spec.ref for spec in cfg.procedures)
            raise ValueError(f"train.procedures: DP-SGD tasks cannot run local procedures ({refs})")

    def telemetry(self, cfg: federation_pb2.LocalTrainingConfig) -> Telemetry:
        telemetry = self.dp.plaintext_telemetry
        return Telemetry(losses=telemetry, accuracy=False, train_loss=telemetry)

    def begin(self, state: LocalState) -> None:
        seeds = [dp_seed(self.randomness, state.seed, purpose) for purpose in range(4)]
        self.sample_gen, self.noise_gen, self.loss_sample_gen, self.loss_noise_gen = (
            torch.Generator().manual_seed(s) for s in seeds
        )
        self.named = dict(state.model.named_parameters())
        self.anchor = None
        if self.cfg.prox_mu > 0:
            self.anchor = {k: p.detach().clone() for k, p in self.named.items()}
        self.last_batch = torch.empty(0, dtype=torch.long)

    def draw_batch(self, state: LocalState) -> torch.Tensor:
        self.last_batch = to_device(
            dp_sgd.poisson_sample(len(state.y_train), self.dp.sample_rate, self.sample_gen), state.device
        )
        return self.last_batch

    def gradient(self, state: LocalState) -> tuple[torch.Tensor, int]:
        """ĝ = (Σ_j c_j g_j + N(0, σ²C²I)) / b on the batch; (Σ_j ℓ_j on the device, |B|)."""
        dp, mu = self.dp, self.cfg.prox_mu
        prox = None
        if self.anchor is not None:  # FedProx's μ(w − x_t), added to each per-sample gradient before clipping
            prox = {k: mu * (p.detach() - self.anchor[k]) for k, p in self.named.items()}
        clipped = dp_sgd.clipped_gradient_sum(
            state.model, state.inputs, state.targets, dp.clip_norm, dp.fair_lambda, self.global_loss, prox
        )
        noise = dp_sgd.gaussian_like(clipped.sums, dp.noise_multiplier * dp.clip_norm, self.noise_gen)
        divisor = noise_divisor(dp, len(state.y_train), clipped.batch)
        for k, p in self.named.items():  # every parameter's gradient replaced: nothing to zero first
            p.grad = (clipped.sums[k] + noise[k]) / divisor
        return clipped.loss_total, clipped.batch

    def release(self, state: LocalState, result: ClientResult) -> None:
        """FedFDP's noisy loss F̃ at the trained model (Alg. 2 lines 22–28), on an independent Poisson batch (§2.6 a,
        so Theorem 3 applies) or, with shared_loss_batch, on the last gradient batch."""
        dp = self.dp
        if dp.loss_noise_multiplier <= 0:
            return
        n = len(state.y_train)
        clip = max(dp.loss_clip, dp.loss_clip_min)
        idx = self.last_batch
        if not dp.shared_loss_batch:
            idx = to_device(dp_sgd.poisson_sample(n, dp.sample_rate, self.loss_sample_gen), state.device)
        state.model.eval()
        result.noisy_loss = dp_sgd.noisy_loss(
            state.model,
            state.x_train[idx],
            state.y_train[idx],
            clip,
            dp.loss_noise_multiplier,
            noise_divisor(dp, n, len(idx)),
            self.loss_noise_gen,
        )
        result.metrics["loss_clip"] = clip  # public: the bound the server sent (or the public floor)


def builtin_pieces(
    cfg: federation_pb2.LocalTrainingConfig,
    model: nn.Module,
    layout: ParamLayout,
    fetch: Callable[[tensor_pb2.BlobRef], torch.Tensor],
    dp_randomness: str = "secure",
) -> list[LocalProcedure]:
    """The pieces the task's typed fields ask for, in the loop's order. `fetch` resolves a blob (the fair gradient)
    to a flat vector on the device. A DP-SGD task gets DpSgd alone (its per-sample clipping subsumes FedProx's and
    FedFDP's terms), after DpSgd.check refuses what it must not release, user procedures included; `dp_randomness`
    seeds its generators (fairfl.privacy.dp_seed)."""
    if cfg.HasField("dp"):
        return [DpSgd(cfg, dp_randomness)]
    pieces: list[LocalProcedure] = []
    if cfg.prox_mu > 0:
        pieces.append(ProximalTerm(ProximalTerm.Params(cfg.prox_mu)))
    if cfg.HasField("alignment"):
        fair_gradient = [t for _, t in layout.split(fetch(cfg.alignment.fair_gradient))]
        pieces.append(GradientAlignment(GradientAlignment.Params(cfg.alignment.alpha), fair_gradient))
    if cfg.HasField("fair_step"):
        pieces.append(FairStep(FairStep.Params(cfg.fair_step.fair_lambda, cfg.fair_step.global_loss)))
    if cfg.record_first_step:
        pieces.append(FirstStep())
    if cfg.want_bias_update:
        head = model_head(model, "train.want_bias_update (HiCS-FL's signature)", need_bias=True)
        pieces.append(BiasCapture(layout, head.bias_name))
    if cfg.want_activation:
        params = ActivationCapture.Params(cfg.activation_mode)
        params.validate("train.activation_mode")
        pieces.append(ActivationCapture(params))
    return pieces
