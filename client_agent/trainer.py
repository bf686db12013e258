"""Local procedures of logical clients: train, probe and evaluate. The same code serves both transports.

One `ClientRuntime` per process holds the run's federated data and one reusable model on one device; each task
loads the global parameters into that model, so hosting many logical clients costs one model's memory.

On CUDA the host waits for the device only where a value must reach it: a round's global model is copied to the
device once (pinned staging, non_blocking) and shared by every client trained from it; index batches go up the same
way; losses are summed on the device and read once; updates come down into pinned buffers and the runtime
synchronises once per task, before the result is handed on for encoding. On the CPU the arithmetic and its order
are exactly those of a plain loop (tests compare gRPC runs bit for bit with the in-process oracle).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from client_agent import dp_sgd
from client_agent.pieces import EVAL_BATCH, builtin_pieces
from fairfl.config import ExperimentConfig
from fairfl.data import DataSignature, FederatedData
from fairfl.models import build_run_model
from fairfl.params import DeviceCache, ParamLayout, flatten_on_device, load_flat, synchronize, to_device, to_host
from fairfl.privacy import check_randomness, dp_seed
from fairfl.procedure import LocalProcedure, LocalState, resolve_procedures
from fairfl.protocol import EVALUATE, GRADIENT, PROBE, TRAIN, UPDATE, ClientResult
from fairfl.v1 import federation_pb2, tensor_pb2

BlobResolver = Callable[[tensor_pb2.BlobRef], torch.Tensor]


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {requested!r} requested but CUDA is not available on this machine")
    return torch.device(requested)


@dataclass
class _ClientTensors:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


class ClientRuntime:
    """Executes tasks for a set of logical clients of one run on one device."""

    def __init__(
        self,
        config: ExperimentConfig,
        data: FederatedData,
        client_ids: list[int],
        device: torch.device,
        resolve_blob: BlobResolver,
        dp_policy: dp_sgd.DpPolicy | None = None,
        dp_randomness: str = "task",
    ) -> None:
        self.config = config
        self.dp_policy = dp_policy or dp_sgd.DpPolicy()
        self.dp_randomness = check_randomness(dp_randomness)  # see fairfl.privacy: 'task' only for simulations
        self.device = device
        self.resolve_blob = resolve_blob
        signature = DataSignature(data.input_shape, data.num_classes)  # of the data this runtime actually holds
        self.model = build_run_model(config, signature).to(device)
        self.layout = ParamLayout.of(self.model)
        self.resident = DeviceCache(device)  # the round's x_t (and fair gradient), on the device once per version
        self.num_classes = data.num_classes
        self.clients: dict[int, _ClientTensors] = {}
        for cid in client_ids:
            if not 0 <= cid < data.num_clients:
                raise ValueError(f"client id {cid} outside the run's {data.num_clients} clients")
            tr, te = data.train_indices[cid], data.test_indices[cid]
            self.clients[cid] = _ClientTensors(
                x_train=torch.from_numpy(data.train.x[tr]).to(device),
                y_train=torch.from_numpy(data.train.y[tr]).to(device),
                x_test=torch.from_numpy(data.test.x[te]).to(device),
                y_test=torch.from_numpy(data.test.y[te]).to(device),
            )

    def run(self, task: federation_pb2.Task) -> ClientResult:
        client = self.clients.get(task.client_id)
        if client is None:
            raise KeyError(f"client {task.client_id} is not hosted here")
        self.dp_policy.check(task)  # before anything touches the data
        x0 = self.resident.get(task.model.sha256, self.resolve_blob(task.model))
        load_flat(self.model, x0)
        result = ClientResult(
            task_id=task.task_id,
            run_id=task.run_id,
            round=task.round,
            client_id=task.client_id,
            phase=task.phase,
            num_samples=len(client.y_train),
        )
        if task.phase == TRAIN:
            self._train(task, client, x0, result)
        elif task.phase == PROBE:
            self._probe(task, client, result)
        elif task.phase == EVALUATE:
            self._evaluate(task, client, result)
        else:
            raise ValueError(f"unknown task phase {task.phase}")
        synchronize(self.device)  # the payloads' device→host copies were queued; the caller reads them next
        return result

    # -- procedures ---------------------------------------------------------------------------------------------

    def _train(self, task: federation_pb2.Task, c: _ClientTensors, x0: torch.Tensor, out: ClientResult) -> None:
        """Local training: one loop (`_run_steps`) composed of the task's pieces (built-in algorithms, then user
        procedures); DP-SGD tasks take `_train_dp`."""
        cfg = task.train
        if cfg.HasField("dp"):
            self._train_dp(task, c, x0, out)
            return
        pieces = self._pieces(cfg)  # first: a task naming a procedure this agent cannot run fails before any work
        n = len(c.y_train)
        batch = min(cfg.batch_size, n)
        steps = _local_steps(cfg, n, batch)
        if not cfg.skip_losses:  # F_i(x_t) and Acc_i(x_t); skipped (NaN: withheld) when no one reads them
            out.loss_before, accuracy_before = self._loss_and_accuracy(c, cfg.loss_eval_batches, batch, task.seed)
            out.metrics["accuracy_before"] = accuracy_before  # % on local training data at x_t (FairFed's Acc_i)
        state = self._local_state(task, c, x0, steps, batch)
        train_loss, mean_lr = self._run_steps(state, pieces)
        state.update = flatten_on_device(self.model) - x0  # x_K − x_t, computed on the device where both are
        out.payloads[UPDATE] = to_host(state.update)
        if not cfg.skip_losses:
            out.loss_after = self._mean_loss(c, cfg.loss_eval_batches, batch, task.seed)
        out.metrics["train_loss"] = train_loss
        out.metrics["local_steps"] = float(steps)
        out.metrics["lr"] = mean_lr
        for piece in pieces:
            piece.finish(state, out)

    def _pieces(self, cfg: federation_pb2.LocalTrainingConfig) -> list[LocalProcedure]:
        """The task's built-in pieces in their fixed order, then its user procedures in the order listed."""

        def fetch(ref: tensor_pb2.BlobRef) -> torch.Tensor:
            return self.resident.get(ref.sha256, self.resolve_blob(ref))

        return builtin_pieces(cfg, self.model, self.layout, fetch) + resolve_procedures(cfg)

    def _local_state(
        self, task: federation_pb2.Task, c: _ClientTensors, x0: torch.Tensor, steps: int, batch: int
    ) -> LocalState:
        """The loop's state at x_t: the model, its optimiser and the client's data."""
        params = list(self.model.parameters())
        return LocalState(
            config=task.train,
            model=self.model,
            params=params,
            optimizer=_optimizer(task.train, params),
            x0=x0,
            x_train=c.x_train,
            y_train=c.y_train,
            device=self.device,
            steps=steps,
            batch_size=batch,
            base_lr=task.train.lr,
            lr=task.train.lr,
            seed=task.seed,
        )

    def _run_steps(self, state: LocalState, pieces: list[LocalProcedure]) -> tuple[float, float]:
        """The local steps, each calling the pieces' hooks at their points; (mean training loss, mean step size)."""
        hooks = _Hooks(pieces)
        n, batch = len(state.y_train), state.batch_size
        gen = torch.Generator().manual_seed(state.seed)
        order = torch.empty(0, dtype=torch.long)
        position = 0
        # Summed on the device in float64, in step order: the same number as adding float(loss) on the host, without
        # waiting for the device every step.
        loss_sum = torch.zeros((), dtype=torch.float64, device=state.device)
        lr_sum = 0.0
        for piece in pieces:
            piece.begin(state)
        state.model.train()
        for step in range(state.steps):
            if position + batch > len(order):  # new epoch: fresh permutation (CPU generator: same on every device)
                order = to_device(torch.randperm(n, generator=gen), state.device)
                position = 0
            idx = order[position : position + batch]
            position += batch
            state.step, state.inputs, state.targets = step, state.x_train[idx], state.y_train[idx]
            loss_sum += _step(state, hooks).detach()
            lr_sum += state.lr
        steps = max(state.steps, 1)
        return float(loss_sum) / steps, lr_sum / steps if hooks.step_lr else state.base_lr

    def _train_dp(self, task: federation_pb2.Task, c: _ClientTensors, x0: torch.Tensor, out: ClientResult) -> None:
        """FedFDP's LOCAL (Alg. 2): K DP-SGD steps on Poisson(q) batches with fair clipping, then the noisy loss.

        λ = dp.fair_lambda (0 = standard DP-SGD), F = fair_step.global_loss (0 without one). Optimiser, momentum,
        weight decay and lr apply to the noisy gradient (post-processing). See client_agent/dp_sgd.py.
        """
        cfg, dp = task.train, task.train.dp
        _check_dp_task(cfg)
        n = len(c.y_train)
        batch = min(cfg.batch_size, n)
        # Noiseless training losses leave only as opted-in experiment telemetry (not private); otherwise NaN = withheld.
        telemetry = dp.plaintext_telemetry
        if telemetry:
            out.loss_before = self._mean_loss(c, cfg.loss_eval_batches, batch, task.seed)
        seeds = [dp_seed(self.dp_randomness, task.seed, purpose) for purpose in range(4)]
        sample_gen, noise_gen, loss_sample_gen, loss_noise_gen = (torch.Generator().manual_seed(s) for s in seeds)
        last_batch, loss_sum, sampled = self._dp_steps(cfg, c, sample_gen, noise_gen)
        out.payloads[UPDATE] = to_host(flatten_on_device(self.model) - x0)
        if dp.loss_noise_multiplier > 0:
            self._release_noisy_loss(dp, c, last_batch, loss_sample_gen, loss_noise_gen, out)
        if telemetry:
            out.loss_after = self._mean_loss(c, cfg.loss_eval_batches, batch, task.seed)
            out.metrics["train_loss"] = float(loss_sum) / max(sampled, 1)
        out.metrics["local_steps"] = float(cfg.local_steps)
        out.metrics["lr"] = cfg.lr

    def _dp_steps(
        self,
        cfg: federation_pb2.LocalTrainingConfig,
        c: _ClientTensors,
        sample_gen: torch.Generator,
        noise_gen: torch.Generator,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The K DP-SGD steps; (the last batch's indices, Σ training losses on the device, samples drawn)."""
        dp, model, n = cfg.dp, self.model, len(c.y_train)
        params = dict(model.named_parameters())
        opt = _optimizer(cfg, params.values())
        anchor = {k: p.detach().clone() for k, p in params.items()} if cfg.prox_mu > 0 else None
        global_loss = cfg.fair_step.global_loss if cfg.HasField("fair_step") else 0.0
        idx = torch.empty(0, dtype=torch.long)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)  # telemetry only: read once, if asked
        sampled = 0
        model.train()
        for _ in range(cfg.local_steps):
            idx = to_device(dp_sgd.poisson_sample(n, dp.sample_rate, sample_gen), self.device)
            prox = None
            if anchor is not None:  # FedProx's μ(w − x_t), added to each per-sample gradient before clipping
                prox = {k: cfg.prox_mu * (p.detach() - anchor[k]) for k, p in params.items()}
            clipped = dp_sgd.clipped_gradient_sum(
                model, c.x_train[idx], c.y_train[idx], dp.clip_norm, dp.fair_lambda, global_loss, prox
            )
            noise = dp_sgd.gaussian_like(clipped.sums, dp.noise_multiplier * dp.clip_norm, noise_gen)
            divisor = dp_sgd.normalizer(dp, n, clipped.batch)
            opt.zero_grad(set_to_none=False)
            for k, p in params.items():
                p.grad = (clipped.sums[k] + noise[k]) / divisor
            opt.step()
            loss_sum += clipped.loss_total
            sampled += clipped.batch
        return idx, loss_sum, sampled

    def _release_noisy_loss(
        self,
        dp: federation_pb2.DpSgd,
        c: _ClientTensors,
        last_batch: torch.Tensor,
        sample_gen: torch.Generator,
        noise_gen: torch.Generator,
        out: ClientResult,
    ) -> None:
        """FedFDP's noisy loss F̃ at the trained model (Alg. 2 lines 22–28), on an independent Poisson batch (§2.6 a,
        so Theorem 3 applies) or, with shared_loss_batch, on the last gradient batch."""
        n = len(c.y_train)
        clip = max(dp.loss_clip, dp.loss_clip_min)
        idx = last_batch
        if not dp.shared_loss_batch:
            idx = to_device(dp_sgd.poisson_sample(n, dp.sample_rate, sample_gen), self.device)
        self.model.eval()
        out.noisy_loss = dp_sgd.noisy_loss(
            self.model,
            c.x_train[idx],
            c.y_train[idx],
            clip,
            dp.loss_noise_multiplier,
            dp_sgd.normalizer(dp, n, len(idx)),
            noise_gen,
        )
        out.metrics["loss_clip"] = clip  # public: the bound the server sent (or the public floor)

    def _probe(self, task: federation_pb2.Task, c: _ClientTensors, out: ClientResult) -> None:
        cfg = task.probe
        batch = min(cfg.batch_size or self.config.training.batch_size, len(c.y_train))
        out.loss_before = self._mean_loss(c, cfg.loss_eval_batches, batch, task.seed)
        if cfg.want_gradient:
            gen = torch.Generator().manual_seed(task.seed)
            self.model.train()
            self.model.zero_grad(set_to_none=False)
            batches = max(cfg.gradient_batches, 1)
            for _ in range(batches):
                idx = to_device(torch.randperm(len(c.y_train), generator=gen)[:batch], self.device)
                loss = F.cross_entropy(self.model(c.x_train[idx]), c.y_train[idx]) / batches
                loss.backward()
            out.payloads[GRADIENT] = to_host(torch.cat([p.grad.reshape(-1) for p in self.model.parameters()]).float())

    @torch.no_grad()
    def _evaluate(self, task: federation_pb2.Task, c: _ClientTensors, out: ClientResult) -> None:
        self.model.eval()
        loss_sum, correct = self._sums(self.model, c.x_test, c.y_test)
        n_test = len(c.y_test)
        out.num_samples = n_test
        out.test_accuracy = 100.0 * correct / n_test
        out.test_loss = loss_sum / n_test
        if task.evaluate.include_train_loss:
            out.loss_before = self._mean_loss(c, 0, EVAL_BATCH, task.seed)

    # -- helpers ------------------------------------------------------------------------------------------------

    def _mean_loss(self, c: _ClientTensors, max_batches: int, batch: int, seed: int) -> float:
        """F_i at the current parameters: mean cross-entropy over the local training set (or `max_batches`)."""
        return self._loss_and_accuracy(c, max_batches, batch, seed)[0]

    @torch.no_grad()
    def _loss_and_accuracy(self, c: _ClientTensors, max_batches: int, batch: int, seed: int) -> tuple[float, float]:
        """Mean cross-entropy and accuracy (%) at the current parameters on the local training set (or a seeded
        subsample of `max_batches` batches), from one forward pass."""
        self.model.eval()
        if max_batches > 0:
            gen = torch.Generator().manual_seed(seed + 1)
            idx = to_device(torch.randperm(len(c.y_train), generator=gen)[: max_batches * batch], self.device)
            x, y = c.x_train[idx], c.y_train[idx]
        else:
            x, y = c.x_train, c.y_train
        total, correct = self._sums(self.model, x, y)
        return total / len(y), 100.0 * correct / len(y)

    @staticmethod
    @torch.no_grad()
    def _sums(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
        """Summed cross-entropy and number of correct predictions over (x, y) in EVAL_BATCH slices, accumulated on
        the device (float64 in slice order: the same number as adding each slice's float on the host) and read once."""
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        correct = torch.zeros((), dtype=torch.int64, device=x.device)
        for start in range(0, len(y), EVAL_BATCH):
            logits = model(x[start : start + EVAL_BATCH])
            total += F.cross_entropy(logits, y[start : start + EVAL_BATCH], reduction="sum")
            correct += (logits.argmax(dim=1) == y[start : start + EVAL_BATCH]).sum()
        return float(total), int(correct)


class _Hooks:
    """The pieces that override each per-step hook, so the loop calls only those (in the pieces' order)."""

    def __init__(self, pieces: list[LocalProcedure]) -> None:
        def overriding(hook: str) -> list[LocalProcedure]:
            return [p for p in pieces if getattr(type(p), hook) is not getattr(LocalProcedure, hook)]

        self.wants_features = overriding("wants_features")
        self.after_forward = overriding("after_forward")
        self.objective = overriding("objective")
        self.after_backward = overriding("after_backward")
        self.step_lr = overriding("step_lr")
        self.after_step = overriding("after_step")


def _step(state: LocalState, hooks: _Hooks) -> torch.Tensor:
    """One local step on state's batch (forward, objective, backward, gradient rewrites, step size, optimiser
    step), calling the pieces' hooks at their points; the batch's cross-entropy."""
    model, opt = state.model, state.optimizer
    if any(p.wants_features(state) for p in hooks.wants_features):
        state.features, state.logits = state.forward_with_features(state.inputs)
    else:
        state.features, state.logits = None, model(state.inputs)
    for p in hooks.after_forward:
        p.after_forward(state)
    loss = state.loss = F.cross_entropy(state.logits, state.targets)
    objective = loss
    for p in hooks.objective:
        objective = p.objective(state, objective)
    opt.zero_grad()  # to None: backward then writes the gradient instead of adding it to zeros
    objective.backward()
    for p in hooks.after_backward:
        p.after_backward(state)
    for p in hooks.step_lr:
        lr = p.step_lr(state, loss)
        if lr is not None:
            state.lr = lr
            for group in opt.param_groups:
                group["lr"] = lr
    opt.step()
    for p in hooks.after_step:
        p.after_step(state)
    return loss


def _local_steps(cfg: federation_pb2.LocalTrainingConfig, n: int, batch: int) -> int:
    if cfg.WhichOneof("budget") == "local_steps":
        return cfg.local_steps
    return cfg.local_epochs * math.ceil(n / batch)


def _optimizer(cfg: federation_pb2.LocalTrainingConfig, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    if cfg.optimizer == federation_pb2.OPTIMIZER_ADAM:
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def _check_dp_task(cfg: federation_pb2.LocalTrainingConfig) -> None:
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
