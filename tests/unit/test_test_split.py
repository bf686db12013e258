"""data.test_split: `iid` gives every client a disjoint random slice of the official test set, so the mean client
accuracy equals the global model's accuracy on the whole test set (HiCS-FL's metric); `follow_train` is unchanged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fairfl.config import ConfigError, experiment_from_dict
from fairfl.data import build_federated
from fairfl.data.datasets import clear_cache
from tests.unit.test_data import write_idx_dataset


@pytest.fixture(autouse=True)
def _fresh_cache() -> None:
    clear_cache()


def test_iid_test_split_partitions_the_whole_test_set(tmp_path: Path) -> None:
    write_idx_dataset(tmp_path, n_train=200, n_test=50)
    # One class per client in training (shards of a label-sorted set): follow_train would give single-class tests.
    fd = build_federated("fashion_mnist", 10, "shards", seed=3, root=str(tmp_path), shards_per_client=1, min_size=5)
    assert all(np.count_nonzero(fd.client_label_counts(c)) == 1 for c in range(10))
    iid = build_federated(
        "fashion_mnist", 10, "shards", seed=3, root=str(tmp_path), shards_per_client=1, min_size=5, test_split="iid"
    )
    joined = np.concatenate(iid.test_indices)
    np.testing.assert_array_equal(np.sort(joined), np.arange(50))  # disjoint, and together the whole test set
    # Training split untouched; several clients now test on classes they never trained on.
    for a, b in zip(fd.train_indices, iid.train_indices, strict=True):
        np.testing.assert_array_equal(a, b)
    assert sum(np.count_nonzero(iid.client_label_counts(c, "test")) > 1 for c in range(10)) >= 5


def test_iid_test_split_refuses_overlapping_sizes_and_unknown_names(tmp_path: Path) -> None:
    write_idx_dataset(tmp_path, n_train=200, n_test=50)
    with pytest.raises(ValueError, match="exceed the 50-sample test set"):
        build_federated("fashion_mnist", 10, "iid", seed=0, root=str(tmp_path), test_per_client=6, test_split="iid")
    with pytest.raises(ValueError, match="unknown test_split 'balanced'"):
        build_federated("fashion_mnist", 10, "iid", seed=0, root=str(tmp_path), test_split="balanced")


def test_test_split_config_is_validated() -> None:
    assert experiment_from_dict({"data": {"test_split": "iid"}}).data.test_split == "iid"
    assert experiment_from_dict({}).data.test_split == "follow_train"
    with pytest.raises(ConfigError, match=r"data\.test_split"):
        experiment_from_dict({"data": {"test_split": "balanced"}})
    with pytest.raises(ConfigError, match=r"data\.test_split: iid does not apply to synthetic"):
        experiment_from_dict({"data": {"dataset": "synthetic", "test_split": "iid"}})
