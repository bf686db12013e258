"""Dataset plug-ins: a Dataset and a DataProvider by `module:attr` and by registered name, their declared signature
and parameters, capability checks instead of name checks, and each way a plug-in can be wrong failing at config load
with an error naming the field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from fairfl.config import ConfigError, ExperimentConfig, experiment_from_dict
from fairfl.data import (
    DATASETS,
    ArrayDataset,
    DataProvider,
    DataRequest,
    Dataset,
    DataSignature,
    FederatedData,
    load_run_data,
    run_signature,
    synthetic_leaf,
)
from fairfl.models import build_run_model

HERE = __name__


# --- plug-ins defined outside the package ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BlobParams:
    samples: int = 120
    spread: float = 0.5

    def validate(self, path: str) -> None:
        if self.samples < 3:
            raise ConfigError(f"{path}.samples: must be >= 3, got {self.samples}")


class Blobs(Dataset):
    """A central dataset: three Gaussian blobs in 5 dimensions, the same arrays for the same parameters."""

    Params = BlobParams

    def signature(self, params: BlobParams) -> DataSignature:
        return DataSignature((5,), 3, tuple(f"f{i}" for i in range(5)))

    def load(self, split: str, params: BlobParams, request: DataRequest) -> ArrayDataset:
        rng = np.random.default_rng(0 if split == "train" else 1)
        n = params.samples if split == "train" else params.samples // 3
        y = np.arange(n, dtype=np.int64) % 3
        x = (y[:, None] + params.spread * rng.standard_normal((n, 5))).astype(np.float32)
        return ArrayDataset(x, y, 3, f"blobs-{split}")


class Sites(DataProvider):
    """A data provider: every client's data is its own (here: client k holds only label k % 2)."""

    def signature(self, params: Any) -> DataSignature:
        return DataSignature((2,), 2)

    def clients(self, params: Any, request: DataRequest) -> FederatedData:
        n = 10
        y = np.repeat(np.arange(request.num_clients) % 2, n).astype(np.int64)
        x = np.random.default_rng(request.seed).standard_normal((y.size, 2)).astype(np.float32)
        data = ArrayDataset(x, y, 2, "sites")
        owners = [np.arange(k * n, (k + 1) * n) for k in range(request.num_clients)]
        return FederatedData(data, data, owners, owners)


class LiesAboutItsShape(Blobs):
    def signature(self, params: BlobParams) -> DataSignature:
        return DataSignature((6,), 3)


class NeedsArguments(Blobs):
    def __init__(self, path: str) -> None:
        self.path = path


def not_a_dataset() -> None:
    return None


def config(data: dict[str, Any], model: str = "logreg") -> ExperimentConfig:
    return experiment_from_dict(
        {
            "data": {"num_clients": 4, **data},
            "model": {"name": model},
            "selection": {"clients_per_round": 2},
            "runtime": {"agents": 1},
        }
    )


def error_of(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        config(data)
    return str(info.value)


# --- datasets and providers -----------------------------------------------------------------------------------------


def test_dataset_by_module_attr_is_partitioned_by_the_run() -> None:
    cfg = config({"dataset": f"{HERE}:Blobs", "params": {"samples": 60}, "partition": "iid"})
    assert run_signature(cfg) == DataSignature((5,), 3, ("f0", "f1", "f2", "f3", "f4"))
    data = load_run_data(cfg)
    assert data.num_clients == 4 and data.input_shape == (5,) and data.num_classes == 3
    assert sorted(np.concatenate(data.train_indices).tolist()) == list(range(60))  # iid: a disjoint cover
    assert sum(len(t) for t in data.test_indices) == 20  # default: len(test) // num_clients each
    again = load_run_data(cfg)
    for a, b in zip(data.train_indices, again.train_indices, strict=True):
        np.testing.assert_array_equal(a, b)
    model = build_run_model(cfg)  # the model factory gets the plug-in's signature
    assert model.classifier.in_features == 5 and model.classifier.out_features == 3


def test_dataset_by_registered_name_as_an_instance() -> None:
    DATASETS.register("blobs_test", Blobs())
    try:
        data = load_run_data(config({"dataset": "blobs_test", "partition": "shards", "shards_per_client": 1}))
        assert data.train.name == "blobs-train" and len(data.train) == 120
    finally:
        DATASETS.unregister("blobs_test")
    assert error_of({"dataset": "blobs_test"}).startswith("data.dataset: unknown dataset 'blobs_test'")


def test_data_provider_builds_its_clients_itself() -> None:
    cfg = config({"dataset": f"{HERE}:Sites"})
    data = load_run_data(cfg)
    assert [int(data.client_label_counts(k).argmax()) for k in range(4)] == [0, 1, 0, 1]
    assert run_signature(cfg) == DataSignature((2,), 2)


def test_builtins_are_entry_points() -> None:
    import fairfl.data.datasets as datasets
    import fairfl.data.synthetic as synthetic

    assert {"fashion_mnist", "mnist", "cifar10", "synthetic"} <= set(DATASETS.names())
    assert DATASETS.load("synthetic", "data.dataset") is synthetic.SYNTHETIC
    assert DATASETS.load("cifar10", "data.dataset") is datasets.CIFAR10
    assert run_signature(config({"dataset": "cifar10"})) == DataSignature((3, 32, 32), 10)
    assert run_signature(config({"dataset": "mnist"})) == DataSignature((1, 28, 28), 10)


def test_synthetic_params_give_the_same_data_as_before() -> None:
    cfg = config({"dataset": "synthetic", "params": {"alpha": 0.5, "beta": 0.0}})
    data = load_run_data(cfg)
    train, test, train_idx, test_idx = synthetic_leaf(0.5, 0.0, 4, cfg.seed)  # what synthetic_alpha/beta gave
    np.testing.assert_array_equal(data.train.x, train.x)
    np.testing.assert_array_equal(data.test.y, test.y)
    for a, b in zip(data.train_indices + data.test_indices, train_idx + test_idx, strict=True):
        np.testing.assert_array_equal(a, b)


# --- capabilities, not names ----------------------------------------------------------------------------------------


def test_partition_settings_refused_for_a_provider() -> None:
    grouped = {"partition": "label_groups", "group_sizes": [2, 2], "group_classes": [1, 1]}
    assert error_of({"dataset": f"{HERE}:Sites", **grouped}).startswith(
        f"data.partition: label_groups does not apply to {HERE}:Sites (it builds its clients' data itself)"
    )
    assert error_of({"dataset": f"{HERE}:Sites", "test_split": "iid"}).startswith("data.test_split: iid does not")
    assert config({"dataset": f"{HERE}:Blobs", **grouped}).data.partition == "label_groups"


def test_label_groups_checked_against_the_declared_classes() -> None:
    message = error_of(
        {"dataset": f"{HERE}:Blobs", "partition": "label_groups", "group_sizes": [2, 2], "group_classes": [2, 2]}
    )
    assert message.startswith("data.group_classes: [2, 2] need 4 classes"), message
    assert message.endswith("has 3")


# --- errors, each naming the field ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "start", "reason"),
    [
        ({"dataset": "no_such_pkg_xyz.data:Files"}, "data.dataset:", "cannot import module 'no_such_pkg_xyz.data'"),
        ({"dataset": f"{HERE}:Missing"}, "data.dataset:", "has no attribute 'Missing'"),
        ({"dataset": f"{HERE}:not_a_dataset"}, "data.dataset:", "is not a dataset: expected a fairfl.data Dataset"),
        ({"dataset": f"{HERE}:NeedsArguments"}, "data.dataset:", "cannot instantiate dataset class NeedsArguments"),
        ({"dataset": "imagenet"}, "data.dataset:", "unknown dataset 'imagenet'; available: cifar10, fashion_mnist"),
        ({"dataset": f"{HERE}:Blobs", "params": {"classes": 4}}, "data.params:", "unknown parameter 'classes'"),
        ({"dataset": f"{HERE}:Blobs", "params": {"samples": "many"}}, "data.params.samples:", "expected an integer"),
        ({"dataset": f"{HERE}:Blobs", "params": {"samples": 2}}, "data.params.samples:", "must be >= 3"),
        ({"dataset": f"{HERE}:Sites", "params": {"x": 1}}, "data.params:", "valid parameters: none"),
        ({"dataset": "synthetic", "params": {"alpha": -1.0}}, "data.params.alpha:", "must be >= 0"),
        ({"dataset": "synthetic", "synthetic_alpha": 0.5}, "data.synthetic_alpha:", "moved to data.params.alpha"),
    ],
)
def test_bad_dataset_plugin_fails_at_config_load(data: dict[str, Any], start: str, reason: str) -> None:
    message = error_of(data)
    assert message.startswith(start), message
    assert reason in message, message


def test_data_that_contradicts_the_declared_signature_is_refused() -> None:
    cfg = config({"dataset": f"{HERE}:LiesAboutItsShape", "partition": "iid"})
    with pytest.raises(ConfigError, match=r"^data\.dataset: LiesAboutItsShape declares input_shape \(6,\)"):
        load_run_data(cfg)
