"""`fairfl compare`: run several algorithms × seeds from one comparison file and report them side by side.

A comparison file names a base experiment, overrides shared by every run, and a list of labelled runs (each its own
overrides, optionally its own seeds and the paper's numbers for that row). Every (run, seed) is one `fairfl run` in
its own subprocess, at most `jobs` at a time. The report (comparison.md/.csv/.json and two plots) is built from each
run's results.json by pure functions, so the table logic is testable without training.

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
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from fairfl.config import ConfigError, ExperimentConfig, load_experiment
from fairfl.results import FAIRNESS_COLUMNS

TRANSPORTS = ("inprocess", "grpc")
PAPER_METRICS = ("mean", "variance", "std", "worst_5", "best_5", "psi")
# (key, column heading, decimals) of the Markdown table's measured columns.
TABLE_METRICS = (
    ("mean", "Mean acc (%)", 2),
    ("variance", "Variance (%²)", 2),
    ("std", "Std (%)", 2),
    ("worst_5", "Worst 5% (%)", 2),
    ("best_5", "Best 5% (%)", 2),
)
# Metrics aggregated over seeds: every final fairness metric plus wall time.
# Columns shown only when some run has them (DP and loss-fairness runs): FedFDP's Ψ as the strategy reports it (final
# round, and the mean over the last PSI_TAIL evaluated rounds: Ψ under DP is noisy) and the ε the privacy ledger
# recorded (largest over principals) after the final round. Ψ is printed in scientific notation.
EXTRA_METRICS = (
    ("psi", "Ψ (final round)", "e"),
    ("psi_tail", "Ψ (mean, last 5 evaluations)", "e"),
    ("psi_test", "Ψ_test (global model)", "e"),
    ("epsilon", "ε spent (ledger)", "f4"),
    # Runs that cluster clients on a partition with true groups (Equitable-FL): NMI of found clusters vs true groups.
    ("nmi", "NMI (mean over rounds)", "f3"),
    ("nmi_all_groups", "NMI (rounds with every group)", "f3"),
    # With target_accuracy in the comparison file: the first evaluated round whose mean client accuracy reaches it.
    ("rounds_to_target", "Rounds to target", "f1"),
)
PSI_TAIL = 5
SEED_METRICS = (*FAIRNESS_COLUMNS, *(k for k, _, _ in EXTRA_METRICS), "wall_seconds")
_SPEC_KEYS = ("name", "base", "set", "seeds", "jobs", "transport", "paper_source", "target_accuracy", "runs")
_RUN_KEYS = ("label", "set", "seeds", "paper")
_PM = re.compile(r"^\s*([-+0-9.eE]+)\s*(?:±|\+-|\+/-)\s*([-+0-9.eE]+)\s*$")
LOG_TAIL_LINES = 20


# --- the comparison file ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PaperValue:
    """A number as the paper prints it: a value and, when the paper gives one, its ± spread."""

    value: float
    spread: float | None = None

    def __str__(self) -> str:
        return f"{self.value:g}" if self.spread is None else f"{self.value:g} ± {self.spread:g}"


@dataclass(frozen=True)
class RunSpec:
    label: str
    overrides: dict[str, Any]
    seeds: list[int]
    paper: dict[str, PaperValue] = field(default_factory=dict)

    @property
    def slug(self) -> str:
        return slugify(self.label)


@dataclass(frozen=True)
class ComparisonSpec:
    name: str
    base: Path  # resolved experiment file
    overrides: dict[str, Any]  # applied to every run (after the base, before the run's own)
    seeds: list[int]
    runs: list[RunSpec]
    jobs: int = 1
    transport: str = "inprocess"
    paper_source: str = ""
    source: Path | None = None  # the comparison file, when loaded from one
    target_accuracy: float | None = None  # % mean client accuracy for the rounds-to-target column

    def experiment(self, run: RunSpec, seed: int) -> ExperimentConfig:
        """The validated experiment of one (run, seed): base ← shared set ← run set ← seed."""
        return load_experiment(self.base, {**self.overrides, **run.overrides, "seed": seed})


def slugify(label: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")


def _seeds(value: Any, path: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{path}: expected a non-empty list of seeds, e.g. [0, 1, 2], got {value!r}")
    for i, seed in enumerate(value):
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ConfigError(f"{path}[{i}]: seeds must be integers >= 0, got {seed!r}")
    if len(set(value)) != len(value):
        raise ConfigError(f"{path}: duplicate seeds in {value}")
    return list(value)


def _overrides(value: Any, path: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a mapping of dotted config paths to values, got {type(value).__name__}")
    for key in value:
        if not isinstance(key, str) or not all(key.split(".")):
            raise ConfigError(f"{path}: {key!r} is not a dotted config path like strategy.params.q")
        if key == "seed":
            raise ConfigError(f"{path}.seed: the comparison sets each run's seed; list them under seeds")
    return dict(value)


def _paper(value: Any, path: str) -> dict[str, PaperValue]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a mapping with keys {', '.join(PAPER_METRICS)}")
    out: dict[str, PaperValue] = {}
    for key, raw in value.items():
        if key not in PAPER_METRICS:
            raise ConfigError(f"{path}: unknown field {key!r}; valid fields: {', '.join(PAPER_METRICS)}")
        number = isinstance(raw, int | float) and not isinstance(raw, bool) and math.isfinite(raw)
        if number or (isinstance(raw, str) and _is_number(raw)):  # "1.0e6" is text to YAML 1.1
            out[key] = PaperValue(float(raw))
        elif isinstance(raw, str) and (m := _PM.match(raw)):
            try:
                out[key] = PaperValue(float(m.group(1)), float(m.group(2)))
            except ValueError:
                raise ConfigError(f"{path}.{key}: expected a number or 'value ± spread', got {raw!r}") from None
        else:
            raise ConfigError(f"{path}.{key}: expected a number or 'value ± spread', got {raw!r}")
    return out


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _int_at_least(value: Any, minimum: int, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{path}: expected an integer >= {minimum}, got {value!r}")
    return value


def comparison_from_dict(
    data: Any,
    relative_to: Path,
    *,
    rounds: int | None = None,
    seeds: list[int] | None = None,
    source: Path | None = None,
) -> ComparisonSpec:
    """Validate a parsed comparison; `rounds`/`seeds` (from the command line) win over the file.

    Every run's experiment is resolved and validated here, so a bad override fails before anything trains.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"comparison: expected a mapping, got {type(data).__name__}")
    unknown = sorted(set(map(str, data)) - set(_SPEC_KEYS))
    if unknown:
        raise ConfigError(f"comparison: unknown field {unknown[0]!r}; valid fields: {', '.join(_SPEC_KEYS)}")
    for key in ("name", "base", "runs"):
        if key not in data:
            raise ConfigError(f"{key}: required field is missing")
    name = data["name"]
    if not isinstance(name, str) or not slugify(name):
        raise ConfigError(f"name: expected a non-empty name, got {name!r}")
    if not isinstance(data["base"], str) or not data["base"]:
        raise ConfigError(f"base: expected the path of an experiment YAML, got {data['base']!r}")
    base = (relative_to / data["base"]).resolve()
    if not base.is_file():
        raise ConfigError(f"base: experiment file {str(base)!r} not found (paths are relative to the comparison file)")
    shared = _overrides(data.get("set"), "set")
    if rounds is not None:
        shared["rounds"] = _int_at_least(rounds, 1, "--rounds")
    default_seeds = _seeds(data.get("seeds", [0]), "seeds")
    if seeds is not None:
        default_seeds = _seeds(seeds, "--seeds")
    jobs = _int_at_least(data.get("jobs", 1), 1, "jobs")
    transport = data.get("transport", "inprocess")
    if transport not in TRANSPORTS:
        raise ConfigError(f"transport: {transport!r} is not one of {', '.join(TRANSPORTS)}")
    paper_source = data.get("paper_source", "")
    if not isinstance(paper_source, str):
        raise ConfigError(f"paper_source: expected text naming the paper's table, got {paper_source!r}")
    target = data.get("target_accuracy")
    if target is not None:
        if isinstance(target, bool) or not isinstance(target, int | float) or not 0 < target <= 100:
            raise ConfigError(f"target_accuracy: expected a mean client accuracy in (0, 100] (%), got {target!r}")
        target = float(target)

    raw_runs = data["runs"]
    if not isinstance(raw_runs, list) or not raw_runs:
        raise ConfigError("runs: expected a non-empty list of runs, each with a label and a set of overrides")
    runs: list[RunSpec] = []
    slugs: dict[str, str] = {}
    for i, raw in enumerate(raw_runs):
        path = f"runs[{i}]"
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping with fields {', '.join(_RUN_KEYS)}")
        unknown = sorted(set(map(str, raw)) - set(_RUN_KEYS))
        if unknown:
            raise ConfigError(f"{path}: unknown field {unknown[0]!r}; valid fields: {', '.join(_RUN_KEYS)}")
        label = raw.get("label")
        if not isinstance(label, str) or not slugify(label):
            raise ConfigError(f"{path}.label: expected a non-empty label with letters or digits, got {label!r}")
        slug = slugify(label)
        if slug in slugs:
            what = "duplicate label" if slugs[slug] == label else f"label's directory name {slug!r} is taken by"
            raise ConfigError(f"{path}.label: {what} {slugs[slug]!r}")
        slugs[slug] = label
        run_seeds = default_seeds if seeds is not None or "seeds" not in raw else _seeds(raw["seeds"], f"{path}.seeds")
        run = RunSpec(
            label, _overrides(raw.get("set"), f"{path}.set"), run_seeds, _paper(raw.get("paper"), f"{path}.paper")
        )
        runs.append(run)

    spec = ComparisonSpec(name, base, shared, default_seeds, runs, jobs, transport, paper_source, source, target)
    try:  # the base with the shared overrides first, so their errors are not blamed on a run
        load_experiment(base, shared)
    except ConfigError as err:
        raise ConfigError(f"base {data['base']!r} with set: {err}") from None
    for i, run in enumerate(runs):
        try:
            spec.experiment(run, run.seeds[0])
        except ConfigError as err:
            raise ConfigError(f"runs[{i}] ({run.label!r}): {err}") from None
    return spec


def load_comparison(path: str | Path, *, rounds: int | None = None, seeds: list[int] | None = None) -> ComparisonSpec:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"comparison file {str(p)!r} not found")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{p}: not valid YAML: {err}") from err
    return comparison_from_dict(data, p.resolve().parent, rounds=rounds, seeds=seeds, source=p)


# --- per-run results and their aggregation (pure) ---------------------------------------------------------------------


@dataclass(frozen=True)
class SeedSummary:
    """What the report needs from one finished run's results.json."""

    label: str
    seed: int
    final_round: int
    final_fairness: dict[str, float | None]
    wall_seconds: float
    client_accuracies: list[float]  # per client, final evaluated round
    variance_by_round: list[tuple[int, float]]
    output_dir: str = ""
    extra: dict[str, float | None] = field(default_factory=dict)  # EXTRA_METRICS keys

    @classmethod
    def from_results(
        cls,
        label: str,
        seed: int,
        results: dict[str, Any],
        output_dir: str = "",
        target_accuracy: float | None = None,
    ) -> SeedSummary:
        """`target_accuracy` (%): also find the first evaluated round whose mean client accuracy reaches it."""
        rounds = results.get("rounds") or []
        if not results.get("final_fairness") or not rounds:
            raise ValueError("results.json has no evaluated round")
        # MessageToDict leaves out fields at their default (0), so a missing key reads as 0.
        final = rounds[-1]
        return cls(
            label=label,
            seed=seed,
            final_round=int(results.get("final_round") or final.get("round", 0)),
            final_fairness={k: results["final_fairness"].get(k) for k in FAIRNESS_COLUMNS},
            wall_seconds=float(results.get("wall_seconds", math.nan)),
            client_accuracies=[float(c.get("accuracy", 0.0)) for c in final.get("clients", [])],
            variance_by_round=[(int(r.get("round", 0)), float(r["fairness"].get("variance", 0.0))) for r in rounds],
            output_dir=output_dir,
            extra={**_extra_metrics(rounds), **_progress_metrics(results, target_accuracy)},
        )


def _strategy_metric(round_: dict[str, Any], name: str) -> float | None:
    for metric in round_.get("strategy_metrics", []):
        if metric.get("name") == name:
            return float(metric.get("value", 0.0))
    return None


def _extra_metrics(rounds: list[dict[str, Any]]) -> dict[str, float | None]:
    """Ψ (final evaluated round and mean of the last PSI_TAIL) and the ledger's ε after the final round."""
    tail = [v for r in rounds[-PSI_TAIL:] if (v := _strategy_metric(r, "psi")) is not None]
    eps = rounds[-1].get("epsilon_spent")
    final_psi = _strategy_metric(rounds[-1], "psi")
    psi_test = None
    clients = rounds[-1].get("clients", [])
    if final_psi is not None and clients:  # Eq. 7 on the global model's test losses, weighted by test samples
        from fairfl.metrics.fairness import psi

        weights = [float(c.get("num_samples", 0)) for c in clients]
        if sum(weights) > 0:
            psi_test = psi([float(c.get("loss", 0.0)) for c in clients], weights)
    return {
        "psi": final_psi,
        "psi_tail": statistics.fmean(tail) if tail else None,
        "psi_test": psi_test,
        "epsilon": float(eps) if eps is not None else None,
    }


def rounds_to_target(rounds: list[dict[str, Any]], target: float) -> int | None:
    """The first evaluated round whose mean client accuracy is >= target (%), None when no round reached it."""
    for r in rounds:
        if float(r.get("fairness", {}).get("mean", 0.0)) >= target:
            return int(r.get("round", 0))
    return None


def _progress_metrics(results: dict[str, Any], target: float | None) -> dict[str, float | None]:
    """NMI (from results.json's clustering summary, over every round) and rounds-to-target; only the keys that apply
    to this run, so runs without clustering or without a target keep their extra metrics unchanged."""
    out: dict[str, float | None] = {}
    clustering = results.get("clustering")
    if clustering:
        out["nmi"] = clustering.get("nmi_mean")
        out["nmi_all_groups"] = clustering.get("nmi_all_groups_mean")
    if target is not None:
        reached = rounds_to_target(results.get("rounds") or [], target)
        out["rounds_to_target"] = None if reached is None else float(reached)
    return out


@dataclass(frozen=True)
class Stat:
    """Mean and population std over seeds (values that are None or NaN are left out)."""

    mean: float
    std: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float | None]) -> Stat:
        xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
        if not xs:
            return cls(math.nan, math.nan, 0)
        return cls(statistics.fmean(xs), statistics.pstdev(xs), len(xs))

    def format(self, digits: int = 2) -> str:
        if self.n == 0:
            return "—"
        if self.n == 1:
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} ± {self.std:.{digits}f}"

    def format_as(self, style: str) -> str:
        """Style "e": scientific (Ψ spans 1e-3 to 1e11 across settings); "fN": N decimals."""
        if style != "e":
            return self.format(int(style[1:]))
        if self.n == 0:
            return "—"
        return f"{self.mean:.2e}" if self.n == 1 else f"{self.mean:.2e} ± {self.std:.1e}"


@dataclass(frozen=True)
class AlgorithmSummary:
    label: str
    seeds: list[int]  # seeds that finished
    metrics: dict[str, Stat]  # SEED_METRICS → over seeds
    paper: dict[str, PaperValue]
    variance_by_round: list[tuple[int, float, float]]  # (round, mean, std) over seeds
    failed_seeds: list[int] = field(default_factory=list)


def summarize(
    label: str, runs: Sequence[SeedSummary], paper: dict[str, PaperValue] | None = None, failed: Sequence[int] = ()
) -> AlgorithmSummary:
    """Aggregate one algorithm's seeds: every metric as mean ± population std; variance curve per round."""
    metrics = {k: Stat.of([r.final_fairness.get(k) for r in runs]) for k in FAIRNESS_COLUMNS}
    metrics.update({k: Stat.of([r.extra.get(k) for r in runs]) for k, _, _ in EXTRA_METRICS})
    metrics["wall_seconds"] = Stat.of([r.wall_seconds for r in runs])
    by_round: dict[int, list[float]] = {}
    for r in runs:
        for rnd, var in r.variance_by_round:
            by_round.setdefault(rnd, []).append(var)
    curve = [(rnd, (s := Stat.of(v)).mean, s.std) for rnd, v in sorted(by_round.items())]
    return AlgorithmSummary(label, sorted(r.seed for r in runs), metrics, dict(paper or {}), curve, sorted(failed))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _rounds_cell(stat: Stat, seeds: int) -> str:
    """Rounds to target over the seeds that reached it, saying how many did when not all."""
    if stat.n == 0:
        return "not reached"
    text = stat.format(1)
    return text if stat.n == seeds else f"{text} ({stat.n}/{seeds} seeds)"


def render_table(algorithms: Sequence[AlgorithmSummary], target_accuracy: float | None = None) -> str:
    """The Markdown comparison table; paper columns appear when any algorithm has paper numbers, the rounds-to-target
    column when the comparison names a target accuracy."""
    with_paper = any(a.paper for a in algorithms)
    extras = [
        (k, h, f) for k, h, f in EXTRA_METRICS if k != "rounds_to_target" and any(a.metrics[k].n for a in algorithms)
    ]
    if target_accuracy is not None:
        extras.append(("rounds_to_target", f"Rounds to {target_accuracy:g}% mean acc", "f1"))
    paper_cols = [(k, h) for k, h, _ in TABLE_METRICS]
    if any("psi" in a.paper for a in algorithms):
        paper_cols.append(("psi", "Ψ"))
    head = ["Algorithm", "Seeds", *(h for _, h, _ in TABLE_METRICS), *(h for _, h, _ in extras)]
    head.append("Wall time / run (s)")
    if with_paper:
        head += [f"Paper: {h}" for _, h in paper_cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---", "---"] + ["---:"] * (len(head) - 2)) + "|"]
    for a in algorithms:
        seeds = ", ".join(map(str, a.seeds)) or "none"
        if a.failed_seeds:
            seeds += f" (failed: {', '.join(map(str, a.failed_seeds))})"
        row = [_cell(a.label), seeds, *(a.metrics[k].format(d) for k, _, d in TABLE_METRICS)]
        row += [
            _rounds_cell(a.metrics[k], len(a.seeds)) if k == "rounds_to_target" else a.metrics[k].format_as(f)
            for k, _, f in extras
        ]
        row.append(a.metrics["wall_seconds"].format(1))
        if with_paper:
            row += [str(a.paper[k]) if k in a.paper else "—" for k, _ in paper_cols]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _num(value: float | None) -> str:
    if isinstance(value, int):
        return str(value)
    return "" if value is None or math.isnan(value) else repr(float(value))


def render_csv(algorithms: Sequence[AlgorithmSummary], runs: Sequence[SeedSummary]) -> str:
    """One row per (algorithm, seed) with every final metric and wall time, then one aggregate row per algorithm.

    Seed rows carry the values exactly as in results.json; aggregate rows carry the mean over seeds in the metric
    columns, the population std in the *_std columns and the paper's numbers in the paper_* columns.
    """
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    paper_cols = [f"paper_{k}" for k in PAPER_METRICS] + [f"paper_{k}_spread" for k in PAPER_METRICS]
    writer.writerow(
        ["algorithm", "row", "seed", "final_round", *SEED_METRICS, *(f"{k}_std" for k in SEED_METRICS), *paper_cols]
    )
    blank = [""] * len(SEED_METRICS)
    for a in algorithms:
        for r in (r for r in runs if r.label == a.label):
            values = [_num(r.final_fairness.get(k)) for k in FAIRNESS_COLUMNS]
            values += [_num(r.extra.get(k)) for k, _, _ in EXTRA_METRICS] + [_num(r.wall_seconds)]
            writer.writerow([a.label, "seed", r.seed, r.final_round, *values, *blank, *[""] * len(paper_cols)])
        paper = [_num(a.paper[k].value) if k in a.paper else "" for k in PAPER_METRICS]
        paper += [_num(a.paper[k].spread) if k in a.paper else "" for k in PAPER_METRICS]
        writer.writerow(
            [
                a.label,
                "aggregate",
                " ".join(map(str, a.seeds)),
                "",
                *(_num(a.metrics[k].mean) for k in SEED_METRICS),
                *(_num(a.metrics[k].std) for k in SEED_METRICS),
                *paper,
            ]
        )
    return out.getvalue()


# --- running ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunFailure:
    label: str
    seed: int
    exit_code: int
    log_tail: str
    log_path: str


@dataclass
class ComparisonResult:
    spec: ComparisonSpec
    output_dir: Path
    jobs: int
    transport: str
    runs: list[SeedSummary]  # finished runs, in spec order
    failures: list[RunFailure]
    started: datetime
    wall_seconds: float

    @property
    def ok(self) -> bool:
        return not self.failures

    def algorithms(self) -> list[AlgorithmSummary]:
        return [
            summarize(
                run.label,
                [r for r in self.runs if r.label == run.label],
                run.paper,
                [f.seed for f in self.failures if f.label == run.label],
            )
            for run in self.spec.runs
        ]


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _run_one(
    spec: ComparisonSpec, run: RunSpec, seed: int, output_dir: Path, transport: str
) -> SeedSummary | RunFailure:
    """One experiment in its own `fairfl run` subprocess; its output goes to <run dir>/run.log."""
    run_dir = output_dir / run.slug / f"seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "results.json").unlink(missing_ok=True)  # never read a previous invocation's results
    experiment = run_dir / "experiment.yaml"
    experiment.write_text(spec.experiment(run, seed).to_yaml())
    log_path = run_dir / "run.log"
    repo_root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo_root, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "fairfl.cli", "run", str(experiment), "--transport", transport]
    cmd += ["--output", str(run_dir)]
    with log_path.open("w") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=False).returncode
    if code != 0:
        return RunFailure(run.label, seed, code, _tail(log_path), str(log_path))
    try:
        results = json.loads((run_dir / "results.json").read_text())
        return SeedSummary.from_results(run.label, seed, results, str(run_dir), spec.target_accuracy)
    except (OSError, ValueError, KeyError) as err:
        return RunFailure(run.label, seed, code, f"unusable results.json: {err}\n{_tail(log_path)}", str(log_path))


def run_comparison(
    spec: ComparisonSpec, output_dir: Path, jobs: int | None = None, transport: str | None = None
) -> ComparisonResult:
    """Run every (run, seed) of the spec, at most `jobs` at a time; a failure is recorded, the others still finish."""
    jobs = jobs or spec.jobs
    transport = transport or spec.transport
    output_dir.mkdir(parents=True, exist_ok=True)
    work = [(run, seed) for run in spec.runs for seed in run.seeds]
    started, t0 = datetime.now().astimezone(), time.monotonic()
    lock = threading.Lock()
    done = 0

    def task(item: tuple[RunSpec, int]) -> SeedSummary | RunFailure:
        nonlocal done
        run, seed = item
        t = time.monotonic()
        outcome = _run_one(spec, run, seed, output_dir, transport)
        with lock:
            done += 1
            if isinstance(outcome, SeedSummary):
                acc = outcome.final_fairness.get("mean")
                what = f"ok in {time.monotonic() - t:.1f}s, mean acc {acc:.2f}%" if acc is not None else "ok"
            else:
                what = f"FAILED (exit {outcome.exit_code}); log {outcome.log_path}"
            print(f"[{done}/{len(work)}] {run.label} seed {seed}: {what}", flush=True)
        return outcome

    print(f"comparison {spec.name}: {len(work)} runs, {jobs} at a time, transport {transport}, in {output_dir}/")
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        outcomes = list(pool.map(task, work))
    return ComparisonResult(
        spec=spec,
        output_dir=output_dir,
        jobs=jobs,
        transport=transport,
        runs=[o for o in outcomes if isinstance(o, SeedSummary)],
        failures=[o for o in outcomes if isinstance(o, RunFailure)],
        started=started,
        wall_seconds=time.monotonic() - t0,
    )


# --- report -----------------------------------------------------------------------------------------------------------


def machine_description() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # the header is informational only
        pass
    return info


def _display_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def render_markdown(result: ComparisonResult, command_line: str, machine: dict[str, Any] | None = None) -> str:
    spec = result.spec
    machine = machine or machine_description()
    shared = ", ".join(f"{k}={v}" for k, v in spec.overrides.items()) or "none"
    hw = f"{machine['platform']}, {machine['cpus']} CPUs"
    if machine.get("cuda"):
        hw += f", GPU {machine['cuda']}"
    lines = [
        f"# Comparison: {spec.name}",
        "",
        f"- Command: `{command_line}`",
        f"- Date: {result.started.isoformat(timespec='seconds')} ({result.wall_seconds:.0f} s in all)",
        f"- Machine: {hw}; Python {machine['python']}" + (f", torch {machine['torch']}" if "torch" in machine else ""),
        f"- Base config: `{_display_path(spec.base)}`; shared overrides: {shared}",
        f"- Transport: {result.transport}; {result.jobs} run(s) at a time",
        "",
        "Measured values are the final evaluated round over every client's own test split, as mean ± population std "
        "over seeds (a plain value for one seed). Accuracies in %, variance in %² (population variance over clients). "
        "Wall time is the run's own (results.json wall_seconds, without process start-up).",
    ]
    if any(r.paper for r in spec.runs):
        source = spec.paper_source or "the paper (source not named)"
        lines.append(f'Columns labelled "Paper" are the numbers reported in {source}, not measured here.')
    if any(r.extra.get("psi") is not None or r.extra.get("epsilon") is not None for r in result.runs):
        lines.append(
            "Ψ is FedFDP's fairness measure as its reference code reports it: the p-weighted variance of the clients' "
            "losses on their own training data after local training (strategy metric `psi`; experiment telemetry, not "
            "a DP release). Ψ_test is Eq. 7 on the final global model: the variance of the clients' test losses, "
            "weighted by test samples. ε spent is what the privacy ledger recorded after the final round: the largest "
            "over principals (clients, or the federation), recomputed from the stored events."
        )
    if any(r.extra.get("nmi") is not None for r in result.runs):
        lines.append(
            "NMI compares the clusters a strategy found each round (Equitable-FL's spectral clustering of the round's "
            "participants) with the partition's true groups (sklearn normalized_mutual_info_score): the mean over all "
            "rounds, and over the rounds whose participants covered every true group."
        )
    if spec.target_accuracy is not None:
        lines.append(
            f"Rounds to {spec.target_accuracy:g}%: the first evaluated round whose mean client accuracy reached it, "
            "mean ± std over the seeds that reached it (how many did, when not all)."
        )
    lines += ["", render_table(result.algorithms(), spec.target_accuracy)]
    if any(r.extra.get("epsilon") is not None for r in result.runs):
        lines += ["", "Per run:", ""]
        lines.append("| Algorithm | Seed | Final round | Mean acc (%) | Ψ (final round) | ε spent (ledger) |")
        lines.append("|---|---:|---:|---:|---:|---:|")
        for r in result.runs:
            psi, eps, acc = r.extra.get("psi"), r.extra.get("epsilon"), r.final_fairness.get("mean")
            lines.append(
                f"| {_cell(r.label)} | {r.seed} | {r.final_round} | {'—' if acc is None else f'{acc:.2f}'} | "
                f"{'—' if psi is None else f'{psi:.3e}'} | {'—' if eps is None else f'{eps:.4f}'} |"
            )
    if result.failures:
        lines += ["", "## Failed runs", ""]
        for f in result.failures:
            lines += [f"- {f.label}, seed {f.seed}: exit code {f.exit_code}; log `{f.log_path}`", "", "```"]
            lines += [f.log_tail, "```"]
    return "\n".join(lines) + "\n"


def _json_num(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else value


def report_dict(result: ComparisonResult, command_line: str, machine: dict[str, Any]) -> dict[str, Any]:
    spec = result.spec
    return {
        "name": spec.name,
        "command": command_line,
        "date": result.started.isoformat(timespec="seconds"),
        "wall_seconds": round(result.wall_seconds, 3),
        "machine": machine,
        "source": str(spec.source) if spec.source else None,
        "base": str(spec.base),
        "set": spec.overrides,
        "transport": result.transport,
        "jobs": result.jobs,
        "paper_source": spec.paper_source,
        "target_accuracy": spec.target_accuracy,
        "algorithms": [
            {
                "label": a.label,
                "set": run.overrides,
                "seeds": a.seeds,
                "failed_seeds": a.failed_seeds,
                "metrics": {
                    k: {"mean": _json_num(s.mean), "std": _json_num(s.std), "n": s.n} for k, s in a.metrics.items()
                },
                "paper": {k: {"value": v.value, "spread": v.spread} for k, v in a.paper.items()},
                "variance_by_round": [[r, _json_num(m), _json_num(s)] for r, m, s in a.variance_by_round],
            }
            for a, run in zip(result.algorithms(), spec.runs, strict=True)
        ],
        "runs": [
            {
                "label": r.label,
                "seed": r.seed,
                "output_dir": r.output_dir,
                "final_round": r.final_round,
                "wall_seconds": r.wall_seconds,
                "final_fairness": r.final_fairness,
                "client_accuracies": r.client_accuracies,
                "extra": r.extra,
                "variance_by_round": r.variance_by_round,
            }
            for r in result.runs
        ],
        "failures": [vars(f) for f in result.failures],
    }


def plot_accuracy_distribution(result: ComparisonResult, path: Path) -> None:
    """Box plot of per-client final test accuracy per algorithm, pooled over that algorithm's seeds."""
    import numpy as np
    from matplotlib.figure import Figure  # Figure renders through Agg by itself: no pyplot, no display

    algos = [a for a in result.spec.runs if any(r.label == a.label for r in result.runs)]
    data = [[acc for r in result.runs if r.label == a.label for acc in r.client_accuracies] for a in algos]
    fig = Figure(figsize=(max(6.0, 1.4 * len(algos) + 2), 4.8), layout="constrained")
    ax = fig.add_subplot()
    if data:
        ax.boxplot(data, showmeans=True, showfliers=False)
        rng = np.random.default_rng(0)  # fixed jitter: the same report draws the same picture
        for i, values in enumerate(data, start=1):
            ax.scatter(i + rng.uniform(-0.15, 0.15, len(values)), values, s=8, alpha=0.35, color="tab:gray")
        ax.set_xticks(range(1, len(algos) + 1), [a.label for a in algos], rotation=20, ha="right")
    ax.set_ylabel("client test accuracy (%)")
    ax.set_ylim(-2, 102)
    ax.set_title(
        f"{result.spec.name}\nper-client final test accuracy, pooled over all seeds (dots: clients, ▲: mean)",
        fontsize=10,
    )
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=120)


def plot_variance_over_rounds(result: ComparisonResult, path: Path) -> None:
    """Variance of client accuracy at every evaluated round, mean over seeds (band: ± std over seeds)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7.0, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for a in result.algorithms():
        if not a.variance_by_round:
            continue
        rounds = [r for r, _, _ in a.variance_by_round]
        mean = [m for _, m, _ in a.variance_by_round]
        (line,) = ax.plot(rounds, mean, marker="o", markersize=3, label=f"{a.label} ({_plural(len(a.seeds), 'seed')})")
        if len(a.seeds) > 1:
            lo = [m - s for _, m, s in a.variance_by_round]
            hi = [m + s for _, m, s in a.variance_by_round]
            ax.fill_between(rounds, lo, hi, color=line.get_color(), alpha=0.15)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("variance of client accuracy (%²)")
    ax.set_title(
        f"{result.spec.name}\nvariance of client test accuracy per round, mean over seeds (band: ± std over seeds)",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.savefig(path, dpi=120)


def write_report(result: ComparisonResult, output_dir: Path, command_line: str) -> str:
    """Write comparison.md/.csv/.json and the two plots; return the Markdown table."""
    output_dir.mkdir(parents=True, exist_ok=True)
    machine = machine_description()
    algorithms = result.algorithms()
    (output_dir / "comparison.md").write_text(render_markdown(result, command_line, machine))
    (output_dir / "comparison.csv").write_text(render_csv(algorithms, result.runs))
    report = report_dict(result, command_line, machine)
    (output_dir / "comparison.json").write_text(json.dumps(report, indent=2, ensure_ascii=False))
    plot_accuracy_distribution(result, output_dir / "accuracy_distribution.png")
    plot_variance_over_rounds(result, output_dir / "variance_over_rounds.png")
    return render_table(algorithms, result.spec.target_accuracy)


# --- command line -----------------------------------------------------------------------------------------------------


def _seed_list(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 0,1,2, got {text!r}") from None


def command_line(args: argparse.Namespace) -> str:
    """The `fairfl compare` invocation, rebuilt from the parsed arguments."""
    parts = ["fairfl", "compare", args.comparison]
    for flag, value in (("--jobs", args.jobs), ("--transport", args.transport), ("--output", args.output)):
        if value is not None:
            parts += [flag, str(value)]
    if args.rounds is not None:
        parts += ["--rounds", str(args.rounds)]
    if args.seeds is not None:
        parts += ["--seeds", ",".join(map(str, args.seeds))]
    return shlex.join(parts)


def cmd_compare(args: argparse.Namespace) -> int:
    try:
        spec = load_comparison(args.comparison, rounds=args.rounds, seeds=args.seeds)
        if args.jobs is not None:
            _int_at_least(args.jobs, 1, "--jobs")
    except ConfigError as err:
        print(f"error: {args.comparison}: {err}", file=sys.stderr)
        return 2
    stamp = time.strftime("%Y%m%d-%H%M%S")
    output_dir = Path(args.output or Path("runs") / f"compare-{slugify(spec.name)}-{stamp}")
    result = run_comparison(spec, output_dir, args.jobs, args.transport)
    table = write_report(result, output_dir, command_line(args))
    print()
    print(table)
    for f in result.failures:
        print(f"\nFAILED: {f.label} seed {f.seed}, exit code {f.exit_code}; log {f.log_path}:\n{f.log_tail}")
    print(f"\n{len(result.runs)} of {len(result.runs) + len(result.failures)} runs finished; report in {output_dir}/")
    return 0 if result.ok else 1


def add_compare_parser(sub: Any) -> None:
    """Register `fairfl compare` on the CLI's subparsers."""
    p = sub.add_parser("compare", help="run algorithms × seeds from a comparison YAML and write a comparison report")
    p.add_argument("comparison", help="comparison YAML (base experiment, runs, seeds, paper numbers)")
    p.add_argument("--jobs", type=int, help="runs at a time (default: the file's jobs, else 1)")
    p.add_argument("--transport", choices=list(TRANSPORTS), help="default: the file's transport, else inprocess")
    p.add_argument("--output", help="report directory (default: runs/compare-<name>-<timestamp>)")
    p.add_argument("--rounds", type=int, help="override the number of rounds of every run")
    p.add_argument("--seeds", type=_seed_list, help="comma-separated seeds for every run, e.g. 0,1,2")
    p.set_defaults(func=cmd_compare)
