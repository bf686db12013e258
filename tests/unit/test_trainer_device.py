"""The device-aware path of the client runtime (pinned staging, a device copy of x_t per model version, losses summed
on the device) gives on the CPU exactly the numbers of the plain path it replaced: load_flat, flatten_parameters on
the host, float(loss) added every step. CUDA behaviour is in tests/integration/test_gpu.py."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from client_agent import dp_sgd, trainer
from client_agent.trainer import ClientRuntime
from fairfl.config import ExperimentConfig, experiment_from_dict
from fairfl.data import load_run_data
from fairfl.models import build_model
from fairfl.params import (
    DeviceCache,
    flatten_on_device,
    flatten_parameters,
    load_flat,
    synchronize,
    to_device,
    to_host,
)
from fairfl.protocol import UPDATE
from fairfl.v1 import federation_pb2, tensor_pb2

CPU = torch.device("cpu")
TRAIN = federation_pb2.PHASE_TRAIN


def small_config() -> ExperimentConfig:
    return experiment_from_dict(
        {
            "data": {"dataset": "synthetic", "num_clients": 4},
            "model": {"params": {"hidden": [24, 12]}},
            "selection": {"clients_per_round": 2},
            "runtime": {"agents": 1},
        }
    )


def runtime_with_blobs() -> tuple[ClientRuntime, dict[str, torch.Tensor]]:
    config = small_config()
    blobs: dict[str, torch.Tensor] = {}
    runtime = ClientRuntime(config, load_run_data(config), [0, 1, 2, 3], CPU, lambda ref: blobs[ref.sha256])
    blobs["x0"] = flatten_parameters(runtime.model)
    return runtime, blobs


def train_task(client: int, seed: int, model: str = "x0", **train: object) -> federation_pb2.Task:
    task = federation_pb2.Task(
        task_id=f"t{client}", run_id="r", round=1, phase=TRAIN, client_id=client, seed=seed, model=tensor_pb2.BlobRef()
    )
    task.model.sha256 = model
    task.train.CopyFrom(federation_pb2.LocalTrainingConfig(**train))  # type: ignore[arg-type]
    return task


# -- the helpers of fairfl.params on the CPU ---------------------------------------------------------------------------


def test_device_helpers_leave_cpu_tensors_alone() -> None:
    t = torch.arange(6, dtype=torch.float32)
    assert to_device(t, CPU) is t  # no staging copy on the CPU: the old path's tensor, so the old arithmetic
    assert to_host(t) is t
    synchronize(CPU)  # nothing queued: returns at once


def test_device_load_and_flatten_equal_the_host_path() -> None:
    torch.manual_seed(0)
    model = build_model("mlp", (5,), 3, hidden=(7,))
    flat = torch.randn(sum(p.numel() for p in model.parameters()))
    load_flat(model, to_device(flat, CPU))
    on_device = flatten_on_device(model)
    assert on_device.dtype == torch.float32
    assert torch.equal(on_device, flat)
    assert torch.equal(on_device, flatten_parameters(model))
    assert on_device.data_ptr() != flat.data_ptr()  # a copy: training must not write into the shared blob


def test_device_cache_places_each_version_once() -> None:
    cache = DeviceCache(CPU)
    x0, g = torch.zeros(4), torch.ones(4)
    assert cache.get("x0", x0) is x0 and cache.get("x0", x0) is x0
    assert cache.loads == 1  # several clients of one round: one placement
    cache.get("g", g)
    cache.get("x0", x0)
    assert cache.loads == 2  # both fit (capacity 2)
    x0.add_(1.0)  # rewritten in place under the same name: a new version
    assert cache.get("x0", x0) is x0
    assert cache.loads == 3
    other = x0.clone()  # another tensor under the same name is not trusted to hold the same values
    assert cache.get("x0", other) is other
    assert cache.loads == 4
    cache.get("a", torch.zeros(1))
    cache.get("b", torch.zeros(1))
    cache.get("x0", other)  # evicted by the two newer entries
    assert cache.loads == 7
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        DeviceCache(CPU, capacity=0)


# -- the runtime ---------------------------------------------------------------------------------------------------


def test_runtime_places_the_global_model_once_per_round() -> None:
    runtime, blobs = runtime_with_blobs()
    for client in range(3):
        runtime.run(train_task(client, seed=client, local_steps=2, batch_size=8, lr=0.05))
    assert runtime.resident.loads == 1
    evaluate = federation_pb2.Task(task_id="e", run_id="r", round=1, phase=federation_pb2.PHASE_EVALUATE, client_id=3)
    evaluate.model.sha256 = "x0"
    evaluate.evaluate.SetInParent()
    runtime.run(evaluate)
    assert runtime.resident.loads == 1  # evaluation of the same model: still the one copy
    blobs["x1"] = blobs["x0"] + 0.01
    runtime.run(train_task(0, seed=9, model="x1", local_steps=2, batch_size=8, lr=0.05))
    assert runtime.resident.loads == 2


def plain_loop(
    runtime: ClientRuntime, task: federation_pb2.Task, x0: torch.Tensor
) -> tuple[torch.Tensor, float, float, float, float]:
    """The host path as it was: load_flat, CPU index batches, float(loss) summed every step, the update from
    flatten_parameters, and F_i summed slice by slice as host floats. Returns (update, train_loss, loss_before,
    accuracy_before, loss_after)."""
    cfg = task.train
    c = runtime.clients[task.client_id]
    model = copy.deepcopy(runtime.model)  # same architecture; its parameters are overwritten next
    load_flat(model, x0)

    def loss_and_accuracy() -> tuple[float, float]:
        model.eval()
        total, correct = 0.0, 0
        with torch.no_grad():
            for start in range(0, len(c.y_train), trainer.EVAL_BATCH):
                logits = model(c.x_train[start : start + trainer.EVAL_BATCH])
                y = c.y_train[start : start + trainer.EVAL_BATCH]
                total += float(F.cross_entropy(logits, y, reduction="sum"))
                correct += int((logits.argmax(dim=1) == y).sum())
        return total / len(c.y_train), 100.0 * correct / len(c.y_train)

    loss_before, accuracy_before = loss_and_accuracy()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    gen = torch.Generator().manual_seed(task.seed)
    n, batch = len(c.y_train), min(cfg.batch_size, len(c.y_train))
    order, position, loss_sum = torch.empty(0, dtype=torch.long), 0, 0.0
    model.train()
    for _ in range(cfg.local_steps):
        if position + batch > len(order):
            order, position = torch.randperm(n, generator=gen), 0
        idx = order[position : position + batch]
        position += batch
        loss = F.cross_entropy(model(c.x_train[idx]), c.y_train[idx])
        if cfg.HasField("fair_step"):
            fair = cfg.fair_step
            step_lr = cfg.lr * max(0.0, 1.0 + fair.fair_lambda * (float(loss.detach()) - fair.global_loss))
            for group in opt.param_groups:
                group["lr"] = step_lr
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        loss_sum += float(loss.detach())
    update = flatten_parameters(model) - x0
    return update, loss_sum / cfg.local_steps, loss_before, accuracy_before, loss_and_accuracy()[0]


@pytest.mark.parametrize("fair", [False, True], ids=["sgd", "fedfair_step"])
def test_cpu_training_equals_the_plain_host_loop_bit_for_bit(fair: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trainer, "EVAL_BATCH", 7)  # several slices, so the summation order is exercised
    runtime, blobs = runtime_with_blobs()
    extra = {"fair_step": federation_pb2.FairStep(global_loss=1.0, fair_lambda=0.5)} if fair else {}
    task = train_task(1, seed=3, local_steps=23, batch_size=10, lr=0.05, momentum=0.5, **extra)  # 23 steps: epochs
    result = runtime.run(task)
    update, train_loss, loss_before, accuracy_before, loss_after = plain_loop(runtime, task, blobs["x0"])
    assert result.payloads[UPDATE].device.type == "cpu"
    assert torch.equal(result.payloads[UPDATE], update)
    assert result.metrics["train_loss"] == train_loss
    assert result.loss_before == loss_before
    assert result.metrics["accuracy_before"] == accuracy_before
    assert result.loss_after == loss_after
    assert torch.count_nonzero(update) > 0  # it trained


def test_skipping_the_loss_passes_changes_nothing_but_the_losses() -> None:
    runtime, _ = runtime_with_blobs()
    measured = runtime.run(train_task(2, seed=4, local_steps=5, batch_size=6, lr=0.05, loss_eval_batches=1))
    skipped = runtime.run(
        train_task(2, seed=4, local_steps=5, batch_size=6, lr=0.05, loss_eval_batches=1, skip_losses=True)
    )
    assert torch.equal(skipped.payloads[UPDATE], measured.payloads[UPDATE])
    assert skipped.metrics["train_loss"] == measured.metrics["train_loss"]
    assert math.isnan(skipped.loss_before) and math.isnan(skipped.loss_after)  # withheld, as check_result reads NaN
    assert "accuracy_before" not in skipped.metrics
    assert math.isfinite(measured.loss_before) and math.isfinite(measured.loss_after)


def test_evaluation_on_the_cpu_equals_host_sums_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trainer, "EVAL_BATCH", 3)
    runtime, _ = runtime_with_blobs()
    task = federation_pb2.Task(task_id="e", run_id="r", round=1, phase=federation_pb2.PHASE_EVALUATE, client_id=2)
    task.model.sha256 = "x0"
    task.evaluate.SetInParent()
    result = runtime.run(task)
    c = runtime.clients[2]
    total, correct = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(c.y_test), 3):
            logits = runtime.model(c.x_test[start : start + 3])
            total += float(F.cross_entropy(logits, c.y_test[start : start + 3], reduction="sum"))
            correct += int((logits.argmax(dim=1) == c.y_test[start : start + 3]).sum())
    assert len(c.y_test) > 3
    assert result.test_loss == total / len(c.y_test)
    assert result.test_accuracy == 100.0 * correct / len(c.y_test)


def test_dp_loss_sum_accumulated_on_the_device_equals_host_floats() -> None:
    torch.manual_seed(0)
    model = build_model("mlp", (6,), 4, hidden=(8,))
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(30, 6, generator=g), torch.randint(0, 4, (30,), generator=g)
    clipped = dp_sgd.clipped_gradient_sum(model, x, y, clip_norm=1.0, chunk=7, method="layerwise")
    expected = 0.0
    with torch.no_grad():
        for start in range(0, 30, 7):  # the layerwise path's chunks, each summed as float32 then added as a float
            expected += float(
                F.cross_entropy(model(x[start : start + 7]), y[start : start + 7], reduction="none").sum()
            )
    assert clipped.loss_total.dtype == torch.float64
    assert clipped.loss_sum == expected
