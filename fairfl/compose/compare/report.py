"""The comparison report: Markdown table and page, CSV, JSON and three plots, built from a ComparisonResult."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fairfl.compose.compare.claims import ClaimResult
from fairfl.compose.compare.metrics import EXTRA_METRICS, SEED_METRICS
from fairfl.compose.compare.spec import PAPER_METRICS
from fairfl.compose.compare.summary import (
    AlgorithmSummary,
    ComparisonResult,
    SeedSummary,
    Stat,
)
from fairfl.compose.provenance import machine_description, revision_text, source_revision
from fairfl.compose.results import FAIRNESS_COLUMNS

# (key, column heading, decimals) of the Markdown table's measured columns.
TABLE_METRICS = (
    ("mean", "Mean acc (%)", 2),
    ("variance", "Variance (%²)", 2),
    ("std", "Std (%)", 2),
    ("worst_5", "Worst 5% (%)", 2),
    ("best_5", "Best 5% (%)", 2),
)


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


def _display_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


CLAIM_HEADINGS = (
    "Claim", "Tested as", "Test (n)", "Difference [interval]", "p (one-sided)", "Seeds the claimed way", "Verdict"
)  # fmt: skip


def claim_cells(c: dict[str, Any]) -> list[str]:
    """One claim's cells under CLAIM_HEADINGS, from its JSON form (ClaimResult.as_dict): the report's Claims table
    and docs/results/claims.md (scripts/results.py) print claims the same way."""
    times = "×" if c.get("scale") == "ratio" else ""  # a factor claim reports the ratio run / baseline
    diff = "—" if c["difference"] is None else f"{times}{c['difference']:.4g}"
    if c.get("ci"):
        diff += f" [{times}{c['ci'][0]:.4g}, {times}{c['ci'][1]:.4g}] ({c['ci_level']:.0%})"
    test = f"{c['test']} ({c['n']})" if c["test"] else "—"
    agreeing = "—" if c.get("agreeing_seeds") is None else f"{c['agreeing_seeds']}/{c['n']}"
    verdict = c["verdict"]
    verdict = ("**held**" if c["held"] else "**not held**") + verdict.removeprefix("held").removeprefix("not held")
    if c.get("censored_seeds") and c["test"]:  # tested: the censored seeds are the slower side's
        verdict += f"; {_plural(c['censored_seeds'], 'run')} never reached the target (counted at final round + 1)"
    return [c["claim"], f"`{c['statement']}`", test, diff, _p_text(c["p_value"]), agreeing, verdict]


def render_claims(claims: Sequence[ClaimResult]) -> str:
    """The claims table: each claim, its test, the difference with its interval, p and the verdict."""
    lines = ["| " + " | ".join(CLAIM_HEADINGS) + " |", "|---|---|---|---:|---:|---:|---|"]
    lines += ["| " + " | ".join(map(_cell, claim_cells(c.as_dict()))) + " |" for c in claims]
    return "\n".join(lines)


def _p_text(p: float | None) -> str:
    if p is None:
        return "—"
    return "< 1e-4" if p < 1e-4 else f"{p:.4f}"


def render_intervals(algorithms: Sequence[AlgorithmSummary]) -> str:
    """Mean over seeds with its 95% t-interval for the table's accuracy metrics and any extra metric present."""
    extras = [(k, h) for k, h, _ in EXTRA_METRICS if any(a.metrics[k].n for a in algorithms)]
    cols = [(k, h) for k, h, _ in TABLE_METRICS] + extras
    styles = {k: style for k, _, style in EXTRA_METRICS}
    lines = ["| Algorithm | Seeds | " + " | ".join(h for _, h in cols) + " |", "|---|---:|" + "---:|" * len(cols)]
    for a in algorithms:
        cells = [_interval_cell(a.metrics[k], styles.get(k, "f2"), len(a.seeds), k) for k, _ in cols]
        lines.append("| " + " | ".join([_cell(a.label), str(len(a.seeds)), *cells]) + " |")
    return "\n".join(lines)


def _interval_cell(stat: Stat, style: str, seeds: int, key: str) -> str:
    text = stat.format_ci_as(style)
    if key == "rounds_to_target" and 0 < stat.n < seeds:
        text += f" ({stat.n}/{seeds} seeds reached it)"
    return text


def render_markdown(
    result: ComparisonResult,
    command_line: str,
    machine: dict[str, Any] | None = None,
    revision: dict[str, Any] | None = None,
    claims: Sequence[ClaimResult] | None = None,
) -> str:
    """The report page; `claims`: the tested claims when the caller has them already (else tested here)."""
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
        f"- Date: {result.started.isoformat(timespec='seconds')} ({result.wall_seconds:.0f} s in all"
        + (
            f"; {result.reused} of {len(result.runs)} finished runs reused from an earlier invocation)"
            if result.reused
            else ")"
        ),
        f"- Machine: {hw}; Python {machine['python']}" + (f", torch {machine['torch']}" if "torch" in machine else ""),
        f"- Code: {_code_text(revision, result.runs)}",
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
            "a DP release). Ψ at the global model is the same over those clients' losses before their local steps "
            "(strategy metric `psi_before`, at the model the round started from). Ψ_test is Eq. 7 on the final global "
            "model: the variance of the clients' test losses, "
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
    algorithms = result.algorithms()
    lines += ["", render_table(algorithms, spec.target_accuracy)]
    if any(a.metrics["mean"].n > 1 for a in algorithms):
        lines += [
            "",
            "95% confidence intervals of the mean over seeds (t-distribution, sample std; one seed: no interval). "
            "Each metric in the main table's format (Ψ in scientific notation).",
            "",
            render_intervals(algorithms),
        ]
    if spec.claims:
        lines += ["", "## Claims", "", _CLAIMS_TEXT, "", render_claims(result.claims() if claims is None else claims)]
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


_CLAIMS_TEXT = (
    "Each claim of the comparison file, tested over seeds: d = run − baseline − margin per seed, a one-sided paired "
    "t-test when both runs have the same seeds on the same data partition, else Welch's t-test (the exact sign test "
    "when every seed gives the same difference). A claim holds when p < its alpha (0.05 unless the file says) and "
    "every planned seed of both runs finished. The difference is run − baseline, without the margin, with its "
    "1 − 2·alpha interval: the claim holds exactly when the interval's end on the claimed side lies beyond the margin. "
    "A claim with a factor F is a ratio (run < baseline / F, or > baseline × F), tested the same way on the logs of "
    "the values; its difference is the geometric-mean ratio run / baseline (×). "
    "For rounds to the target, a seed that never reached it counts as its final round + 1 (a seed where neither run "
    "reached it is no difference); a seed where the run the claim calls faster missed it and the other reached it "
    "makes the claim not held. Each claim is tested on its own, without a correction for testing several: with many "
    "claims, expect about one in twenty true-null ones to pass by chance."
)


def _code_text(revision: dict[str, Any] | None, runs: Sequence[SeedSummary]) -> str:
    """The commit that wrote the report and, when runs were resumed from another, which commits ran which runs."""
    text = f"report written by commit `{revision_text(revision)}`"
    by_commit: dict[str, int] = {}
    for r in runs:
        by_commit[r.revision or "unknown"] = by_commit.get(r.revision or "unknown", 0) + 1
    if set(by_commit) - {revision_text(revision)}:
        text += "; runs from " + ", ".join(f"`{c}` ({_plural(n, 'run')})" for c, n in sorted(by_commit.items()))
    return text


def _json_num(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else value


def report_dict(
    result: ComparisonResult,
    command_line: str,
    machine: dict[str, Any],
    revision: dict[str, Any] | None = None,
    claims: Sequence[ClaimResult] | None = None,
) -> dict[str, Any]:
    spec = result.spec
    return {
        "name": spec.name,
        "command": command_line,
        "date": result.started.isoformat(timespec="seconds"),
        "wall_seconds": round(result.wall_seconds, 3),
        "machine": machine,
        "revision": revision,
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
                    k: {
                        "mean": _json_num(s.mean),
                        "std": _json_num(s.std),
                        "n": s.n,
                        "ci95": [_json_num(x) for x in s.ci] if s.ci else None,
                    }
                    for k, s in a.metrics.items()
                },
                "paper": {k: {"value": v.value, "spread": v.spread} for k, v in a.paper.items()},
                "variance_by_round": [[r, _json_num(m), _json_num(s)] for r, m, s in a.variance_by_round],
                "accuracy_by_round": [[r, _json_num(m), _json_num(s)] for r, m, s in a.accuracy_by_round],
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
                "accuracy_by_round": r.accuracy_by_round,
                "revision": r.revision,
            }
            for r in result.runs
        ],
        "failures": [vars(f) for f in result.failures],
        "claims": [c.as_dict() for c in (result.claims() if claims is None else claims)],
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


def _plot_over_rounds(
    result: ComparisonResult,
    path: Path,
    curve: Callable[[AlgorithmSummary], list[tuple[int, float, float]]],
    ylabel: str,
    what: str,
) -> None:
    """One line per algorithm: the mean over its seeds at every evaluated round, a band of ± std over seeds."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7.0, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for a in result.algorithms():
        points = curve(a)
        if not points:
            continue
        rounds = [r for r, _, _ in points]
        mean = [m for _, m, _ in points]
        (line,) = ax.plot(rounds, mean, marker="o", markersize=3, label=f"{a.label} ({_plural(len(a.seeds), 'seed')})")
        if len(a.seeds) > 1:
            lo = [m - s for _, m, s in points]
            hi = [m + s for _, m, s in points]
            ax.fill_between(rounds, lo, hi, color=line.get_color(), alpha=0.15)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{result.spec.name}\n{what} per round, mean over seeds (band: ± std over seeds)", fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.savefig(path, dpi=120)


def plot_variance_over_rounds(result: ComparisonResult, path: Path) -> None:
    """Variance of client accuracy at every evaluated round, mean over seeds (band: ± std over seeds)."""
    _plot_over_rounds(
        result,
        path,
        lambda a: a.variance_by_round,
        "variance of client accuracy (%²)",
        "variance of client test accuracy",
    )


def plot_accuracy_over_rounds(result: ComparisonResult, path: Path) -> None:
    """Mean client accuracy at every evaluated round, mean over seeds (band: ± std over seeds)."""
    _plot_over_rounds(
        result, path, lambda a: a.accuracy_by_round, "mean client accuracy (%)", "mean client test accuracy"
    )


def write_report(result: ComparisonResult, output_dir: Path, command_line: str) -> str:
    """Write comparison.md/.csv/.json and the three plots; return the Markdown table and each claim's verdict."""
    output_dir.mkdir(parents=True, exist_ok=True)
    machine, revision = machine_description(), source_revision()
    algorithms = result.algorithms()
    claims = result.claims()
    (output_dir / "comparison.md").write_text(render_markdown(result, command_line, machine, revision, claims))
    (output_dir / "comparison.csv").write_text(render_csv(algorithms, result.runs))
    report = report_dict(result, command_line, machine, revision, claims)
    (output_dir / "comparison.json").write_text(json.dumps(report, indent=2, ensure_ascii=False))
    plot_accuracy_distribution(result, output_dir / "accuracy_distribution.png")
    plot_variance_over_rounds(result, output_dir / "variance_over_rounds.png")
    plot_accuracy_over_rounds(result, output_dir / "accuracy_over_rounds.png")
    table = render_table(algorithms, result.spec.target_accuracy)
    claims = report["claims"]
    if claims:
        table += "\n\nClaims:\n" + "\n".join(f"- {c['claim']}: {c['verdict']}" for c in claims)
    return table
