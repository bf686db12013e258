"""`fairfl compare` on the command line: parse, run the comparison, write the report."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from fairfl.compose.compare.report import write_report
from fairfl.compose.compare.runner import RunningChildren, run_comparison
from fairfl.compose.compare.spec import TRANSPORTS, int_at_least, load_comparison, slugify
from fairfl.compose.interrupt import EXIT_INTERRUPTED, STOP_WAIT_S, Interrupted, Interrupts
from fairfl.compose.provenance import resolve_commit
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
    if getattr(args, "resume", False):
        parts.append("--resume")
    if getattr(args, "since", None):
        parts += ["--since", args.since]
    return shlex.join(parts)


DEFAULT_PARENT = Path("runs")


def _latest_output(name: str) -> Path | None:
    """The newest default report directory of comparison `name` (runs/compare-<name>-<timestamp>), for --resume."""
    found = sorted(p for p in DEFAULT_PARENT.glob(f"compare-{slugify(name)}-*") if p.is_dir())
    return found[-1] if found else None


def cmd_compare(args: argparse.Namespace) -> int:
    """`fairfl compare`: the first SIGINT/SIGTERM starts no further run, passes the signal on to the running ones (each
    stops its run and writes what it finished), writes the report of the finished runs and exits 130 saying how to
    resume; a second one forces (fairfl.compose.interrupt)."""
    # The children get their own STOP_WAIT_S to end their runs: the comparison waits for them a little longer.
    with Interrupts(stop_wait_s=STOP_WAIT_S + 15) as interrupts:
        try:
            return _compare(args, interrupts)
        except Interrupted as err:
            print(f"\n{err.signal_name}: interrupted before any run started", file=sys.stderr)
            return EXIT_INTERRUPTED


def _compare(args: argparse.Namespace, interrupts: Interrupts) -> int:
    try:
        spec = load_comparison(args.comparison, rounds=args.rounds, seeds=args.seeds)
        if args.jobs is not None:
            int_at_least(args.jobs, 1, "--jobs")
    except ConfigError as err:
        print(f"error: {args.comparison}: {err}", file=sys.stderr)
        return 2
    since = None
    if args.since is not None:
        if not args.resume:
            print("error: --since picks which finished runs --resume reuses: give it with --resume", file=sys.stderr)
            return 2
        try:
            since = resolve_commit(args.since)
        except ValueError as err:
            print(f"error: --since: {err}", file=sys.stderr)
            return 2
    if args.output:
        output_dir = Path(args.output)
    elif args.resume:
        latest = _latest_output(spec.name)
        if latest is None:
            print(
                f"error: --resume: no earlier report of {spec.name!r} in {DEFAULT_PARENT}/; name its directory with "
                "--output",
                file=sys.stderr,
            )
            return 2
        output_dir = latest
        args.output = str(output_dir)  # the report's command line names the directory it resumed
    else:
        output_dir = DEFAULT_PARENT / f"compare-{slugify(spec.name)}-{time.strftime('%Y%m%d-%H%M%S')}"
    children = RunningChildren()
    interrupts.running(lambda: children.signal(_signal_number(interrupts.signal_name)))
    interrupts.on_force(children.force)
    result = run_comparison(
        spec, output_dir, args.jobs, args.transport, resume=args.resume, since=since, children=children
    )
    interrupts.run_ended()
    table = write_report(result, output_dir, command_line(args))
    print()
    print(table)
    for f in result.failures:
        if f.exit_code != EXIT_INTERRUPTED:
            print(f"\nFAILED: {f.label} seed {f.seed}, exit code {f.exit_code}; log {f.log_path}:\n{f.log_tail}")
    total = sum(len(run.seeds) for run in spec.runs)
    print(f"\n{len(result.runs)} of {total} runs finished; report in {output_dir}/")
    if interrupts.interrupted:
        again = command_line(argparse.Namespace(**{**vars(args), "output": str(output_dir), "resume": True}))
        print(f"{interrupts.signal_name}: interrupted; to run the rest: {again}", flush=True)
        return EXIT_INTERRUPTED
    return 0 if result.ok else 1


def _signal_number(name: str | None) -> int:
    import signal

    return int(signal.Signals[name]) if name else int(signal.SIGINT)


def add_compare_parser(sub: Any) -> None:
    """Register `fairfl compare` on the CLI's subparsers."""
    p = sub.add_parser("compare", help="run algorithms × seeds from a comparison YAML and write a comparison report")
    p.add_argument("comparison", help="comparison YAML (base experiment, runs, seeds, paper numbers)")
    p.add_argument("--jobs", type=int, help="runs at a time (default: the file's jobs, else 1)")
    p.add_argument("--transport", choices=list(TRANSPORTS), help="default: the file's transport, else inprocess")
    p.add_argument("--output", help="report directory (default: runs/compare-<name>-<timestamp>)")
    p.add_argument("--rounds", type=int, help="override the number of rounds of every run")
    p.add_argument("--seeds", type=_seed_list, help="comma-separated seeds for every run, e.g. 0,1,2")
    p.add_argument(
        "--resume",
        action="store_true",
        help="reuse the (run, seed) pairs an earlier invocation finished in the output directory (--output, default: "
        "the newest runs/compare-<name>-*) and run only the others",
    )
    p.add_argument(
        "--since",
        metavar="COMMIT",
        help="with --resume: reuse only the pairs that ran at COMMIT or a later commit (e.g. the one that changed how "
        "results are computed); older ones run again",
    )
    p.set_defaults(func=cmd_compare)
