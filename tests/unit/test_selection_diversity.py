"""scripts/selection_diversity.py's metrics on hand-made selections and label histograms (no data, no training)."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import runlib
import selection_diversity as sd

from fairfl.config import DataConfig, ModelConfig

# Four clients, three classes: clients 0-2 single-class (classes 0, 1, 2), client 3 an even mix of all three.
H = np.array([[100, 0, 0], [0, 100, 0], [0, 0, 100], [30, 30, 30]])
GROUPS = np.array([0, 0, 0, 1])


def test_selection_matrix_marks_each_rounds_clients() -> None:
    s = sd.selection_matrix([[0, 2], [1, 2], [2, 3]], 4)
    assert s.tolist() == [[1, 0, 1, 0], [0, 1, 1, 0], [0, 0, 1, 1]]


def test_gini_and_top_share_known_values() -> None:
    assert sd.gini(np.array([5, 5, 5, 5])) == pytest.approx(0.0)
    assert sd.gini(np.array([0, 0, 0, 8])) == pytest.approx(3 / 4)  # (n - 1) / n: one client takes everything
    # Pairwise definition: sum |x_i - x_j| / (2 n^2 mean) for [1, 2, 3, 4]: 20 / (2 * 16 * 2.5) = 0.25.
    assert sd.gini(np.array([4, 1, 3, 2])) == pytest.approx(0.25)
    assert sd.gini(np.zeros(3)) == 0.0
    assert sd.top_share(np.array([6, 1, 2, 1]), 1) == pytest.approx(0.6)
    assert sd.top_share(np.array([6, 1, 2, 1]), 2) == pytest.approx(0.8)


def test_entropy_and_total_variation() -> None:
    assert sd.entropy_bits(np.array([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])).tolist() == pytest.approx([1.0, 0.0])
    assert sd.entropy_bits(np.full(4, 0.25)) == pytest.approx(2.0)
    assert sd.total_variation(np.array([10, 0]), np.array([0, 3])) == pytest.approx(1.0)
    assert sd.total_variation(np.array([2, 2]), np.array([5, 5])) == pytest.approx(0.0)
    assert sd.total_variation(np.array([3, 1]), np.array([1, 1])) == pytest.approx(0.25)


def test_diversity_of_a_collapsed_selection() -> None:
    """Every round picks client 0 (class 0 only): one distinct client, one class per round, entropy 0."""
    d = sd.diversity([[0], [0], [0]], H, GROUPS, top=2)
    assert (d.rounds, d.selections, d.distinct_clients) == (3, 3, 1)
    assert d.top5_share == d.top10_share == 1.0
    assert d.gini == pytest.approx(3 / 4)
    assert d.union_classes == d.client_classes == 1.0
    assert d.union_entropy_bits == pytest.approx(0.0)
    assert d.top_class_share == pytest.approx(1.0)
    # Run union (1, 0, 0) against the federation (130, 130, 130)/390 = 1/3 each: TV = 2/3.
    assert d.run_tv == pytest.approx(2 / 3)
    assert d.group_shares == pytest.approx([1.0, 0.0])
    assert d.most_selected == [{"client": 0, "count": 3, "dominant_class": 0, "dominant_share": 1.0, "group": 0}]


def test_diversity_of_a_covering_selection() -> None:
    """Rounds {0, 1} and {2, 3}: two and three classes covered, the run's union equals the federation's mix."""
    d = sd.diversity([[0, 1], [2, 3]], H, GROUPS, top=5)
    assert d.distinct_clients == 4
    assert d.gini == pytest.approx(0.0)
    assert d.top5_share == 1.0
    assert d.union_classes == pytest.approx((2 + 3) / 2)
    assert d.client_classes == pytest.approx((2 + 3) / 2)
    # Round 2's union: client 2 (0, 0, 100) + client 3 (30, 30, 30) = (30, 30, 130) / 190.
    p2 = np.array([30, 30, 130]) / 190
    assert d.union_entropy_bits == pytest.approx((1.0 + float(-(p2 * np.log2(p2)).sum())) / 2)
    assert d.top_class_share == pytest.approx((0.5 + 130 / 190) / 2)
    assert d.run_tv == pytest.approx(0.0)
    assert d.group_shares == pytest.approx([0.75, 0.25])
    assert [e["client"] for e in d.most_selected] == [0, 1, 2, 3]  # equal counts: lower id first


def test_union_threshold_counts_small_classes_only_above_one_percent() -> None:
    """A class at 0.5% of the union is not counted; ≥ 5% of some client is the other count's rule."""
    h = np.array([[995, 5, 0], [0, 0, 1000]])
    d = sd.diversity([[0]], h, None, top=1)
    assert d.union_classes == 1.0  # class 1 holds 0.5% of the union
    assert d.client_classes == 1.0  # and 0.5% of client 0
    assert d.group_shares is None
    h2 = np.array([[90, 10, 0], [0, 0, 1000]])
    assert sd.diversity([[0, 1]], h2, None, top=1).union_classes == 2.0  # 10 of 1100 < 1%: classes 0 and 2
    assert sd.diversity([[0, 1]], h2, None, top=1).client_classes == 3.0  # 10% of client 0 counts


def test_load_run_reads_every_round_from_rounds_csv(tmp_path: Path) -> None:
    """results.json lists only evaluated rounds; rounds.csv has every round's selection."""
    run = tmp_path / "pow" / "seed0"
    run.mkdir(parents=True)
    rounds = [{"round": 2, "selected": [1, 3], "evaluated": True, "fairness": {"mean": 40.0}}]
    results = {"run_id": "r", "rounds_completed": 2, "config": {"seed": 0}, "rounds": rounds}
    (run / "results.json").write_text(json.dumps(results))
    with (run / "rounds.csv").open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["round", "selected", "mean"])
        writer.writerows([[1, "0 2", ""], [2, "1 3", "40.0"]])
    loaded = sd.load_run(run)
    assert loaded.label == "pow/seed0"
    assert loaded.selections == [[0, 2], [1, 3]]
    assert loaded.accuracy == [(2, 40.0)]
    assert sd.find_runs([tmp_path]) == [run]


def test_partition_config_reads_older_results_configs() -> None:
    """A results.json config from before data.synthetic_* moved still yields its partition's data section."""
    old = {
        "seed": 3,
        "rounds": 9,
        "data": {"dataset": "synthetic", "num_clients": 4, "partition": "iid", "synthetic_alpha": 0.5},
        "model": {"name": "mlp", "hidden": [8]},  # a layout the current schema no longer takes
    }
    before = json.dumps(old, sort_keys=True)
    cfg = sd.partition_config(old)
    assert cfg.seed == 3
    assert cfg.data.num_clients == 4
    assert cfg.data.params == {"alpha": 0.5}
    assert json.dumps(old, sort_keys=True) == before  # the run's recorded config is left as it is

    # Valid once migrated (clients_per_round fits the federation): the whole config, old keys moved.
    old["selection"] = {"clients_per_round": 2}
    cfg = sd.partition_config(old)
    assert (cfg.rounds, cfg.selection.clients_per_round) == (9, 2)
    assert cfg.data.params == {"alpha": 0.5}
    assert cfg.model.params == {"hidden": [8]}


def test_runlib_legacy_keys_are_fairfl_moved_fields() -> None:
    """runlib's map of the pre-#19 keys holds exactly the keys fairfl.config reports as moved, each to the
    `<section>.params.<name>` its message names, owned by a plug-in the message names."""
    assert set(runlib.LEGACY_KEYS) == set(runlib.PLUGIN_FIELD) == {"data", "model"}
    for section, schema in (("data", DataConfig), ("model", ModelConfig)):
        keys = runlib.LEGACY_KEYS[section]
        assert sorted(old for old, _, _ in keys) == sorted(schema.MOVED_FIELDS)
        for old, plugin, param in keys:
            target = schema.MOVED_FIELDS[old]
            assert target.startswith(f"{section}.params.{param} (of ") and plugin in target, (old, target)
