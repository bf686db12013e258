"""Plots of one run, written by `fairfl run` next to its results: the clients' mean accuracy (accuracy.png), the
variance of their accuracies (variance.png) and the mean accuracy of the worst 5% (worst5.png) at every evaluated
round. The numbers are the RoundEvents' fairness reports, the same that rounds.csv holds (columns mean, variance,
worst_5).

matplotlib is imported only when a plot is drawn, and draws through its Agg canvas (no display, no pyplot state).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fairfl.v1 import control_pb2

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class RunPlot:
    metric: str  # a FairnessReport field, and rounds.csv's column of the same name
    filename: str
    ylabel: str
    title: str


RUN_PLOTS = (
    RunPlot("mean", "accuracy.png", "mean client accuracy (%)", "mean test accuracy over the clients"),
    RunPlot("variance", "variance.png", "variance of client accuracy (%²)", "variance of the clients' test accuracy"),
    RunPlot("worst_5", "worst5.png", "worst-5% client accuracy (%)", "mean test accuracy of the worst 5% of clients"),
)


@dataclass(frozen=True)
class Series:
    """One metric at every evaluated round."""

    rounds: list[int]
    values: list[float]


def run_series(rounds: Sequence[control_pb2.RoundEvent]) -> dict[str, Series]:
    """metric → its values at the evaluated rounds, in round order, for every plot of RUN_PLOTS."""
    evaluated = sorted((r for r in rounds if r.evaluated), key=lambda r: r.round)
    return {
        plot.metric: Series([r.round for r in evaluated], [float(getattr(r.fairness, plot.metric)) for r in evaluated])
        for plot in RUN_PLOTS
    }


def series_figure(series: Series, plot: RunPlot, title: str) -> Figure:
    """The figure of one metric: a line with a marker at each evaluated round."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(series.rounds, series.values, marker="o", markersize=3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel(plot.ylabel)
    ax.set_title(f"{title}\n{plot.title}", fontsize=10)
    ax.grid(alpha=0.3)
    if plot.metric != "variance":
        ax.set_ylim(-2, 102)
    return fig


def write_run_plots(rounds: Sequence[control_pb2.RoundEvent], directory: Path, title: str) -> list[Path]:
    """Write RUN_PLOTS' PNGs into `directory` (none when no round was evaluated); the paths written."""
    series = run_series(rounds)
    if not series[RUN_PLOTS[0].metric].rounds:
        return []
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for plot in RUN_PLOTS:
        path = directory / plot.filename
        series_figure(series[plot.metric], plot, title).savefig(path, dpi=110)
        written.append(path)
    return written
