"""`fairfl compare`: run several algorithms × seeds from one comparison file and report them side by side.

A comparison file names a base experiment, overrides shared by every run, and a list of labelled runs (each its own
overrides, optionally its own seeds and the paper's numbers for that row). Every (run, seed) is one `fairfl run` in
its own subprocess, at most `jobs` at a time. The report (comparison.md/.csv/.json and three plots) is built from each
run's results.json by pure functions, so the table logic is testable without training. `--resume` reuses the
(run, seed) pairs a previous invocation finished in the same output directory and runs only the others.

Example::

    name: fedeba-table1-fmnist
    base: ../experiments/quickstart.yaml      # relative to this file
    set: {rounds: 200}                        # every run
    seeds: [0, 1, 2]
    jobs: 2
    paper_source: "FedEBA+ (V002) Table 1, FashionMNIST MLP"
    target_accuracy: 75                       # optional: adds a rounds-to-75%-mean-accuracy column
    runs:
      - label: FedAvg
        set: {strategy.name: fedavg}
        paper: {mean: "86.49 ± 0.09", variance: "62.44 ± 4.55", worst_5: 71.27, best_5: 95.84}
      - label: FedAvg (server lr 0.5)
        set: {strategy.server_lr: 0.5}
        seeds: [0]

The package is split along its seams: `spec` (the comparison file), `runner` (the subprocesses), `summary` (results and
their aggregation), `report` (tables and plots) and `command` (the `fairfl compare` subcommand).
"""

from fairfl.compose.compare.command import add_compare_parser, cmd_compare, command_line
from fairfl.compose.compare.metrics import EXTRA_METRICS, SEED_METRICS
from fairfl.compose.compare.report import (
    machine_description,
    plot_accuracy_distribution,
    plot_accuracy_over_rounds,
    plot_variance_over_rounds,
    render_csv,
    render_markdown,
    render_table,
    report_dict,
    write_report,
)
from fairfl.compose.compare.runner import run_comparison
from fairfl.compose.compare.spec import (
    PAPER_METRICS,
    TRANSPORTS,
    ComparisonSpec,
    PaperValue,
    RunSpec,
    comparison_from_dict,
    load_comparison,
    slugify,
)
from fairfl.compose.compare.summary import (
    AlgorithmSummary,
    ComparisonResult,
    RunFailure,
    SeedSummary,
    Stat,
    rounds_to_target,
    summarize,
)

__all__ = [
    "EXTRA_METRICS",
    "PAPER_METRICS",
    "SEED_METRICS",
    "TRANSPORTS",
    "AlgorithmSummary",
    "ComparisonResult",
    "ComparisonSpec",
    "PaperValue",
    "RunFailure",
    "RunSpec",
    "SeedSummary",
    "Stat",
    "add_compare_parser",
    "cmd_compare",
    "command_line",
    "comparison_from_dict",
    "load_comparison",
    "machine_description",
    "plot_accuracy_distribution",
    "plot_accuracy_over_rounds",
    "plot_variance_over_rounds",
    "render_csv",
    "render_markdown",
    "render_table",
    "report_dict",
    "rounds_to_target",
    "run_comparison",
    "slugify",
    "summarize",
    "write_report",
]
