"""Per-run results of a comparison and their aggregation over seeds: pure functions of each run's results.json."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from fairfl.compose.compare.claims import CI_LEVEL, ClaimResult, evaluate_claim, t_interval
from fairfl.compose.compare.metrics import EXTRA_METRICS, PSI_TAIL
from fairfl.compose.compare.spec import ComparisonSpec, PaperValue
from fairfl.compose.results import FAIRNESS_COLUMNS


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
    accuracy_by_round: list[tuple[int, float]] = field(default_factory=list)  # mean client accuracy per evaluation
    revision: str | None = None  # the commit that ran it (fairfl.compose.provenance.revision_text)

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
            accuracy_by_round=[(int(r.get("round", 0)), float(r["fairness"].get("mean", 0.0))) for r in rounds],
        )


def _strategy_metric(round_: dict[str, Any], name: str) -> float | None:
    for metric in round_.get("strategy_metrics", []):
        if metric.get("name") == name:
            return float(metric.get("value", 0.0))
    return None


def _extra_metrics(rounds: list[dict[str, Any]]) -> dict[str, float | None]:
    """Ψ (final evaluated round and mean of the last PSI_TAIL; at the global model: psi_before), Ψ_test and the
    ledger's ε after the final round."""
    tail = [v for r in rounds[-PSI_TAIL:] if (v := _strategy_metric(r, "psi")) is not None]
    before = [v for r in rounds[-PSI_TAIL:] if (v := _strategy_metric(r, "psi_before")) is not None]
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
        "psi_before_tail": statistics.fmean(before) if before else None,
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
    """Mean and population std over seeds (values that are None, NaN or infinite are left out), and the t-interval of
    the mean (sample std, CI_LEVEL) when there are two seeds or more."""

    mean: float
    std: float
    n: int
    ci: tuple[float, float] | None = None

    @classmethod
    def of(cls, values: Sequence[float | None]) -> Stat:
        xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
        if not xs:
            return cls(math.nan, math.nan, 0)
        mean = statistics.fmean(xs)
        return cls(mean, statistics.pstdev(xs), len(xs), _t_interval(mean, xs))

    def format_ci(self, digits: int = 2) -> str:
        """`mean [lo, hi]`; a plain mean for one seed, "—" for none."""
        return self.format_ci_as(f"f{digits}")

    def format_ci_as(self, style: str) -> str:
        """`mean [lo, hi]` in `style` ("e": scientific, "fN": N decimals, as format_as)."""
        if self.n == 0:
            return "—"
        spec = ".2e" if style == "e" else f".{int(style[1:])}f"
        if self.ci is None:
            return f"{self.mean:{spec}}"
        return f"{self.mean:{spec}} [{self.ci[0]:{spec}}, {self.ci[1]:{spec}}]"

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


def _t_interval(mean: float, xs: Sequence[float]) -> tuple[float, float] | None:
    if len(xs) < 2:
        return None
    return t_interval(mean, statistics.stdev(xs) / math.sqrt(len(xs)), len(xs) - 1, CI_LEVEL)


@dataclass(frozen=True)
class AlgorithmSummary:
    label: str
    seeds: list[int]  # seeds that finished
    metrics: dict[str, Stat]  # SEED_METRICS → over seeds
    paper: dict[str, PaperValue]
    variance_by_round: list[tuple[int, float, float]]  # (round, mean, std) over seeds
    failed_seeds: list[int] = field(default_factory=list)
    accuracy_by_round: list[tuple[int, float, float]] = field(default_factory=list)  # (round, mean, std) over seeds


def summarize(
    label: str, runs: Sequence[SeedSummary], paper: dict[str, PaperValue] | None = None, failed: Sequence[int] = ()
) -> AlgorithmSummary:
    """Aggregate one algorithm's seeds: every metric as mean ± population std; variance and mean-accuracy curves per
    round (mean ± std over the seeds that evaluated that round)."""
    metrics = {k: Stat.of([r.final_fairness.get(k) for r in runs]) for k in FAIRNESS_COLUMNS}
    metrics.update({k: Stat.of([r.extra.get(k) for r in runs]) for k, _, _ in EXTRA_METRICS})
    metrics["wall_seconds"] = Stat.of([r.wall_seconds for r in runs])
    return AlgorithmSummary(
        label,
        sorted(r.seed for r in runs),
        metrics,
        dict(paper or {}),
        curve_over_seeds([r.variance_by_round for r in runs]),
        sorted(failed),
        curve_over_seeds([r.accuracy_by_round for r in runs]),
    )


def curve_over_seeds(curves: Sequence[Sequence[tuple[int, float]]]) -> list[tuple[int, float, float]]:
    """(round, mean, population std) over the seeds' (round, value) curves, at every round any seed has."""
    by_round: dict[int, list[float]] = {}
    for curve in curves:
        for rnd, value in curve:
            by_round.setdefault(rnd, []).append(value)
    return [(rnd, (s := Stat.of(v)).mean, s.std) for rnd, v in sorted(by_round.items())]


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
    reused: int = 0  # runs an earlier invocation finished (--resume), not run by this one

    @property
    def ok(self) -> bool:
        return not self.failures

    def claims(self) -> list[ClaimResult]:
        """Every claim of the comparison file, tested over the finished runs' seeds."""
        spec = self.spec
        planned = {run.label: len(run.seeds) for run in spec.runs}
        return [
            evaluate_claim(c, self.runs, lambda seed, c=c: spec.same_partition(c.run, str(c.than), seed), planned)
            for c in spec.claims
        ]

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
