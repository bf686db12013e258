"""HiCS-FL's client signature, from the real trainer: the output-bias update Δb and the entropy estimate built on it.

Identities from seed-hicsfl.md §5: under SGD (plain, momentum, FedProx) the components of Δb sum to zero (every step
is a combination of zero-sum vectors softmax − onehot); from a zero output layer one full-batch step gives exactly
Δb = η(D̂ − 1/C); a balanced client's Ĥ exceeds an extremely imbalanced one's.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from client_agent.trainer import ClientRuntime
from clustering_service.samplers.hierarchy import entropy_estimate
from fairfl.config import experiment_from_dict
from fairfl.data.datasets import ArrayDataset
from fairfl.data.federated import FederatedData
from fairfl.params import flatten_parameters
from fairfl.protocol import TRAIN
from fairfl.v1 import federation_pb2, tensor_pb2

C = 10
DIM = 12


def _labels(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "balanced":
        return np.arange(n) % C
    if kind == "one_class":  # extremely imbalanced: 95% class 3
        y = np.full(n, 3)
        y[: n // 20] = rng.integers(0, C, n // 20)
        return y
    return rng.integers(0, C, n)


def _runtime(kinds: list[str], model: str = "mlp", n: int = 200) -> tuple[ClientRuntime, torch.Tensor]:
    """One logical client per entry of `kinds`, on learnable synthetic data (class-dependent means)."""
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((C, DIM)).astype(np.float32)
    ys = [_labels(k, n, rng) for k in kinds]
    y = np.concatenate(ys).astype(np.int64)
    x = (centres[y] + 0.5 * rng.standard_normal((y.size, DIM))).astype(np.float32)
    data = ArrayDataset(x, y, C, "toy")
    owners = np.split(np.arange(y.size), np.cumsum([len(v) for v in ys])[:-1])
    fed = FederatedData(data, data, owners, owners)
    config = experiment_from_dict(
        {
            "data": {"dataset": "synthetic", "num_clients": len(kinds)},
            "model": {"name": model, "params": {"hidden": [16]} if model == "mlp" else {}},
            "selection": {"clients_per_round": 1},
            "runtime": {"agents": 1},
        }
    )
    holder: dict[str, torch.Tensor] = {}
    runtime = ClientRuntime(config, fed, list(range(len(kinds))), torch.device("cpu"), lambda ref: holder["params"])
    params = flatten_parameters(runtime.model).clone()
    holder["params"] = params
    return runtime, params


def _train(runtime: ClientRuntime, client: int, **train: object) -> np.ndarray:
    cfg = federation_pb2.LocalTrainingConfig(want_bias_update=True, **train)  # type: ignore[arg-type]
    task = federation_pb2.Task(
        task_id=f"t{client}", run_id="r", round=1, phase=TRAIN, client_id=client, model=tensor_pb2.BlobRef(), seed=5
    )
    task.train.CopyFrom(cfg)
    result = runtime.run(task)
    assert result.bias_update is not None and result.bias_update.shape == (C,)
    return result.bias_update


SGD = federation_pb2.OPTIMIZER_SGD


@pytest.mark.parametrize(
    "train",
    [
        {"optimizer": SGD},
        {"optimizer": SGD, "momentum": 0.9},
        {"optimizer": SGD, "momentum": 0.9, "prox_mu": 0.5},
    ],
    ids=["sgd", "momentum", "fedprox"],
)
def test_bias_update_sums_to_zero_under_sgd_momentum_and_fedprox(train: dict[str, object]) -> None:
    runtime, _ = _runtime(["random"])
    db = _train(runtime, 0, local_steps=20, batch_size=32, lr=0.1, **train)
    assert np.abs(db).max() > 1e-3  # it moved
    assert abs(db.sum()) <= 1e-6 * np.abs(db).max() * C  # float32 round-off only


def test_bias_update_sum_is_not_zero_under_adam() -> None:
    # The identity is a property of SGD-type steps; Adam's per-coordinate scaling breaks it (spec §5.2), which shows
    # the check above can fail.
    runtime, _ = _runtime(["one_class"])
    db = _train(runtime, 0, local_steps=20, batch_size=32, lr=0.01, optimizer=federation_pb2.OPTIMIZER_ADAM)
    assert abs(db.sum()) > 1e-2 * np.abs(db).max()


@pytest.mark.parametrize("kind", ["balanced", "one_class", "random"])
def test_one_full_batch_step_from_a_zero_output_layer_is_eta_times_label_frequencies_minus_uniform(kind: str) -> None:
    runtime, params = _runtime([kind], n=150)
    with torch.no_grad():  # zero classifier: uniform predictions, E_i = 1/C (spec §5.3)
        runtime.model.classifier.weight.zero_()
        runtime.model.classifier.bias.zero_()
    params.copy_(flatten_parameters(runtime.model))
    lr = 0.05
    db = _train(runtime, 0, local_steps=1, batch_size=150, lr=lr, optimizer=SGD)
    y = runtime.clients[0].y_train.numpy()
    expected = lr * (np.bincount(y, minlength=C) / y.size - 1.0 / C)
    np.testing.assert_allclose(db, expected, atol=1e-8)
    absent = np.bincount(y, minlength=C) == 0
    np.testing.assert_allclose(db[absent], -lr / C, atol=1e-8)  # a class the client lacks gets exactly −η/C


def test_balanced_client_has_higher_entropy_estimate_than_an_extremely_imbalanced_one() -> None:
    runtime, _ = _runtime(["balanced", "one_class"], n=256)
    train = {"local_epochs": 2, "batch_size": 64, "lr": 0.001, "optimizer": SGD}  # the paper's FMNIST setup
    db = np.stack([_train(runtime, c, **train) for c in (0, 1)])
    h = entropy_estimate(db, temperature=0.0025)
    assert h[0] > h[1] + 0.5
    assert h[0] > 0.9 * math.log(C)  # nearly uniform softmax for the balanced client


def test_entropy_estimate_properties() -> None:
    rng = np.random.default_rng(1)
    db = rng.standard_normal((6, C)) * 0.01
    h = entropy_estimate(db, 0.0025)
    assert ((h >= 0) & (h <= math.log(C))).all()
    assert entropy_estimate(np.zeros((1, C)), 0.0025)[0] == pytest.approx(math.log(C))  # Ĥ(0) = ln C
    np.testing.assert_allclose(entropy_estimate(db + 3.0, 0.0025), h, atol=1e-9)  # invariant to Δb + c·1
    temps = [1e-4, 1e-3, 1e-2, 1e-1, 10.0]
    by_t = np.stack([entropy_estimate(db, t) for t in temps])
    assert (np.diff(by_t, axis=0) >= -1e-12).all()  # non-decreasing in T
    assert by_t[-1] == pytest.approx(np.full(6, math.log(C)), abs=1e-4)  # T → ∞: ln C
    assert entropy_estimate(db, 1e-9) == pytest.approx(np.zeros(6), abs=1e-6)  # T → 0: 0 (unique arg-max)
    assert np.isfinite(entropy_estimate(db * 1e6, 1e-6)).all()  # Δb/T in the 1e10s: no overflow
