"""`fairfl compare` without training: spec validation, aggregation over seeds, table/CSV rendering, plots."""

from __future__ import annotations

import csv
import io
import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from fairfl.compose.compare import (
    ComparisonResult,
    ComparisonSpec,
    PaperValue,
    RunFailure,
    RunSpec,
    SeedSummary,
    Stat,
    load_comparison,
    render_csv,
    render_table,
    summarize,
    write_report,
)
from fairfl.compose.results import FAIRNESS_COLUMNS
from fairfl.config import ConfigError
from tests.compare_support import TINY_EXPERIMENT

BASE = TINY_EXPERIMENT
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_spec(tmp_path: Path, spec: dict[str, Any]) -> Path:
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(BASE))
    path = tmp_path / "compare.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def good_spec(**changes: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "unit",
        "base": "base.yaml",
        "seeds": [0, 1],
        "runs": [
            {"label": "FedAvg", "set": {"strategy.name": "fedavg"}},
            {"label": "FedAvg slow", "set": {"strategy.server_lr": 0.5}, "seeds": [3]},
        ],
    }
    spec.update(changes)
    return spec


def load_error(tmp_path: Path, spec: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        load_comparison(write_spec(tmp_path, spec))
    return str(info.value)


# --- the comparison file ----------------------------------------------------------------------------------------------


def test_valid_spec_loads_with_defaults_and_per_run_seeds(tmp_path: Path) -> None:
    spec = load_comparison(write_spec(tmp_path, good_spec()))
    assert spec.name == "unit"
    assert spec.base == (tmp_path / "base.yaml").resolve()
    assert (spec.jobs, spec.transport) == (1, "inprocess")
    assert [r.seeds for r in spec.runs] == [[0, 1], [3]]
    assert [r.slug for r in spec.runs] == ["fedavg", "fedavg-slow"]
    config = spec.experiment(spec.runs[1], 3)
    assert (config.seed, config.strategy.server_lr, config.rounds) == (3, 0.5, 2)


def test_command_line_rounds_and_seeds_win_over_the_file(tmp_path: Path) -> None:
    spec = load_comparison(write_spec(tmp_path, good_spec(set={"rounds": 7})), rounds=3, seeds=[5, 6])
    assert [r.seeds for r in spec.runs] == [[5, 6], [5, 6]]
    assert spec.experiment(spec.runs[0], 5).rounds == 3


def test_missing_base_is_named(tmp_path: Path) -> None:
    spec = good_spec()
    del spec["base"]
    assert load_error(tmp_path, spec).startswith("base: required field is missing")


def test_base_file_not_found_is_named(tmp_path: Path) -> None:
    assert load_error(tmp_path, good_spec(base="nowhere.yaml")).startswith("base: experiment file")


def test_unknown_key_is_named(tmp_path: Path) -> None:
    assert "unknown field 'sede'" in load_error(tmp_path, good_spec(sede=[0]))
    runs = [{"label": "a", "sett": {}}]
    assert load_error(tmp_path, good_spec(runs=runs)).startswith("runs[0]: unknown field 'sett'")


@pytest.mark.parametrize(
    ("seeds", "expected"),
    [
        ([], "seeds: expected a non-empty list"),
        (3, "seeds: expected a non-empty list"),
        ([0, -1], "seeds[1]: seeds must be integers >= 0"),
        ([0, "one"], "seeds[1]: seeds must be integers >= 0"),
        ([1, 1], "seeds: duplicate seeds"),
    ],
)
def test_bad_seeds_are_named(tmp_path: Path, seeds: Any, expected: str) -> None:
    assert load_error(tmp_path, good_spec(seeds=seeds)).startswith(expected)


def test_bad_per_run_seeds_are_named(tmp_path: Path) -> None:
    runs = [{"label": "a", "seeds": [True]}]
    assert load_error(tmp_path, good_spec(runs=runs)).startswith("runs[0].seeds[0]:")


def test_duplicate_labels_are_refused(tmp_path: Path) -> None:
    runs = [{"label": "FedAvg"}, {"label": "FedAvg"}]
    assert load_error(tmp_path, good_spec(runs=runs)) == "runs[1].label: duplicate label 'FedAvg'"
    runs = [{"label": "Fed Avg"}, {"label": "fed-avg"}]  # same output directory
    assert load_error(tmp_path, good_spec(runs=runs)).startswith("runs[1].label: label's directory name 'fed-avg'")


def test_bad_run_override_names_run_and_field(tmp_path: Path) -> None:
    runs = [{"label": "ok"}, {"label": "bad", "set": {"strategy.name": "nosuch"}}]
    message = load_error(tmp_path, good_spec(runs=runs))
    assert message.startswith("runs[1] ('bad'): strategy.name: unknown strategy 'nosuch'")
    runs = [{"label": "typo", "set": {"training.lrr": 0.1}}]
    message = load_error(tmp_path, good_spec(runs=runs))
    assert message.startswith("runs[0] ('typo'): training") and "lrr" in message
    runs = [{"label": "through", "set": {"rounds.x": 1}}]  # a path through a non-section
    assert load_error(tmp_path, good_spec(runs=runs)).startswith("runs[0] ('through'): rounds")


def test_bad_shared_override_is_blamed_on_set(tmp_path: Path) -> None:
    message = load_error(tmp_path, good_spec(set={"training.lr": -1}))
    assert message.startswith("base 'base.yaml' with set: training.lr: must be > 0")


def test_seed_override_and_other_top_level_fields_are_checked(tmp_path: Path) -> None:
    runs = [{"label": "a", "set": {"seed": 4}}]
    assert load_error(tmp_path, good_spec(runs=runs)).startswith("runs[0].set.seed:")
    assert load_error(tmp_path, good_spec(jobs=0)).startswith("jobs: expected an integer >= 1")
    assert load_error(tmp_path, good_spec(transport="tcp")).startswith("transport: 'tcp' is not one of")
    assert load_error(tmp_path, good_spec(runs=[])).startswith("runs: expected a non-empty list")
    bad_paper = [{"label": "a", "paper": {"accuracy": 80}}]
    assert load_error(tmp_path, good_spec(runs=bad_paper)).startswith("runs[0].paper: unknown field 'accuracy'")
    bad_value = [{"label": "a", "paper": {"mean": "high"}}]
    assert load_error(tmp_path, good_spec(runs=bad_value)).startswith("runs[0].paper.mean: expected a number")


def test_paper_values_parse_plus_minus(tmp_path: Path) -> None:
    runs = [{"label": "a", "paper": {"mean": "86.49 ± 0.09", "variance": 62.44, "worst_5": "71.27+-1.14"}}]
    paper = load_comparison(write_spec(tmp_path, good_spec(runs=runs))).runs[0].paper
    assert paper == {
        "mean": PaperValue(86.49, 0.09),
        "variance": PaperValue(62.44),
        "worst_5": PaperValue(71.27, 1.14),
    }
    assert str(paper["mean"]) == "86.49 ± 0.09"


# --- aggregation and rendering ----------------------------------------------------------------------------------------


def seed_run(label: str, seed: int, mean: float, var: float, worst: float, best: float, wall: float) -> SeedSummary:
    fairness: dict[str, float | None] = {k: 0.0 for k in FAIRNESS_COLUMNS}
    fairness.update(mean=mean, variance=var, worst_5=worst, best_5=best, mean_loss=None)
    accuracies = [worst, mean, mean, best]
    return SeedSummary(label, seed, 4, fairness, wall, accuracies, [(2, var + 10.0), (4, var)])


def hand_made() -> tuple[list[SeedSummary], dict[str, PaperValue]]:
    runs = [
        seed_run("FedAvg", 0, 80.0, 10.0, 50.0, 95.0, 4.0),
        seed_run("FedAvg", 1, 84.0, 20.0, 54.0, 97.0, 6.0),
        seed_run("FedAvg", 2, 86.0, 30.0, 56.0, 99.0, 5.0),
        seed_run("q-FFL | q=0.1", 0, 81.5, 12.25, 60.0, 93.0, 3.0),
    ]
    return runs, {"mean": PaperValue(86.49, 0.09), "variance": PaperValue(62.44, 4.55)}


def test_stat_is_mean_and_population_std() -> None:
    # mean 20; population variance ((-10)² + 0² + 10²) / 3 = 200/3
    s = Stat.of([10.0, 20.0, 30.0])
    assert (s.mean, s.n) == (20.0, 3)
    assert s.std == pytest.approx(math.sqrt(200 / 3))
    assert s.format() == "20.00 ± 8.16"
    assert Stat.of([12.25]).format() == "12.25"  # one seed: a plain value
    assert Stat.of([None, math.nan]).format() == "—"


def test_summarize_aggregates_over_seeds() -> None:
    runs, paper = hand_made()
    a = summarize("FedAvg", runs[:3], paper)
    assert a.seeds == [0, 1, 2]
    # mean acc: (80 + 84 + 86)/3 = 83.333; deviations -3.333, 0.667, 2.667 → pvariance 56/9 → std 2.4944
    assert a.metrics["mean"].mean == pytest.approx(250 / 3)
    assert a.metrics["mean"].std == pytest.approx(math.sqrt(56 / 9))
    assert a.metrics["variance"].format() == "20.00 ± 8.16"
    # worst: 50, 54, 56 → mean 160/3 = 53.33, pvariance (−3.33² + 0.67² + 2.67²)/3 = 56/9
    assert a.metrics["worst_5"].format() == "53.33 ± 2.49"
    assert a.metrics["best_5"].format() == "97.00 ± 1.63"  # 95, 97, 99: std sqrt(8/3)
    assert a.metrics["wall_seconds"].format(1) == "5.0 ± 0.8"  # 4, 6, 5: std sqrt(2/3)
    assert a.metrics["mean_loss"].n == 0  # None in every seed: left out, not counted as 0
    assert a.variance_by_round[1] == pytest.approx((4, 20.0, math.sqrt(200 / 3)))


def test_markdown_table_has_measured_and_paper_columns() -> None:
    runs, paper = hand_made()
    table = render_table([summarize("FedAvg", runs[:3], paper), summarize("q-FFL | q=0.1", runs[3:], {}, [1])])
    header, rule, fedavg, qffl = table.splitlines()
    assert header.split(" | ")[-5:] == [
        "Paper: Mean acc (%)",
        "Paper: Variance (%²)",
        "Paper: Std (%)",
        "Paper: Worst 5% (%)",
        "Paper: Best 5% (%) |",
    ]
    assert "| 83.33 ± 2.49 | 20.00 ± 8.16 | 0.00 ± 0.00 | 53.33 ± 2.49 | 97.00 ± 1.63 | 5.0 ± 0.8 |" in fedavg
    assert fedavg.endswith("| 86.49 ± 0.09 | 62.44 ± 4.55 | — | — | — |")
    assert qffl.startswith("| q-FFL \\| q=0.1 | 0 (failed: 1) | 81.50 | 12.25 | 0.00 | 60.00 | 93.00 | 3.0 |")
    assert rule.count("|") == header.count("|")


def test_markdown_table_without_paper_numbers_has_no_paper_columns() -> None:
    runs, _ = hand_made()
    assert "Paper" not in render_table([summarize("FedAvg", runs[:3])])


def test_csv_has_seed_rows_and_an_aggregate_row_with_paper_columns() -> None:
    runs, paper = hand_made()
    algos = [summarize("FedAvg", runs[:3], paper), summarize("q-FFL | q=0.1", runs[3:])]
    rows = list(csv.DictReader(io.StringIO(render_csv(algos, runs))))
    assert [(r["algorithm"], r["row"], r["seed"]) for r in rows] == [
        ("FedAvg", "seed", "0"),
        ("FedAvg", "seed", "1"),
        ("FedAvg", "seed", "2"),
        ("FedAvg", "aggregate", "0 1 2"),
        ("q-FFL | q=0.1", "seed", "0"),
        ("q-FFL | q=0.1", "aggregate", "0"),
    ]
    assert float(rows[1]["variance"]) == 20.0 and rows[1]["variance_std"] == "" and rows[1]["paper_mean"] == ""
    assert rows[1]["mean_loss"] == ""  # None stays empty
    agg = rows[3]
    assert float(agg["mean"]) == pytest.approx(250 / 3)
    assert float(agg["mean_std"]) == pytest.approx(math.sqrt(56 / 9))
    assert float(agg["wall_seconds"]) == 5.0
    assert (agg["paper_mean"], agg["paper_mean_spread"], agg["paper_worst_5"]) == ("86.49", "0.09", "")


# --- the whole report -------------------------------------------------------------------------------------------------


def make_result(tmp_path: Path) -> ComparisonResult:
    runs, paper = hand_made()
    spec = ComparisonSpec(
        name="unit",
        base=tmp_path / "base.yaml",
        overrides={"rounds": 4},
        seeds=[0, 1, 2],
        runs=[RunSpec("FedAvg", {}, [0, 1, 2], paper), RunSpec("q-FFL | q=0.1", {"strategy.name": "qffl"}, [0, 1])],
        paper_source="FedEBA+ Table 1 (FMNIST)",
    )
    failure = RunFailure("q-FFL | q=0.1", 1, 3, "Traceback ...\nRuntimeError: boom", "runs/x/run.log")
    started = datetime(2026, 1, 2, 3, 4, 5).astimezone()
    return ComparisonResult(spec, tmp_path, 2, "inprocess", runs, [failure], started, 12.5)


def test_write_report_writes_every_file(tmp_path: Path) -> None:
    result = make_result(tmp_path)
    table = write_report(result, tmp_path / "out", "fairfl compare c.yaml --jobs 2")
    out = tmp_path / "out"
    md = (out / "comparison.md").read_text()
    assert table in md
    assert "- Command: `fairfl compare c.yaml --jobs 2`" in md
    assert "- Machine: " in md and "CPUs" in md and "- Base config: " in md and "shared overrides: rounds=4" in md
    assert 'Columns labelled "Paper" are the numbers reported in FedEBA+ Table 1 (FMNIST)' in md
    assert "## Failed runs" in md and "seed 1: exit code 3" in md and "RuntimeError: boom" in md
    report = json.loads((out / "comparison.json").read_text())
    assert report["algorithms"][0]["paper"]["mean"] == {"value": 86.49, "spread": 0.09}
    assert report["algorithms"][1]["failed_seeds"] == [1]
    assert len(report["runs"]) == 4 and report["failures"][0]["exit_code"] == 3
    assert len(list(csv.DictReader((out / "comparison.csv").open()))) == 6
    for name in ("accuracy_distribution.png", "variance_over_rounds.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE, name
        assert len(data) > 10_000, name
        # IHDR holds the width and height: a real image, not an empty canvas.
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert width > 300 and height > 200


def test_report_survives_an_algorithm_with_no_finished_seed(tmp_path: Path) -> None:
    result = make_result(tmp_path)
    result.runs = [r for r in result.runs if r.label == "FedAvg"]
    table = write_report(result, tmp_path / "out", "fairfl compare c.yaml")
    assert "| q-FFL \\| q=0.1 | none (failed: 1) | — | — | — | — | — |" in table
    assert (tmp_path / "out" / "accuracy_distribution.png").read_bytes()[:8] == PNG_SIGNATURE
