"""The local-training loop's own SGD (client_agent.trainer.PlainSgd) is torch.optim.SGD's update bit for bit, and a
ClientRuntime keeps one model and one optimiser for every task: each task starts from a fresh optimiser's state
(no momentum carried over, the task's lr) without allocating one."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from client_agent.trainer import ClientRuntime, PlainSgd, _rows
from fairfl.config import experiment_from_dict
from fairfl.data import load_run_data
from fairfl.params import flatten_parameters, load_flat
from fairfl.procedure import LocalProcedure, LocalState, attach_procedure
from fairfl.protocol import UPDATE, ClientResult
from fairfl.v1 import federation_pb2, tensor_pb2

CPU = torch.device("cpu")
DEVICES = [CPU] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
SETTINGS = [
    {"momentum": 0.0, "weight_decay": 0.0},
    {"momentum": 0.9, "weight_decay": 0.0},
    {"momentum": 0.0, "weight_decay": 1e-3},
    {"momentum": 0.9, "weight_decay": 5e-4},
    {"momentum": 0.5, "weight_decay": 1e-2, "dampening": 0.3},
    {"momentum": 0.9, "weight_decay": 1e-3, "nesterov": True},
]


def _mlp(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 7), torch.nn.ReLU(), torch.nn.Linear(7, 4)).to(device)


def _backward(model: torch.nn.Module, step: int, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 9, generator=gen).to(device), torch.randint(0, 4, (16,), generator=gen).to(device)
    for p in model.parameters():
        p.grad = None
    F.cross_entropy(model(x), y).backward()


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_plain_sgd_steps_exactly_as_torch_optim_sgd(settings: dict[str, Any], device: torch.device) -> None:
    """Several steps, the step size changed between steps as a piece does; then, after reset, a second task starts
    without momentum exactly as a new torch.optim.SGD does."""
    ours, theirs = _mlp(device), _mlp(device)
    plain = PlainSgd(ours.parameters(), lr=0.1, **settings)
    for task in range(2):
        reference = torch.optim.SGD(theirs.parameters(), lr=0.1, **settings)
        if task:
            plain.reset(lr=0.1, **settings)
        for step in range(6):
            lr = 0.1 * (1 + step % 3)
            plain.param_groups[0]["lr"] = lr
            for group in reference.param_groups:
                group["lr"] = lr
            _backward(ours, 10 * task + step, device)
            _backward(theirs, 10 * task + step, device)
            plain.step()
            reference.step()
            for a, b in zip(_params(ours), _params(theirs), strict=True):
                assert torch.equal(a, b), (task, step)


def test_parameters_without_a_gradient_are_skipped_and_start_their_momentum_when_they_get_one() -> None:
    """As torch.optim.SGD: a parameter with grad None is not stepped, and its momentum buffer starts (a copy of the
    gradient) on the first step it has a gradient."""
    ours, theirs = _mlp(CPU), _mlp(CPU)
    plain = PlainSgd(ours.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    reference = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    for step in range(5):
        _backward(ours, step, CPU)
        _backward(theirs, step, CPU)
        if step < 2:  # the output layer's weight has no gradient for the first two steps
            ours[2].weight.grad = theirs[2].weight.grad = None
        plain.step()
        reference.step()
        for a, b in zip(_params(ours), _params(theirs), strict=True):
            assert torch.equal(a, b), step


def test_zero_grad_matches_torch_optim_and_bad_settings_are_refused() -> None:
    model = _mlp(CPU)
    plain = PlainSgd(model.parameters(), lr=0.1)
    _backward(model, 0, CPU)
    plain.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    plain.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    for bad in ({"lr": -0.1}, {"lr": float("nan")}, {"lr": 0.1, "momentum": -0.5}, {"lr": 0.1, "weight_decay": -1.0}):
        with pytest.raises(ValueError, match="invalid SGD settings"):
            plain.reset(**bad)
    with pytest.raises(ValueError, match="Nesterov momentum requires"):
        plain.reset(lr=0.1, nesterov=True)


def test_rows_gathers_what_advanced_indexing_gathers() -> None:
    x = torch.randn(40, 3, 5)
    idx = torch.randperm(40)[:17]
    assert torch.equal(_rows(x, idx), x[idx])


def test_load_flat_takes_a_parameter_list_and_checks_the_size() -> None:
    model = _mlp(CPU)
    flat = torch.randn(sum(p.numel() for p in model.parameters()))
    load_flat(list(model.parameters()), flat)
    assert torch.equal(flatten_parameters(model), flat)
    with pytest.raises(ValueError, match="the model needs"):
        load_flat(model, flat[:-1])


# -- the runtime: one model and one optimiser for every task ---------------------------------------------------------


class Seen(LocalProcedure):
    """Records the model and optimiser each task's loop runs with, and sets a step size (a later task must not
    inherit it)."""

    seen: list[tuple[int, int]] = []  # noqa: RUF012 (the test reads what every instance saw)

    def begin(self, state: LocalState) -> None:
        Seen.seen.append((id(state.model), id(state.optimizer)))

    def step_lr(self, state: LocalState, loss: torch.Tensor) -> float | None:
        return 0.5


def _runtime() -> tuple[ClientRuntime, dict[str, torch.Tensor]]:
    config = experiment_from_dict(
        {
            "data": {"dataset": "synthetic", "num_clients": 3},
            "model": {"params": {"hidden": [16, 8]}},
            "selection": {"clients_per_round": 2},
            "runtime": {"agents": 1},
        }
    )
    blobs: dict[str, torch.Tensor] = {}
    runtime = ClientRuntime(config, load_run_data(config), [0, 1, 2], CPU, lambda ref: blobs[ref.sha256])
    blobs["x0"] = flatten_parameters(runtime.model)
    return runtime, blobs


def _task(client: int, seed: int, **train: Any) -> federation_pb2.Task:
    task = federation_pb2.Task(
        task_id=f"t{client}-{seed}",
        run_id="r",
        round=1,
        phase=federation_pb2.PHASE_TRAIN,
        client_id=client,
        seed=seed,
        model=tensor_pb2.BlobRef(sha256="x0"),
    )
    task.train.CopyFrom(federation_pb2.LocalTrainingConfig(local_steps=7, batch_size=8, skip_losses=True, **train))
    return task


OPTIMIZERS = [
    {"optimizer": federation_pb2.OPTIMIZER_SGD, "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3},
    {"optimizer": federation_pb2.OPTIMIZER_ADAM, "lr": 0.01, "weight_decay": 1e-3},
]


@pytest.mark.parametrize("train", OPTIMIZERS, ids=["sgd", "adam"])
def test_a_task_trains_as_on_a_fresh_runtime_whatever_ran_before(train: dict[str, Any]) -> None:
    """Momentum or moment estimates and a piece's step size do not leak from one task into the next."""
    runtime, _ = _runtime()
    first = _task(0, seed=1, **train)
    attach_procedure(first.train, f"{__name__}:Seen")
    runtime.run(first)
    after_others = runtime.run(_task(1, seed=2, **train))
    fresh, _ = _runtime()
    alone = fresh.run(_task(1, seed=2, **train))
    assert torch.equal(after_others.payloads[UPDATE], alone.payloads[UPDATE])
    assert after_others.metrics["lr"] == alone.metrics["lr"] == train["lr"]
    assert torch.count_nonzero(alone.payloads[UPDATE]) > 0


def test_the_runtime_keeps_one_model_and_one_optimiser_for_every_task(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime, _ = _runtime()

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("a task built a torch.optim.SGD")

    monkeypatch.setattr(torch.optim, "SGD", refused)
    Seen.seen.clear()
    for client, seed in itertools.product(range(3), range(2)):
        task = _task(client, seed, optimizer=federation_pb2.OPTIMIZER_SGD, lr=0.1, momentum=0.9)
        attach_procedure(task.train, f"{__name__}:Seen")
        runtime.run(task)
    assert Seen.seen == [(id(runtime.model), id(runtime.sgd))] * 6


def test_sgd_with_momentum_and_weight_decay_trains_as_the_plain_torch_loop() -> None:
    """The runtime's update equals a plain loop's with torch.optim.SGD (the same batches), task after task."""
    runtime, blobs = _runtime()
    settings = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}
    model = copy.deepcopy(runtime.model)  # the same architecture, its own parameters
    for client in range(3):
        task = _task(client, seed=client + 4, optimizer=federation_pb2.OPTIMIZER_SGD, **settings)
        result: ClientResult = runtime.run(task)
        load_flat(model, blobs["x0"])
        opt = torch.optim.SGD(model.parameters(), **settings)
        c = runtime.clients[client]
        n, batch = len(c.y_train), 8
        gen = torch.Generator().manual_seed(task.seed)
        order, position = torch.empty(0, dtype=torch.long), 0
        model.train()
        for _ in range(task.train.local_steps):
            if position + batch > len(order):
                order, position = torch.randperm(n, generator=gen), 0
            idx = order[position : position + batch]
            position += batch
            loss = F.cross_entropy(model(c.x_train[idx]), c.y_train[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert torch.equal(result.payloads[UPDATE], flatten_parameters(model) - blobs["x0"])
