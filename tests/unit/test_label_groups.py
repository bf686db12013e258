"""Equitable-FL's partition (disjoint-label groups of unequal sizes), the ground-truth group ids every grouped
partition exposes, their config validation, and the engine reporting found clusters against them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aggregator_service.engine import RoundEngine
from fairfl.compose.compare import load_comparison
from fairfl.compose.inprocess import InProcessTransport
from fairfl.compose.local_privacy import LocalPrivacy
from fairfl.compose.local_selection import LocalClusterer, LocalSelector
from fairfl.compose.results import RunRecorder
from fairfl.config import ConfigError, experiment_from_dict, load_experiment
from fairfl.data import build_federated, client_groups, partition_label_groups
from fairfl.data.datasets import DatasetNotFoundError, load_dataset
from fairfl.v1 import control_pb2

LABELS = np.repeat(np.arange(10), 50)  # 50 samples of each of 10 classes


def test_label_groups_paper_layout() -> None:
    # The paper's MNIST layout, scaled: groups of 4 and 6 clients on classes 0-3 and 4-9, 8 samples per class.
    parts = partition_label_groups(LABELS, [4, 6], [4, 6], np.random.default_rng(0), samples_per_class=8)
    assert [len(p) for p in parts] == [32] * 4 + [48] * 6
    for client, part in enumerate(parts):
        expected = [0, 1, 2, 3] if client < 4 else [4, 5, 6, 7, 8, 9]
        assert np.unique(LABELS[part]).tolist() == expected
        assert (np.bincount(LABELS[part], minlength=10)[expected] == 8).all()  # 8 of each of its classes
        assert (np.diff(part) > 0).all()  # sorted, no repeats
    everything = np.concatenate(parts)
    assert np.unique(everything).size == everything.size  # disjoint across clients


def test_label_groups_default_splits_each_class_equally() -> None:
    parts = partition_label_groups(LABELS, [2, 3], [3, 2], np.random.default_rng(1))
    assert [len(p) for p in parts] == [75, 75, 34, 34, 32]  # classes 0-2 halved; classes 3-4 in 17 + 17 + 16
    assert np.unique(np.concatenate(parts)).size == 250  # every sample of the 5 used classes, once
    assert all(np.unique(LABELS[p]).tolist() == [3, 4] for p in parts[2:])


def test_label_groups_is_seeded() -> None:
    a = partition_label_groups(LABELS, [4, 6], [4, 6], np.random.default_rng(5), samples_per_class=8)
    b = partition_label_groups(LABELS, [4, 6], [4, 6], np.random.default_rng(5), samples_per_class=8)
    c = partition_label_groups(LABELS, [4, 6], [4, 6], np.random.default_rng(6), samples_per_class=8)
    assert all((x == y).all() for x, y in zip(a, b, strict=True))
    assert any((x != y).any() for x, y in zip(a, c, strict=True))


@pytest.mark.parametrize(
    ("sizes", "classes", "per_class", "match"),
    [
        ([4, 6], [4], None, "equal length"),
        ([4, 6], [5, 6], None, "ask for 11 classes, the dataset has 10"),
        ([4, 0], [4, 6], None, r"group_sizes\[1\] must be an integer >= 1"),
        ([4, 6], [4, 6], 9, "class 4 has 50 samples, 6 clients x samples_per_class=9 need 54"),
        ([60, 1], [1, 1], None, "class 0 has 50 samples for 60 clients"),
    ],
)
def test_label_groups_bad_input(sizes: list[int], classes: list[int], per_class: int | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        partition_label_groups(LABELS, sizes, classes, np.random.default_rng(0), samples_per_class=per_class)


def test_client_groups_are_contiguous_blocks_for_grouped_partitions_only() -> None:
    assert client_groups("label_groups", [4, 6]).tolist() == [0] * 4 + [1] * 6
    assert client_groups("label_groups", [2, 1, 3]).tolist() == [0, 0, 1, 2, 2, 2]
    assert client_groups("shards", [4, 6]) is None
    with pytest.raises(ValueError, match="group_sizes must be a non-empty list"):
        client_groups("label_groups", [])


def _grouped(**data: Any) -> dict[str, Any]:
    base = {"num_clients": 10, "partition": "label_groups", "group_sizes": [4, 6], "group_classes": [4, 6]}
    return {"data": {**base, **data}, "selection": {"clients_per_round": 4}}


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"group_sizes": [4, 5]}, r"data\.group_sizes: \[4, 5\] hold 9 clients, num_clients is 10"),
        ({"group_classes": [4]}, r"data\.group_classes: one class count per group, got 1 for 2 groups"),
        ({"group_classes": [5, 6]}, r"data\.group_classes: \[5, 6\] need 11 classes, fashion_mnist has 10"),
        ({"group_classes": [0, 6]}, r"data\.group_classes\[0\]: must be >= 1"),
        ({"samples_per_class": 0}, r"data\.samples_per_class: must be >= 1"),
        ({"group_sizes": [0, 10]}, r"data\.group_sizes\[0\]: must be >= 1"),
        ({"partition": "shards", "group_classes": []}, r"data\.group_sizes: only for grouped partitions"),
        ({"partition": "iid", "group_sizes": [], "group_classes": [4, 6]}, r"data\.group_classes: applies to"),
        ({"dataset": "synthetic"}, r"data\.partition: label_groups does not apply to synthetic"),
    ],
)
def test_grouped_config_errors_name_the_field(data: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        experiment_from_dict(_grouped(**data))


def _fashion_mnist() -> bool:
    try:
        load_dataset("fashion_mnist", "test")
    except DatasetNotFoundError:
        return False
    return True


needs_fmnist = pytest.mark.skipif(not _fashion_mnist(), reason="Fashion-MNIST is not installed (dataset-fashion-mnist)")


@needs_fmnist
def test_build_federated_paper_grouping_on_fashion_mnist() -> None:
    data = build_federated(
        "fashion_mnist", 10, "label_groups", 0, group_sizes=[4, 6], group_classes=[4, 6], samples_per_class=800
    )
    assert data.groups is not None and data.groups.tolist() == [0] * 4 + [1] * 6
    assert [len(i) for i in data.train_indices] == [3200] * 4 + [4800] * 6
    for client in range(10):
        train = np.flatnonzero(data.client_label_counts(client)).tolist()
        test = np.flatnonzero(data.client_label_counts(client, "test")).tolist()
        assert train == test == ([0, 1, 2, 3] if client < 4 else [4, 5, 6, 7, 8, 9])


@needs_fmnist
def test_engine_reports_found_clusters_and_nmi_against_true_groups() -> None:
    config = experiment_from_dict(
        {
            "seed": 4,
            "rounds": 2,
            "data": {
                "dataset": "fashion_mnist",
                "num_clients": 4,
                "partition": "label_groups",
                "group_sizes": [2, 2],
                "group_classes": [2, 3],
                "samples_per_class": 40,
                "test_per_client": 50,
            },
            "model": {"name": "mlp", "params": {"hidden": [32, 16]}},
            "training": {"local_epochs": 1, "batch_size": 20, "lr": 0.05},
            "strategy": {"name": "equitable"},
            "selection": {"clients_per_round": 4},
            "evaluation": {"every": 2},
        }
    )
    recorder = RunRecorder(config, quiet=True)
    selector, clusterer = LocalSelector("random"), LocalClusterer()
    engine = RoundEngine("g", config, InProcessTransport(), selector, LocalPrivacy(), recorder, clusterer=clusterer)
    assert engine.run().state == control_pb2.RUN_STATE_COMPLETED
    for event in recorder.rounds:
        assert [(c.client_id, c.true_group) for c in event.clusters] == [(0, 0), (1, 0), (2, 1), (3, 1)]
        metrics = {m.name: m.value for m in event.strategy_metrics}
        assert metrics["nmi"] == pytest.approx(1.0) and metrics["all_groups_present"] == 1.0
        assert [c.cluster for c in event.clusters] == [0, 0, 1, 1]  # the planted label groups, found
        assert list(event.aggregation_weights) == pytest.approx([0.25] * 4)
    summary = recorder.summary()
    assert summary["client_groups"] == [0, 0, 1, 1]
    assert summary["clustering"] == {"rounds": 2, "nmi_mean": 1.0, "rounds_all_groups": 2, "nmi_all_groups_mean": 1.0}


def test_presets_follow_the_papers_mnist_setup() -> None:
    here = Path(__file__).resolve().parents[2] / "experiments" / "equitable"
    cfg = load_experiment(here / "fmnist_mlp.yaml")
    d = cfg.data
    assert (d.dataset, d.num_clients, d.partition) == ("fashion_mnist", 10, "label_groups")
    assert (d.group_sizes, d.group_classes, d.samples_per_class) == ([4, 6], [4, 6], 800)
    assert cfg.selection.clients_per_round == 4 and cfg.training.budget() == ("local_epochs", 5)
    assert (cfg.model.name, cfg.model.params) == ("mlp", {"hidden": [200, 200]})
    assert (cfg.strategy.name, cfg.strategy.params) == ("equitable", {"num_clusters": 2, "mu": 0.01})
    spec = load_comparison(here / "fmnist.compare.yaml")
    assert spec.target_accuracy == 75.0 and spec.overrides == {"rounds": 250}  # the paper's length
    runs = {r.label: (spec.experiment(r, r.seeds[0]).strategy.name, r.seeds) for r in spec.runs}
    assert runs == {
        "Equitable-FL": ("equitable", [0, 1, 2, 3, 4]),
        "FedProx": ("fedprox", [0, 1, 2, 3, 4]),
        "FedProx + Cluster2": ("cluster2", [0]),
        "FedProx + FairFed": ("fairfed", [0, 1, 2, 3, 4]),  # the anchor "FairFed std above FedProx" is a claim
    }
