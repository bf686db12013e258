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
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from client_agent import dp_sgd
from fairfl.config import ExperimentConfig
from fairfl.data import FederatedData, build_federated
from fairfl.models import build_model
from fairfl.params import DeviceCache, ParamLayout, flatten_on_device, load_flat, synchronize, to_device, to_host
from fairfl.privacy import check_randomness, dp_seed
from fairfl.protocol import EVALUATE, FIRST_STEP_UPDATE, GRADIENT, PROBE, TRAIN, UPDATE, ClientResult
from fairfl.v1 import federation_pb2, tensor_pb2

BlobResolver = Callable[[tensor_pb2.BlobRef], torch.Tensor]

EVAL_BATCH = 2048


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {requested!r} requested but CUDA is not available on this machine")
    return torch.device(requested)


def build_global_model(config: ExperimentConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The run's initial model; every process builds the same one from the run seed."""
    torch.manual_seed(config.seed)
    m = config.model
    kwargs: dict[str, object] = {}
    if m.name == "mlp":
        kwargs = {"hidden": tuple(m.hidden)}
    elif m.name == "cnn":
        kwargs = {"channels": tuple(m.cnn_channels), "hidden": m.cnn_hidden}
    return build_model(config.model.name, input_shape, num_classes, **kwargs)


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
        self.model = build_global_model(config, data.input_shape, data.num_classes).to(device)
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
        cfg = task.train
        if cfg.HasField("dp"):
            self._train_dp(task, c, x0, out)
            return
        model = self.model
        n = len(c.y_train)
        batch = min(cfg.batch_size, n)
        gen = torch.Generator().manual_seed(task.seed)
        steps = (
            cfg.local_steps if cfg.WhichOneof("budget") == "local_steps" else cfg.local_epochs * math.ceil(n / batch)
        )
        if not cfg.skip_losses:  # F_i(x_t) and Acc_i(x_t); skipped (NaN: withheld) when no one reads them
            out.loss_before, accuracy_before = self._loss_and_accuracy(c, cfg.loss_eval_batches, batch, task.seed)
            out.metrics["accuracy_before"] = accuracy_before  # % on local training data at x_t (FairFed's Acc_i)

        lr = cfg.lr
        fair = cfg.fair_step if cfg.HasField("fair_step") else None
        params = list(model.parameters())
        if cfg.optimizer == federation_pb2.OPTIMIZER_ADAM:
            opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=lr, weight_decay=cfg.weight_decay)
        else:
            opt = torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        anchor = [p.detach().clone() for p in params] if cfg.prox_mu > 0 else None
        fair_grad = None
        if cfg.HasField("alignment"):
            ref = cfg.alignment.fair_gradient
            fair_grad = [t for _, t in self.layout.split(self.resident.get(ref.sha256, self.resolve_blob(ref)))]

        model.train()
        order = torch.empty(0, dtype=torch.long)
        position = 0
        # Summed on the device in float64, in step order: the same number as adding float(loss) on the host, without
        # waiting for the device every step.
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        lr_sum = 0.0
        first_step: torch.Tensor | None = None
        # Equitable-FL activation vector (seed-equitable.md §1.4): from the penultimate layer's output h over the
        # samples of the last local epoch's steps (a step budget: its last epoch's worth of steps), each at the model
        # state of its own forward pass, so it costs no extra forward pass. final_epoch_mean (the spec's default)
        # averages log_softmax(h), log_softmax_of_mean averages h; eval_pass runs its own pass after training.
        mode = cfg.activation_mode
        if cfg.want_activation and mode not in federation_pb2.ActivationMode.values():
            raise ValueError(f"unknown activation_mode {mode}")
        window = cfg.want_activation and mode != federation_pb2.ACTIVATION_MODE_EVAL_PASS
        activation_from = steps - min(steps, math.ceil(n / batch)) if window else steps
        activation_sum = torch.zeros(model.feature_dim, dtype=torch.float64, device=self.device)
        activation_count = 0
        for step in range(steps):
            if position + batch > len(order):  # new epoch: fresh permutation (CPU generator: same on every device)
                order = to_device(torch.randperm(n, generator=gen), self.device)
                position = 0
            idx = order[position : position + batch]
            position += batch
            if step >= activation_from:
                hidden = model.features(c.x_train[idx])
                logits = model.classifier(hidden)  # == model(x): forward is classifier(features(x))
                if mode == federation_pb2.ACTIVATION_MODE_LOG_SOFTMAX_OF_MEAN:
                    activation_sum += hidden.detach().sum(0, dtype=torch.float64)
                else:
                    activation_sum += F.log_softmax(hidden.detach(), dim=1).sum(0, dtype=torch.float64)
                activation_count += len(idx)
            else:
                logits = model(c.x_train[idx])
            loss = F.cross_entropy(logits, c.y_train[idx])
            objective = loss
            if anchor is not None:
                prox = sum(((p - a) ** 2).sum() for p, a in zip(params, anchor, strict=True))
                objective = loss + 0.5 * cfg.prox_mu * prox
            opt.zero_grad()  # to None: backward then writes the gradient instead of adding it to zeros
            objective.backward()
            if fair_grad is not None:
                alpha = cfg.alignment.alpha
                for p, g in zip(params, fair_grad, strict=True):
                    p.grad.mul_(1.0 - alpha).add_(g, alpha=alpha)
            if fair is not None:  # FedFair Eq. 11: η_i = η·(1 + λ·(F_i(w, b) − F)), from this batch's loss
                # (the step size is a host number, so this reads the loss every step: the one per-step sync left)
                step_lr = lr * max(0.0, 1.0 + fair.fair_lambda * (float(loss.detach()) - fair.global_loss))
                for group in opt.param_groups:
                    group["lr"] = step_lr
                lr_sum += step_lr
            opt.step()
            loss_sum += loss.detach()
            if step == 0 and cfg.record_first_step:
                first_step = flatten_on_device(model) - x0
        update = flatten_on_device(model) - x0  # x_K − x_t, computed on the device where both are
        out.payloads[UPDATE] = to_host(update)
        if first_step is not None:
            out.payloads[FIRST_STEP_UPDATE] = to_host(first_step)
        if not cfg.skip_losses:
            out.loss_after = self._mean_loss(c, cfg.loss_eval_batches, batch, task.seed)
        out.metrics["train_loss"] = float(loss_sum) / max(steps, 1)
        out.metrics["local_steps"] = float(steps)
        out.metrics["lr"] = lr_sum / max(steps, 1) if fair is not None else lr
        if cfg.want_bias_update:
            bias_name = self._classifier_bias_name()
            offset = 0
            for name, size in zip(self.layout.names, self.layout.sizes, strict=True):
                if name == bias_name:
                    out.bias_update = update[offset : offset + size].double().cpu().numpy()
                offset += size
        if cfg.want_activation:
            out.activation = self._activation(c, mode, activation_sum, activation_count).cpu().numpy()

    def _train_dp(self, task: federation_pb2.Task, c: _ClientTensors, x0: torch.Tensor, out: ClientResult) -> None:
        """FedFDP's LOCAL (Alg. 2): K DP-SGD steps on Poisson(q) batches with fair clipping, then the noisy loss.

        λ = dp.fair_lambda (0 = standard DP-SGD), F = fair_step.global_loss (0 without one). Optimiser, momentum,
        weight decay and lr apply to the noisy gradient (post-processing). See client_agent/dp_sgd.py.
        """
        cfg, dp = task.train, task.train.dp
        if cfg.WhichOneof("budget") != "local_steps":
            raise ValueError("DP-SGD needs local_steps: epochs are not Poisson-sampled steps")
        if not 0 < dp.sample_rate <= 1 or dp.noise_multiplier <= 0 or dp.clip_norm <= 0:
            raise ValueError(
                f"invalid DP-SGD settings: sample_rate={dp.sample_rate}, noise_multiplier={dp.noise_multiplier}, "
                f"clip_norm={dp.clip_norm}"
            )
        if cfg.HasField("alignment") or cfg.record_first_step or cfg.want_bias_update or cfg.want_activation:
            raise ValueError("DP-SGD tasks cannot also release alignment steps, bias updates or activations")
        model = self.model
        n = len(c.y_train)
        batch = min(cfg.batch_size, n)
        # Noiseless training losses leave only as opted-in experiment telemetry (not private); otherwise NaN = withheld.
        telemetry = dp.plaintext_telemetry
        if telemetry:
            out.loss_before = self._mean_loss(c, cfg.loss_eval_batches, batch, task.seed)
        seeds = [dp_seed(self.dp_randomness, task.seed, purpose) for purpose in range(4)]
        sample_gen, noise_gen, loss_sample_gen, loss_noise_gen = (torch.Generator().manual_seed(s) for s in seeds)

        params = dict(model.named_parameters())
        if cfg.optimizer == federation_pb2.OPTIMIZER_ADAM:
            opt: torch.optim.Optimizer = torch.optim.Adam(params.values(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        else:
            opt = torch.optim.SGD(params.values(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        anchor = {k: p.detach().clone() for k, p in params.items()} if cfg.prox_mu > 0 else None
        global_loss = cfg.fair_step.global_loss if cfg.HasField("fair_step") else 0.0
        idx = torch.empty(0, dtype=torch.long)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)  # telemetry only: read once, if asked
        sampled = 0
        model.train()
        for _ in range(cfg.local_steps):
            idx = to_device(dp_sgd.poisson_sample(n, dp.sample_rate, sample_gen), self.device)
            prox = None
            if anchor is not None:
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
        out.payloads[UPDATE] = to_host(flatten_on_device(model) - x0)
        if dp.loss_noise_multiplier > 0:
            clip = max(dp.loss_clip, dp.loss_clip_min)
            if not dp.shared_loss_batch:  # §2.6 (a): an independent Poisson batch, so Theorem 3 applies
                idx = to_device(dp_sgd.poisson_sample(n, dp.sample_rate, loss_sample_gen), self.device)
            model.eval()
            out.noisy_loss = dp_sgd.noisy_loss(
                model,
                c.x_train[idx],
                c.y_train[idx],
                clip,
                dp.loss_noise_multiplier,
                dp_sgd.normalizer(dp, n, len(idx)),
                loss_noise_gen,
            )
            out.metrics["loss_clip"] = clip  # public: the bound the server sent (or the public floor)
        if telemetry:
            out.loss_after = self._mean_loss(c, cfg.loss_eval_batches, batch, task.seed)
            out.metrics["train_loss"] = float(loss_sum) / max(sampled, 1)
        out.metrics["local_steps"] = float(cfg.local_steps)
        out.metrics["lr"] = cfg.lr

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

    @torch.no_grad()
    def _activation(self, c: _ClientTensors, mode: int, total: torch.Tensor, count: int) -> torch.Tensor:
        """The activation vector of `mode` from the training-time sums (or, for eval_pass, a pass of its own)."""
        if mode == federation_pb2.ACTIVATION_MODE_EVAL_PASS:
            self.model.eval()
            total = torch.zeros_like(total)
            for start in range(0, len(c.y_train), EVAL_BATCH):
                hidden = self.model.features(c.x_train[start : start + EVAL_BATCH])
                total += F.log_softmax(hidden, dim=1).sum(0, dtype=torch.float64)
            return total / len(c.y_train)
        if mode == federation_pb2.ACTIVATION_MODE_LOG_SOFTMAX_OF_MEAN:
            return F.log_softmax(total / count, dim=0)
        return total / count

    def _classifier_bias_name(self) -> str:
        for name, param in self.model.named_parameters():
            if param is self.model.classifier.bias:
                return name
        raise ValueError("model has no classifier bias")


def load_run_data(config: ExperimentConfig) -> FederatedData:
    """The run's federated split; every process derives the same one from the config and seed."""
    d = config.data
    return build_federated(
        d.dataset,
        d.num_clients,
        d.partition,
        config.seed,
        root=d.root,
        download=d.download,
        shards_per_client=d.shards_per_client,
        alpha=d.alpha,
        min_size=d.min_size,
        test_per_client=d.test_per_client,
        synthetic_alpha=d.synthetic_alpha,
        synthetic_beta=d.synthetic_beta,
        group_sizes=d.group_sizes,
        group_classes=d.group_classes,
        samples_per_class=d.samples_per_class,
        group_alphas=d.group_alphas,
        test_split=d.test_split,
    )
