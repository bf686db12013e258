"""Plots of `fairfl run` (accuracy.png, variance.png, worst5.png) and the mean-accuracy plot of `fairfl compare`: the
files are real PNGs and what they draw is the recorded numbers (rounds.csv's columns, results.json's rounds)."""

from __future__ import annotations

import csv
import math
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from PIL import Image

from fairfl.compose import plots
from fairfl.compose.cli import main
from fairfl.compose.compare import ComparisonResult, ComparisonSpec, RunSpec, SeedSummary, write_report
from fairfl.compose.compare.summary import curve_over_seeds
from fairfl.compose.plots import RUN_PLOTS, RunPlot, Series, run_series, series_figure, write_run_plots
from fairfl.compose.results import RunRecorder
from fairfl.config import experiment_from_dict
from fairfl.v1 import control_pb2


def round_event(number: int, evaluated: bool, mean: float = 0.0, variance: float = 0.0, worst: float = 0.0) -> Any:
    event = control_pb2.RoundEvent(round=number, evaluated=evaluated, model_sha256=f"{number:064x}")
    if evaluated:
        event.fairness.CopyFrom(control_pb2.FairnessReport(mean=mean, variance=variance, worst_5=worst, std=1.5))
        event.clients.add(client_id=0, accuracy=mean, loss=0.5, num_samples=10)
    return event


def recorded_run(tmp_path: Path) -> tuple[RunRecorder, Path]:
    """A recorder fed rounds 1..9, evaluated every other round and at the end, written like `fairfl run` does."""
    config = experiment_from_dict(
        {"data": {"dataset": "synthetic", "num_clients": 4}, "selection": {"clients_per_round": 2}}
    )
    recorder = RunRecorder(config, quiet=True)
    rng = np.random.default_rng(7)
    for n in range(1, 10):
        evaluated = n % 2 == 0 or n == 9
        recorder(control_pb2.RunEvent(round=round_event(n, evaluated, *rng.uniform(0, 100, 3).tolist())))
    out = tmp_path / "run"
    recorder.write(out, {"transport": "inprocess"})
    return recorder, out


def csv_column(path: Path, column: str) -> tuple[list[int], list[float]]:
    rows = [r for r in csv.DictReader(path.open()) if r[column] != ""]
    return [int(r["round"]) for r in rows], [float(r[column]) for r in rows]


def assert_png(path: Path, min_width: int = 300, min_height: int = 200) -> None:
    assert path.is_file() and path.stat().st_size > 0, path
    with Image.open(path) as image:
        image.verify()  # a complete, uncorrupted PNG
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.width >= min_width and image.height >= min_height
        # Not a blank canvas: a plot has many colours (line, text, grid).
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 20) or []) > 20


def test_the_series_are_rounds_csv_columns(tmp_path: Path) -> None:
    recorder, out = recorded_run(tmp_path)
    series = run_series(recorder.rounds)
    for plot in RUN_PLOTS:
        rounds, values = csv_column(out / "rounds.csv", plot.metric)
        assert series[plot.metric].rounds == rounds == [2, 4, 6, 8, 9]
        assert series[plot.metric].values == pytest.approx(values, rel=1e-5)  # rounds.csv keeps 6 digits


def test_the_figures_draw_the_series_and_the_files_are_pngs(tmp_path: Path) -> None:
    recorder, out = recorded_run(tmp_path)
    series = run_series(recorder.rounds)
    for plot in RUN_PLOTS:
        fig = series_figure(series[plot.metric], plot, "unit")
        (line,) = fig.axes[0].get_lines()
        assert list(line.get_xdata()) == series[plot.metric].rounds
        assert list(line.get_ydata()) == series[plot.metric].values
    written = write_run_plots(recorder.rounds, out, "unit run")
    assert [p.name for p in written] == ["accuracy.png", "variance.png", "worst5.png"]
    for path in written:
        assert_png(path)


def test_no_plot_without_an_evaluated_round(tmp_path: Path) -> None:
    assert write_run_plots([round_event(1, False), round_event(2, False)], tmp_path, "none") == []
    assert not list(tmp_path.iterdir())


def test_fairfl_run_plots_the_numbers_it_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = {
        "name": "plots",
        "rounds": 4,
        "data": {"dataset": "synthetic", "num_clients": 4},
        "model": {"name": "logreg"},
        "training": {"local_steps": 1},
        "selection": {"clients_per_round": 2},
        "evaluation": {"every": 2},
    }
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(config))
    drawn: dict[str, Series] = {}

    def spy(series: Series, plot: RunPlot, title: str) -> Any:
        drawn[plot.metric] = series
        return series_figure(series, plot, title)

    monkeypatch.setattr(plots, "series_figure", spy)
    out = tmp_path / "out"
    assert main(["run", str(tmp_path / "exp.yaml"), "--transport", "inprocess", "--output", str(out)]) == 0
    capsys.readouterr()
    assert sorted(drawn) == sorted(plot.metric for plot in RUN_PLOTS)
    for plot in RUN_PLOTS:
        assert_png(out / plot.filename)
        rounds, values = csv_column(out / "rounds.csv", plot.metric)
        assert rounds == [2, 4]
        assert drawn[plot.metric].rounds == rounds
        assert drawn[plot.metric].values == pytest.approx(values, rel=1e-5)


# ------------------------------------------------------------------------------------------------------- compare


def seed_results(accuracies: list[tuple[int, float]]) -> dict[str, Any]:
    rounds = [{"round": r, "fairness": {"mean": acc, "variance": 10.0 + r}, "clients": []} for r, acc in accuracies]
    return {"final_fairness": {"mean": accuracies[-1][1]}, "final_round": accuracies[-1][0], "rounds": rounds}


def test_compare_mean_accuracy_curve_is_the_mean_over_seeds(tmp_path: Path) -> None:
    a = SeedSummary.from_results("FedAvg", 0, seed_results([(2, 40.0), (4, 60.0)]))
    b = SeedSummary.from_results("FedAvg", 1, seed_results([(2, 50.0), (4, 80.0)]))
    assert a.accuracy_by_round == [(2, 40.0), (4, 60.0)]
    curve = curve_over_seeds([a.accuracy_by_round, b.accuracy_by_round])
    assert curve == [(2, 45.0, 5.0), (4, 70.0, 10.0)]
    other = SeedSummary.from_results("q-FFL", 0, seed_results([(2, 30.0), (4, 35.0)]))
    spec = ComparisonSpec(
        "unit", tmp_path / "base.yaml", {}, [0, 1], [RunSpec("FedAvg", {}, [0, 1]), RunSpec("q-FFL", {}, [0])]
    )
    result = ComparisonResult(spec, tmp_path, 1, "inprocess", [a, b, other], [], datetime.now().astimezone(), 1.0)
    assert result.algorithms()[0].accuracy_by_round == curve
    write_report(result, tmp_path / "out", "fairfl compare c.yaml")
    assert_png(tmp_path / "out" / "accuracy_over_rounds.png")
    report = (tmp_path / "out" / "comparison.json").read_text()
    assert '"accuracy_by_round"' in report


def test_curve_over_seeds_keeps_rounds_only_some_seeds_have() -> None:
    curve = curve_over_seeds([[(1, 10.0), (2, 20.0)], [(2, 40.0), (3, 30.0)]])
    assert [r for r, _, _ in curve] == [1, 2, 3]
    assert curve[1] == (2, 30.0, 10.0)
    assert curve[0][2] == 0.0 and not math.isnan(curve[2][1])
