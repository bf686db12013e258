"""`fairfl compare`'s NMI and rounds-to-target columns, and the run's clustering summary they are read from."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from fairfl.compose.compare import (
    ComparisonResult,
    ComparisonSpec,
    RunSpec,
    SeedSummary,
    load_comparison,
    render_markdown,
    render_table,
    report_dict,
    rounds_to_target,
    summarize,
)
from fairfl.compose.results import clustering_summary
from fairfl.config import ConfigError
from fairfl.v1 import common_pb2, control_pb2
from tests.compare_support import TINY_EXPERIMENT

BASE = TINY_EXPERIMENT
MACHINE = {"platform": "p", "cpus": 2, "python": "3"}


def results(means: list[float], clustering: dict[str, Any] | None = None) -> dict[str, Any]:
    rounds = [{"round": 10 * (i + 1), "fairness": {"mean": m, "variance": 1.0}} for i, m in enumerate(means)]
    out: dict[str, Any] = {"rounds": rounds, "final_fairness": {"mean": means[-1]}, "final_round": 10 * len(means)}
    if clustering is not None:
        out["clustering"] = clustering
    return out


def test_rounds_to_target_is_the_first_evaluated_round_at_or_above_it() -> None:
    rounds = results([60.0, 74.99, 75.0, 70.0, 80.0])["rounds"]
    assert rounds_to_target(rounds, 75.0) == 30  # 75.0 counts as reached; the later dip does not matter
    assert rounds_to_target(rounds, 80.0) == 50
    assert rounds_to_target(rounds, 80.5) is None
    assert rounds_to_target([{"round": 1, "fairness": {}}], 10.0) is None  # a missing mean is 0 (MessageToDict)


def test_seed_summary_reads_nmi_and_target_only_when_they_apply() -> None:
    clustering = {"rounds": 5, "nmi_mean": 0.8, "rounds_all_groups": 3, "nmi_all_groups_mean": 0.95}
    run = SeedSummary.from_results("Equitable-FL", 0, results([70.0, 76.0], clustering), target_accuracy=75.0)
    assert (run.extra["nmi"], run.extra["nmi_all_groups"], run.extra["rounds_to_target"]) == (0.8, 0.95, 20.0)
    missed = SeedSummary.from_results("FedProx", 0, results([70.0, 71.0]), target_accuracy=75.0)
    assert missed.extra["rounds_to_target"] is None and "nmi" not in missed.extra
    plain = SeedSummary.from_results("FedProx", 0, results([70.0, 71.0]))
    assert not {"nmi", "nmi_all_groups", "rounds_to_target"} & set(plain.extra)


def _algorithms(target: float) -> list[Any]:
    clustering = {"rounds": 4, "nmi_mean": 0.75, "rounds_all_groups": 2, "nmi_all_groups_mean": 1.0}
    equitable = [
        SeedSummary.from_results("Equitable-FL", s, results(m, clustering), target_accuracy=target)
        for s, m in enumerate([[70.0, 76.0], [76.0, 77.0], [60.0, 80.0]])
    ]
    fedprox = [
        SeedSummary.from_results("FedProx", s, results(m), target_accuracy=target)
        for s, m in enumerate([[70.0, 75.5], [70.0, 71.0], [60.0, 74.0]])
    ]
    never = [SeedSummary.from_results("FairFed", 0, results([40.0, 50.0]), target_accuracy=target)]
    return [summarize("Equitable-FL", equitable), summarize("FedProx", fedprox), summarize("FairFed", never)]


def test_table_has_nmi_and_rounds_to_target_columns() -> None:
    header, _, equitable, fedprox, fairfed = render_table(_algorithms(75.0), target_accuracy=75.0).splitlines()
    assert "| NMI (mean over rounds) | NMI (rounds with every group) | Rounds to 75% mean acc |" in header
    # Equitable: every seed reached 75% (rounds 20, 10, 20 → 16.7 ± 4.7); NMI 0.750 and 1.000 in every seed.
    assert "| 0.750 ± 0.000 | 1.000 ± 0.000 | 16.7 ± 4.7 |" in equitable
    assert "| — | — | 20.0 (1/3 seeds) |" in fedprox  # only seed 0 reached it
    assert "| — | — | not reached |" in fairfed
    plain = render_table(_algorithms(75.0))  # no target: no column, even though the runs carry the metric
    assert "Rounds to" not in plain and "NMI (mean over rounds)" in plain


def test_markdown_and_json_explain_the_new_columns(tmp_path: Path) -> None:
    runs = [
        SeedSummary.from_results(
            "Equitable-FL", 0, results([76.0], {"rounds": 1, "nmi_mean": 1.0}), target_accuracy=75.0
        )
    ]
    spec = ComparisonSpec("eq", tmp_path / "b.yaml", {}, [0], [RunSpec("Equitable-FL", {}, [0])], target_accuracy=75.0)
    result = ComparisonResult(spec, tmp_path, 1, "inprocess", runs, [], datetime(2026, 1, 1).astimezone(), 1.0)
    md = render_markdown(result, "fairfl compare eq.yaml", MACHINE)
    assert "NMI compares the clusters a strategy found each round" in md
    assert "Rounds to 75%: the first evaluated round whose mean client accuracy reached it" in md
    assert "| Equitable-FL | 0 |" in md and "| 10.0 |" in md
    assert report_dict(result, "x", MACHINE)["target_accuracy"] == 75.0


def _write(tmp_path: Path, **changes: Any) -> Path:
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(BASE))
    spec = {"name": "unit", "base": "base.yaml", "runs": [{"label": "FedAvg"}], **changes}
    path = tmp_path / "compare.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_target_accuracy_is_validated(tmp_path: Path) -> None:
    assert load_comparison(_write(tmp_path, target_accuracy=75)).target_accuracy == 75.0
    assert load_comparison(_write(tmp_path)).target_accuracy is None
    for bad in (0, 101, "75%", True, -3):
        with pytest.raises(ConfigError, match=r"target_accuracy: expected a mean client accuracy in \(0, 100\]"):
            load_comparison(_write(tmp_path, target_accuracy=bad))


def _event(round_number: int, nmi: float | None, every_group: bool) -> control_pb2.RoundEvent:
    event = control_pb2.RoundEvent(round=round_number)
    if nmi is not None:
        event.strategy_metrics.extend(
            [
                common_pb2.Metric(name="nmi", value=nmi),
                common_pb2.Metric(name="all_groups_present", value=float(every_group)),
            ]
        )
    return event


def test_clustering_summary_over_every_round() -> None:
    events = [_event(1, 1.0, True), _event(2, 0.0, False), _event(3, None, False), _event(4, 0.5, True)]
    assert clustering_summary(events) == {
        "rounds": 3,
        "nmi_mean": pytest.approx(0.5),
        "rounds_all_groups": 2,
        "nmi_all_groups_mean": pytest.approx(0.75),
    }
    assert clustering_summary([_event(1, 0.3, False)])["nmi_all_groups_mean"] is None
    assert clustering_summary([_event(1, None, False)]) is None
