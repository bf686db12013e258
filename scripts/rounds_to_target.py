"""Rounds to several accuracy targets, per run and seed of a comparison folder (issue #22).

    python scripts/rounds_to_target.py docs/results/hicsfl-fmnist-setting2-cnn --targets 50,60,65,75

A comparison tests rounds to one target (its file's target_accuracy). When no run reaches it, this shows where the
runs did get to: for every run directory below FOLDER (one holding a results.json), the first evaluated round whose mean
client accuracy reached each target (the comparison's own rule, fairfl.compose.compare.summary.rounds_to_target) and
the best mean accuracy of any evaluated round; then, per run label, the mean over the seeds that reached each target
and how many did. Markdown on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fairfl.compose.compare.summary import rounds_to_target


def parse_targets(text: str) -> list[float]:
    try:
        targets = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated accuracies in %, e.g. 50,60,75; got {text!r}"
        ) from None
    if not targets or any(not 0 < t <= 100 for t in targets):
        raise argparse.ArgumentTypeError(f"targets are accuracies in % in (0, 100]; got {text!r}")
    return targets


def run_rows(folder: Path, targets: list[float]) -> list[tuple[str, str, list[int | None], float]]:
    """(run, seed directory, rounds to each target, best accuracy) of every results.json below `folder`."""
    rows = []
    for path in sorted(folder.glob("**/results.json")):
        rounds = json.loads(path.read_text()).get("rounds") or []
        evaluated = [r for r in rounds if "fairness" in r]
        if not evaluated:
            continue
        best = max(float(r["fairness"].get("mean", 0.0)) for r in evaluated)
        run_dir = path.parent
        run = run_dir.parent.name if run_dir.name.startswith("seed") else run_dir.name
        rows.append((run, run_dir.name, [rounds_to_target(evaluated, t) for t in targets], best))
    return rows


def render(rows: list[tuple[str, str, list[int | None], float]], targets: list[float]) -> str:
    heads = [f"{t:g}%" for t in targets]
    lines = [
        "| run | seed | " + " | ".join(f"rounds to {h}" for h in heads) + " | best accuracy (%) |",
        "|---|---|" + "---:|" * (len(targets) + 1),
    ]
    for run, seed, reached, best in rows:
        cells = ["—" if r is None else str(r) for r in reached]
        lines.append(f"| {run} | {seed} | " + " | ".join(cells) + f" | {best:.1f} |")
    lines += ["", "| run | seeds | " + " | ".join(f"rounds to {h}, mean (reached)" for h in heads) + " |"]
    lines.append("|---|---:|" + "---:|" * len(targets))
    for run in dict.fromkeys(r[0] for r in rows):
        mine = [r for r in rows if r[0] == run]
        cells = []
        for i in range(len(targets)):
            got = [r[2][i] for r in mine if r[2][i] is not None]
            cells.append(f"{statistics.fmean(got):.1f} ({len(got)}/{len(mine)})" if got else f"— (0/{len(mine)})")
        lines.append(f"| {run} | {len(mine)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="a comparison's output folder (or any folder of run directories)")
    parser.add_argument("--targets", type=parse_targets, default=[50.0, 60.0, 70.0, 75.0], help="default 50,60,70,75")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        parser.error(f"{args.folder}: not a directory")
    rows = run_rows(args.folder, args.targets)
    if not rows:
        parser.error(f"{args.folder}: no results.json with evaluated rounds below it")
    print(render(rows, args.targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
