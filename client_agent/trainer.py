"""Local procedures of logical clients: train, probe and evaluate. The same code serves both transports.

One `ClientRuntime` per process holds its clients' data and one reusable model and optimiser on one device; each task
loads the global parameters into that model and resets the optimiser, so hosting many logical clients costs one
model's memory and a task allocates neither. A step does what a plain PyTorch loop does and no more: batches
gathered with index_select, gradients set to None before backward, and SGD's update as torch._foreach_* ops
(PlainSgd: torch.optim.SGD's arithmetic without its per-step machinery). Each client brings its
own (train, test) sets (`LocalData`): a site's own data (fairfl.data.site), or a simulation's slices of a public
dataset (`LocalData.of_simulation`, what a FederatedData turns into). In-memory samples are copied to the device once;
a site's on-disk samples (a memory-mapped .npy) stay on disk and are read a batch at a time (client_agent.rows), so
an agent can train on more data than it has memory.

On CUDA the host waits for the device only where a value must reach it: a round's global model is copied to the
device once (pinned staging, non_blocking) and shared by every client trained from it; index batches go up the same
way; losses stay on the device and are read once; updates come down into pinned buffers and the runtime
synchronises once per task, before the result is handed on for encoding. On the CPU the arithmetic and its order
are exactly those of a plain loop (tests compare gRPC runs bit for bit with the in-process oracle).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from client_agent import dp_sgd
from client_agent.pieces import EVAL_BATCH, LoopOwner, Telemetry, builtin_pieces
from client_agent.rows import DiskRows, row_chunks, rows_on_device
from fairfl.config import ExperimentConfig
from fairfl.data import ArrayDataset, DataSignature, FederatedData
from fairfl.models import build_run_model
from fairfl.params import DeviceCache, ParamLayout, flatten_on_device, load_flat, synchronize, to_device, to_host
from fairfl.privacy import check_randomness
from fairfl.procedure import LocalProcedure, LocalState, Optimizer, resolve_procedures
from fairfl.protocol import EVALUATE, GRADIENT, PROBE, TRAIN, UPDATE, ClientResult
from fairfl.v1 import federation_pb2, tensor_pb2

BlobResolver = Callable[[tensor_pb2.BlobRef], torch.Tensor]


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {requested!r} requested but CUDA is not available on this machine")
    return torch.device(requested)


class ClientSplit(Protocol):
    """One logical client's own data: its training and test sets (fairfl.data.site's SiteClient is one)."""

    @property
    def train(self) -> ArrayDataset: ...

    @property
    def test(self) -> ArrayDataset: ...


@dataclass(frozen=True)
class LocalClient:
    train: ArrayDataset
    test: ArrayDataset


@dataclass(frozen=True)
class LocalData:
    """The data a runtime serves: each hosted client's (train, test), and the signature the run's model is built
    for (the run's declared one: a site may hold fewer classes than the run expects, never other inputs)."""

    signature: DataSignature
    clients: Mapping[int, ClientSplit]

    @staticmethod
    def of_simulation(data: FederatedData, client_ids: Iterable[int]) -> LocalData:
        """A simulation's clients: each one's slices of the pooled public dataset (index copies, in memory)."""
        clients: dict[int, ClientSplit] = {}
        for cid in client_ids:
            if not 0 <= cid < data.num_clients:
                raise ValueError(f"client id {cid} outside the run's {data.num_clients} clients")
            tr, te = data.train_indices[cid], data.test_indices[cid]
            clients[cid] = LocalClient(
                ArrayDataset(data.train.x[tr], data.train.y[tr], data.num_classes, f"{data.train.name}[{cid}]"),
                ArrayDataset(data.test.x[te], data.test.y[te], data.num_classes, f"{data.test.name}[{cid}]"),
            )
        return LocalData(DataSignature(data.input_shape, data.num_classes), clients)


@dataclass
class _ClientTensors:
    """A client's samples as the loop reads them: on the device, or on disk (DiskRows: read a batch at a time);
    the labels always on the device."""

    x_train: torch.Tensor | DiskRows
    y_train: torch.Tensor
    x_test: torch.Tensor | DiskRows
    y_test: torch.Tensor


def _labels(y: np.ndarray, device: torch.device) -> torch.Tensor:
    if type(y) is not np.ndarray or not y.flags.writeable:
        y = np.array(y)  # a memory map or a read-only view: the labels are small, keep a private copy
    return torch.from_numpy(y).to(device)


class ClientRuntime:
    """Executes tasks for a set of logical clients of one run on one device."""

    def __init__(
        self,
        config: ExperimentConfig,
        data: FederatedData | LocalData,
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
        if isinstance(data, FederatedData):  # a simulation: clients are slices of one pooled dataset
            data = LocalData.of_simulation(data, client_ids)
        signature = data.signature  # the model the run's layout describes
        self.model = build_run_model(config, signature).to(device)
        self.layout = ParamLayout.of(self.model)
        # The model's parameters and its optimisers live as long as the runtime: a task resets them (load_flat, a
        # fresh optimiser state) instead of allocating new ones.
        self.params = list(self.model.parameters())
        self.sgd = PlainSgd(self.params)
        self.adam: torch.optim.Adam | None = None  # built on the first Adam task
        self.resident = DeviceCache(device)  # the round's x_t (and fair gradient), on the device once per version
        self.num_classes = signature.num_classes
        self.clients: dict[int, _ClientTensors] = {}
        for cid in client_ids:
            split = data.clients.get(cid)
            if split is None:
                raise ValueError(f"client id {cid} has no data here (its clients: {sorted(data.clients)})")
            self.clients[cid] = _ClientTensors(
                x_train=rows_on_device(split.train.x, device),
                y_train=_labels(split.train.y, device),
                x_test=rows_on_device(split.test.x, device),
                y_test=_labels(split.test.y, device),
            )

    def run(self, task: federation_pb2.Task) -> ClientResult:
        client = self.clients.get(task.client_id)
        if client is None:
            raise KeyError(f"client {task.client_id} is not hosted here")
        self.dp_policy.check(task)  # before anything touches the data
        x0 = self.resident.get(task.model.sha256, self.resolve_blob(task.model))
        load_flat(self.params, x0)
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
        procedures; a DP-SGD task's one piece, DpSgd, draws the batches and computes the gradients)."""
        pieces = self._pieces(task.train)  # first: a task this agent cannot (or must not) run fails before any work
        state = self._local_state(task, c, x0)
        telemetry = _telemetry(task.train, pieces)
        self._measure_before(c, state, telemetry, out)
        train_loss, mean_lr = self._run_steps(state, pieces)
        # x_K − x_t, computed on the device where both are (in place: flatten_on_device's vector is new)
        state.update = flatten_on_device(self.params).sub_(x0)
        out.payloads[UPDATE] = to_host(state.update)
        for owner in _owners(pieces):
            owner.release(state, out)
        self._report(c, state, telemetry, train_loss, mean_lr, out)
        for piece in pieces:
            piece.finish(state, out)

    def _pieces(self, cfg: federation_pb2.LocalTrainingConfig) -> list[LocalProcedure]:
        """The task's built-in pieces in their fixed order, then its user procedures in the order listed (a DP-SGD
        task: DpSgd alone, after its checks, which refuse user procedures)."""

        def fetch(ref: tensor_pb2.BlobRef) -> torch.Tensor:
            return self.resident.get(ref.sha256, self.resolve_blob(ref))

        return builtin_pieces(cfg, self.model, self.layout, fetch, self.dp_randomness) + resolve_procedures(cfg)

    def _local_state(self, task: federation_pb2.Task, c: _ClientTensors, x0: torch.Tensor) -> LocalState:
        """The loop's state at x_t: the model, its optimiser, the client's data and the step budget."""
        cfg, n = task.train, len(c.y_train)
        batch = min(cfg.batch_size, n)
        return LocalState(
            config=cfg,
            model=self.model,
            params=self.params,
            optimizer=self._optimizer(cfg),
            x0=x0,
            x_train=c.x_train,
            y_train=c.y_train,
            device=self.device,
            steps=_local_steps(cfg, n, batch),
            batch_size=batch,
            base_lr=cfg.lr,
            lr=cfg.lr,
            seed=task.seed,
        )

    def _measure_before(self, c: _ClientTensors, state: LocalState, telemetry: Telemetry, out: ClientResult) -> None:
        """F_i(x_t) and Acc_i(x_t) (% on local training data: FairFed's Acc_i) from one pass, as far as released;
        skipped (NaN: withheld) when no one reads them (skip_losses) or under DP-SGD without plaintext_telemetry."""
        if not telemetry.losses:
            return
        out.loss_before, accuracy_before = self._loss_and_accuracy(
            c, state.config.loss_eval_batches, state.batch_size, state.seed
        )
        if telemetry.accuracy:
            out.metrics["accuracy_before"] = accuracy_before

    def _report(
        self,
        c: _ClientTensors,
        state: LocalState,
        telemetry: Telemetry,
        train_loss: float,
        mean_lr: float,
        out: ClientResult,
    ) -> None:
        """The loop's own results after training: F_i(x_K) and the mean training loss (when released), the step
        count and the mean step size."""
        if telemetry.losses:
            out.loss_after = self._mean_loss(c, state.config.loss_eval_batches, state.batch_size, state.seed)
        if telemetry.train_loss:
            out.metrics["train_loss"] = train_loss
        out.metrics["local_steps"] = float(state.steps)
        out.metrics["lr"] = mean_lr

    def _run_steps(self, state: LocalState, pieces: list[LocalProcedure]) -> tuple[float, float]:
        """The local steps, each calling the pieces' hooks at their points; (mean training loss, mean step size).

        A step's batch is the next slice of a fresh permutation per epoch, unless a piece draws it (draw_batch).
        The training loss is Σ step losses / Σ their counts: batch means counting 1 each (the mean over steps), or
        a gradient owner's per-sample sums counting its samples."""
        hooks = _Hooks(pieces)
        n, batch = len(state.y_train), state.batch_size
        gen = torch.Generator().manual_seed(state.seed)
        order = torch.empty(0, dtype=torch.long)
        position = 0
        # Kept on the device and read once after the last step (no wait for the device per step), then added in
        # float64 in step order: the same number as adding float(loss) on the host every step.
        losses: list[torch.Tensor] = []
        counted = 0
        lr_sum = 0.0
        for piece in pieces:
            piece.begin(state)
        state.model.train()
        for step in range(state.steps):
            idx = _drawn_batch(state, hooks)
            if idx is None:
                if position + batch > len(order):  # new epoch: fresh permutation (CPU generator: same on every device)
                    order = to_device(torch.randperm(n, generator=gen), state.device)
                    position = 0
                idx = order[position : position + batch]
                position += batch
            state.step, state.inputs, state.targets = step, _rows(state.x_train, idx), _rows(state.y_train, idx)
            loss, count = _step(state, hooks)
            losses.append(loss.detach())
            counted += count
            lr_sum += state.lr
        steps = max(state.steps, 1)
        loss_sum = functools.reduce(operator.add, torch.stack(losses).tolist(), 0.0) if losses else 0.0
        return loss_sum / max(counted, 1), lr_sum / steps if hooks.step_lr else state.base_lr

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
                loss = F.cross_entropy(self.model(_rows(c.x_train, idx)), _rows(c.y_train, idx)) / batches
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

    def _optimizer(self, cfg: federation_pb2.LocalTrainingConfig) -> Optimizer:
        """The task's optimiser over the runtime's model, in the state a freshly built one has (no momentum or
        moment estimates; the task's lr and weight decay): PlainSgd for SGD, torch.optim.Adam for Adam."""
        if cfg.optimizer != federation_pb2.OPTIMIZER_ADAM:
            self.sgd.reset(lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
            return self.sgd
        if not (cfg.lr >= 0 and cfg.weight_decay >= 0):  # what a new Adam would refuse (NaN too)
            raise ValueError(f"invalid Adam settings: lr={cfg.lr}, weight_decay={cfg.weight_decay}")
        if self.adam is None:
            self.adam = torch.optim.Adam(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.adam.state.clear()  # exp_avg, exp_avg_sq and the step count start again, as in a new Adam
        group = self.adam.param_groups[0]
        group.update(self.adam.defaults)  # undo what a piece changed in the last task (a step size, say)
        group.update(lr=cfg.lr, weight_decay=cfg.weight_decay)
        return self.adam

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
            x, y = _rows(c.x_train, idx), _rows(c.y_train, idx)
        else:
            x, y = c.x_train, c.y_train
        total, correct = self._sums(self.model, x, y)
        return total / len(y), 100.0 * correct / len(y)

    @staticmethod
    @torch.no_grad()
    def _sums(model: nn.Module, x: torch.Tensor | DiskRows, y: torch.Tensor) -> tuple[float, int]:
        """Summed cross-entropy and number of correct predictions over (x, y) in EVAL_BATCH slices (read from disk
        chunk by chunk for an on-disk client), accumulated on the device (float64 in slice order: the same number as
        adding each slice's float on the host) and read once."""
        total = torch.zeros((), dtype=torch.float64, device=y.device)
        correct = torch.zeros((), dtype=torch.int64, device=y.device)
        chunks: Iterator[torch.Tensor] = row_chunks(x, EVAL_BATCH)
        for start, xs in zip(range(0, len(y), EVAL_BATCH), chunks, strict=True):
            logits = model(xs)
            total += F.cross_entropy(logits, y[start : start + EVAL_BATCH], reduction="sum")
            correct += (logits.argmax(dim=1) == y[start : start + EVAL_BATCH]).sum()
        return float(total), int(correct)


class _Hooks:
    """The pieces that override each per-step hook, so the loop calls only those (in the pieces' order)."""

    def __init__(self, pieces: list[LocalProcedure]) -> None:
        def overriding(hook: str) -> list[LocalProcedure]:
            return [p for p in pieces if getattr(type(p), hook) is not getattr(LocalProcedure, hook)]

        owners = _owners(pieces)
        self.draw_batch = [p for p in owners if type(p).draw_batch is not LoopOwner.draw_batch]
        self.gradient = owners[0] if owners else None
        self.wants_features = overriding("wants_features")
        self.after_forward = overriding("after_forward")
        self.objective = overriding("objective")
        self.after_backward = overriding("after_backward")
        self.step_lr = overriding("step_lr")
        self.after_step = overriding("after_step")


def _owners(pieces: list[LocalProcedure]) -> list[LoopOwner]:
    """The task's gradient owner (built-in, internal hooks: see client_agent.pieces.LoopOwner), if any."""
    owners = [p for p in pieces if isinstance(p, LoopOwner)]
    if len(owners) > 1 or (owners and len(pieces) > 1):
        raise ValueError(f"a task's {type(owners[0]).__name__} runs alone; got {len(pieces)} pieces")
    return owners


def _telemetry(cfg: federation_pb2.LocalTrainingConfig, pieces: list[LocalProcedure]) -> Telemetry:
    """Which of the loop's noiseless measurements leave: the gradient owner's choice, else all unless skip_losses."""
    owners = _owners(pieces)
    return owners[0].telemetry(cfg) if owners else Telemetry(losses=not cfg.skip_losses)


def _drawn_batch(state: LocalState, hooks: _Hooks) -> torch.Tensor | None:
    """This step's indices from the first piece that draws them, or None for the loop's shuffled epochs."""
    for p in hooks.draw_batch:
        idx = p.draw_batch(state)
        if idx is not None:
            return idx
    return None


def _step(state: LocalState, hooks: _Hooks) -> tuple[torch.Tensor, int]:
    """One local step on state's batch (the gradient, its rewrites, step size, optimiser step), calling the pieces'
    hooks at their points; (the step's training loss, how many it counts: 1 for a batch mean)."""
    opt = state.optimizer
    if hooks.gradient is not None:
        loss, count = hooks.gradient.gradient(state)
    else:
        loss, count = _backward(state, hooks), 1
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
    return loss, count


def _backward(state: LocalState, hooks: _Hooks) -> torch.Tensor:
    """The loop's own gradient: forward, objective, backward into p.grad; the batch's cross-entropy."""
    if any(p.wants_features(state) for p in hooks.wants_features):
        state.features, state.logits = state.forward_with_features(state.inputs)
    else:
        state.features, state.logits = None, state.model(state.inputs)
    for p in hooks.after_forward:
        p.after_forward(state)
    loss = state.loss = F.cross_entropy(state.logits, state.targets)
    objective = loss
    for p in hooks.objective:
        objective = p.objective(state, objective)
    for p in state.params:  # to None: backward then writes the gradient instead of adding it to zeros
        p.grad = None
    objective.backward()
    return loss


def _local_steps(cfg: federation_pb2.LocalTrainingConfig, n: int, batch: int) -> int:
    if cfg.WhichOneof("budget") == "local_steps":
        return cfg.local_steps
    return cfg.local_epochs * math.ceil(n / batch)


def _rows(x: torch.Tensor | DiskRows, idx: torch.Tensor) -> torch.Tensor:
    """x[idx] for a 1-D index tensor: index_select on a tensor (the same rows, without advanced indexing's
    overhead), a read from disk for DiskRows."""
    return x.index_select(0, idx) if isinstance(x, torch.Tensor) else x[idx]


class PlainSgd:
    """torch.optim.SGD's update without its per-step machinery (profiler hooks, grouping, state dicts): the same
    arithmetic on the same tensors in the same order, so a run trains bit for bit as with torch.optim.SGD.

    The update is torch.optim.SGD's foreach one (its default on CUDA): torch._foreach_* ops, which on the CPU run
    each tensor's own op, exactly torch.optim.SGD's per-tensor path there (its default on the CPU). Parameters
    without a gradient are skipped, and a momentum buffer starts as a copy of the first gradient it sees, as there.
    One instance serves every task of a runtime: `reset` puts it in a new optimiser's state, and the buffers'
    memory is reused. The surface the loop's pieces use is torch.optim's: param_groups (one group; "lr" may be
    changed between steps), step() and zero_grad().
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 0.0,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        self.params = list(params)
        self.param_groups: list[dict[str, Any]] = [{"params": self.params}]
        self._buffers: list[torch.Tensor | None] = [None] * len(self.params)  # memory, kept across tasks
        self._live = [False] * len(self.params)  # whether a buffer holds this task's momentum
        self.reset(lr, momentum, dampening, weight_decay, nesterov)

    def reset(
        self,
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        """The state of a new torch.optim.SGD with these settings: no momentum yet."""
        if not (lr >= 0 and momentum >= 0 and weight_decay >= 0):  # NaN too
            raise ValueError(f"invalid SGD settings: lr={lr}, momentum={momentum}, weight_decay={weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        group = self.param_groups[0]
        group.update(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov)
        self._live = [False] * len(self.params)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:  # as torch.optim's zero_grad(set_to_none=False)
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group = self.param_groups[0]
        lr, momentum, weight_decay = group["lr"], group["momentum"], group["weight_decay"]
        stepped = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not stepped:
            return loss
        params = [self.params[i] for i in stepped]
        grads: list[torch.Tensor] = [p.grad for p in params]  # type: ignore[misc]
        if weight_decay != 0:
            grads = list(torch._foreach_add(grads, params, alpha=weight_decay))
        if momentum != 0:
            grads = self._momentum(stepped, grads, momentum, group["dampening"], group["nesterov"])
        torch._foreach_add_(params, grads, alpha=-lr)
        return loss

    def _momentum(
        self, stepped: list[int], grads: list[torch.Tensor], momentum: float, dampening: float, nesterov: bool
    ) -> list[torch.Tensor]:
        """buf ← momentum·buf + (1 − dampening)·grad (a copy of grad on its first step); the step's direction."""
        live = [self._live[i] for i in stepped]
        if all(live):
            bufs: list[torch.Tensor] = [self._buffers[i] for i in stepped]  # type: ignore[misc]
            torch._foreach_mul_(bufs, momentum)
            torch._foreach_add_(bufs, grads, alpha=1 - dampening)
        else:
            bufs = []
            for i, grad, was_live in zip(stepped, grads, live, strict=True):
                buf = self._buffers[i]
                if was_live:
                    assert buf is not None
                    buf.mul_(momentum).add_(grad, alpha=1 - dampening)
                else:
                    if buf is None or buf.shape != grad.shape or buf.dtype != grad.dtype or buf.device != grad.device:
                        buf = self._buffers[i] = torch.empty_like(grad)
                    buf.copy_(grad)
                    self._live[i] = True
                bufs.append(buf)
        if nesterov:
            return list(torch._foreach_add(grads, bufs, alpha=momentum))
        return bufs
