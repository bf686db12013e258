"""`fairfl compare` on the command line: parse, run the comparison, write the report."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from fairfl.compose.compare.report import write_report
from fairfl.compose.compare.runner import run_comparison
from fairfl.compose.compare.spec import TRANSPORTS, int_at_least, load_comparison, slugify
from fairfl.config import ConfigError


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
            int_at_least(args.jobs, 1, "--jobs")
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
