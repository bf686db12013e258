"""The comparison file of `fairfl compare`: a base experiment, shared overrides, labelled runs and seeds, the paper's
numbers; validated (every run's experiment included) before anything trains."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fairfl.compose.compare.claims import Claim, parse_claims
from fairfl.config import ConfigError, ExperimentConfig, load_experiment
from fairfl.schema import expect_mapping

TRANSPORTS = ("inprocess", "grpc")
PAPER_METRICS = ("mean", "variance", "std", "worst_5", "best_5", "psi")
_SPEC_KEYS = ("name", "base", "set", "seeds", "jobs", "transport", "paper_source", "target_accuracy", "runs", "claims")
_RUN_KEYS = ("label", "set", "seeds", "paper")
_PM = re.compile(r"^\s*([-+0-9.eE]+)\s*(?:±|\+-|\+/-)\s*([-+0-9.eE]+)\s*$")


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
    claims: list[Claim] = field(default_factory=list)  # tested over seeds in the report (compare.claims)

    def experiment(self, run: RunSpec, seed: int) -> ExperimentConfig:
        """The validated experiment of one (run, seed): base ← shared set ← run set ← seed."""
        return load_experiment(self.base, {**self.overrides, **run.overrides, "seed": seed})

    def run(self, label: str) -> RunSpec:
        return next(r for r in self.runs if r.label == label)

    def same_partition(self, label_a: str, label_b: str, seed: int) -> bool:
        """Whether two runs' seed `seed` train on the same data partition (the same data config): their seeds pair."""
        return self.experiment(self.run(label_a), seed).data == self.experiment(self.run(label_b), seed).data


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


def int_at_least(value: Any, minimum: int, path: str) -> int:
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
    data = expect_mapping(data, _SPEC_KEYS, "comparison")
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
        shared["rounds"] = int_at_least(rounds, 1, "--rounds")
    default_seeds = _seeds(data.get("seeds", [0]), "seeds")
    if seeds is not None:
        default_seeds = _seeds(seeds, "--seeds")
    jobs = int_at_least(data.get("jobs", 1), 1, "jobs")
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
        raw = expect_mapping(raw, _RUN_KEYS, path)
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

    claims = parse_claims(data.get("claims"), [r.label for r in runs], target)
    spec = ComparisonSpec(
        name, base, shared, default_seeds, runs, jobs, transport, paper_source, source, target, claims
    )
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
