"""Re-run every committed result into its docs/results folder and index the claims they test (`make results`).

    python scripts/results.py                          # everything in docs/results/results.yaml (hours on 2 cores)
    python scripts/results.py --only hicsfl-fmnist-setting2,fedfdp-fmnist-small
    python scripts/results.py --list                   # what would run, and how many runs each has
    python scripts/results.py --list --since COMMIT    # and how many of them already ran at COMMIT or later
    python scripts/results.py --index                  # only rewrite docs/results/claims.md from the folders
    python scripts/results.py --verify                 # does this checkout still make the committed results?

Each entry of the manifest is a comparison (`fairfl compare FILE --output docs/results/NAME --resume`) or a single
run (`fairfl run FILE --output docs/results/NAME`, with provenance.json beside its results). Comparisons resume: a
(run, seed) that an earlier invocation finished with the identical experiment is kept, so a long re-measurement can be
spread over several invocations, and the report lists which commit ran which runs. Folders of runs no longer in a
comparison file are removed. The code must be committed (results record the commit that ran them): a checkout with
uncommitted changes outside docs/ and runs/ is refused unless --allow-dirty, and then the results say "+dirty".

`--verify` re-runs one committed run of each comparison (the first that ran on no machine with a GPU) from this
checkout into runs/verify/ and compares its final model's sha256 with the committed one: "reproduced" means the
committed numbers are what this code makes, bit for bit. A comparison whose file now makes another experiment is
skipped with the reason; a single-run entry is re-run whole by `make results`, not verified. "differs elsewhere": the
committed run was made with another torch (other bits are then no sign of a code change). Exits 1 when a run differs
or fails.

Ctrl-C stops the running comparison the way `fairfl compare` does (finished runs are kept) and exits 130.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fairfl.compose.compare import ComparisonSpec, RunSpec, load_comparison  # noqa: E402
from fairfl.compose.compare.report import CLAIM_HEADINGS, claim_cells  # noqa: E402
from fairfl.compose.compare.runner import FINISHED_STATE, finished_before  # noqa: E402
from fairfl.compose.provenance import (  # noqa: E402
    descends_from,
    resolve_commit,
    revision_text,
    run_provenance,
    run_segments,
    source_revision,
)
from fairfl.config import ConfigError, load_experiment  # noqa: E402
from fairfl.schema import expect_mapping  # noqa: E402

RESULTS = Path("docs/results")
MANIFEST = RESULTS / "results.yaml"
INDEX = RESULTS / "claims.md"
STOPPED_BY_SIGNAL = (130, 143)  # SIGINT, SIGTERM as 128 + n
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")  # a folder directly under docs/results: never "." or ".."
_ENTRY_KEYS = ("name", "compare", "run", "jobs", "transport", "set")


@dataclass(frozen=True)
class Entry:
    """One result folder: docs/results/<name>, written by a comparison file or by one experiment's run."""

    name: str
    compare: str | None = None
    run: str | None = None
    jobs: int | None = None
    transport: str | None = None
    overrides: tuple[tuple[str, Any], ...] = ()

    @property
    def output(self) -> Path:
        return RESULTS / self.name

    def command(self, since: str | None = None) -> list[str]:
        if self.compare:
            cmd = ["fairfl", "compare", self.compare, "--output", str(self.output)]
            cmd += ["--jobs", str(self.jobs)] if self.jobs else []
            cmd += ["--transport", self.transport] if self.transport else []
            return [*cmd, "--resume", *(["--since", since] if since else [])]
        cmd = ["fairfl", "run", str(self.run), "--output", str(self.output)]
        cmd += ["--transport", self.transport] if self.transport else []
        for key, value in self.overrides:
            cmd += ["--set", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
        return cmd


def load_manifest(path: Path) -> list[Entry]:
    """The manifest, validated: every entry's file exists and loads, names are unique folder names."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: {err}") from None
    if not isinstance(data, list) or not data:
        raise ConfigError(f"{path}: expected a list of entries, each with name and compare (or run)")
    entries, names = [], set()
    for i, raw in enumerate(data):
        where = f"{path}[{i}]"
        raw = expect_mapping(raw, _ENTRY_KEYS, where)
        name = raw.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name) or name in names:
            raise ConfigError(
                f"{where}.name: expected a unique folder name under {RESULTS} (lower-case letters, digits, '.', '_', "
                f"'-'), got {name!r}"
            )
        names.add(name)
        if ("compare" in raw) == ("run" in raw):
            raise ConfigError(f"{where}: give exactly one of compare (a comparison file) or run (an experiment)")
        overrides = raw.get("set") or {}
        if not isinstance(overrides, dict) or (overrides and "compare" in raw):
            raise ConfigError(f"{where}.set: overrides of a run entry, as a mapping (a comparison has its own)")
        entry = Entry(
            name, raw.get("compare"), raw.get("run"), raw.get("jobs"), raw.get("transport"), tuple(overrides.items())
        )
        try:
            if entry.compare:
                load_comparison(entry.compare)
            else:
                load_experiment(str(entry.run), dict(overrides))
        except ConfigError as err:
            raise ConfigError(f"{where} ({name}): {err}") from None
        entries.append(entry)
    return entries


def prune(entry: Entry) -> list[Path]:
    """Remove run folders of a comparison's output that its file no longer has (old labels, dropped seeds)."""
    if not entry.compare or not entry.output.is_dir():
        return []
    if entry.output.resolve().parent != RESULTS.resolve():  # load_manifest's names make this hold; never delete above
        raise ValueError(f"{entry.output} is not a folder directly under {RESULTS}")
    spec = load_comparison(entry.compare)
    wanted = {run.slug: {f"seed{s}" for s in run.seeds} for run in spec.runs}
    removed = []
    for child in sorted(p for p in entry.output.iterdir() if p.is_dir()):
        seeds = wanted.get(child.name)
        stale = [child] if seeds is None else [p for p in child.iterdir() if p.is_dir() and p.name not in seeds]
        for path in stale:
            shutil.rmtree(path)
            removed.append(path)
    return removed


def ran_since(entry: Entry, since: str | None) -> bool:
    """Whether a run entry's folder holds a successful run of its command at commit `since` or later."""
    if since is None or entry.compare:
        return False
    try:
        record = json.loads((entry.output / "provenance.json").read_text())
    except (OSError, ValueError):
        return False
    same = record.get("command") == shlex.join(entry.command())
    return same and record.get("exit_code") == 0 and descends_from(record.get("revision"), since)


@dataclass(frozen=True)
class Progress:
    """How far a re-measurement from commit `since` has come in one entry, to plan the sessions that remain: its runs,
    how many already ran at that commit or later, and for the rest what their last finished runs took (run time, and
    how many of those ran partly on a GPU). A run interrupted or killed last time has no finished time to go by."""

    runs: int
    current: int
    finished: int  # of the runs still to do, those whose folder holds a finished earlier run
    finished_seconds: float
    finished_on_gpu: int

    def describe(self, since: str) -> str:
        text = f"{self.current} ran at {since[:12]} or later"
        if self.current == self.runs:
            return text + ": done"
        todo = self.runs - self.current
        text += f", {todo} to run"
        if self.finished:
            gpu = f", {self.finished_on_gpu} of them partly on a GPU" if self.finished_on_gpu else ""
            text += f" ({self.finished} finished before in {self.finished_seconds / 3600:.2f} h of run time{gpu}"
            text += f"; {todo - self.finished} never finished)" if todo > self.finished else ")"
        return text


def progress(entry: Entry, since: str) -> Progress:
    """An entry's Progress since commit `since`, read from its folder (fairfl compare's own reuse rule decides which
    pairs count as current)."""
    if entry.run:
        folders, current = [entry.output], [ran_since(entry, since)]
    else:
        spec = load_comparison(entry.compare)
        transport = entry.transport or spec.transport
        pairs = [(run, seed) for run in spec.runs for seed in run.seeds]
        folders = [entry.output / run.slug / f"seed{seed}" for run, seed in pairs]
        current = [finished_before(spec, run, seed, entry.output, transport, since) is not None for run, seed in pairs]
    costs = [_finished_run_cost(folder) for folder, done in zip(folders, current, strict=True) if not done]
    finished = [cost for cost in costs if cost is not None]
    seconds = sum(taken for taken, _ in finished)
    return Progress(len(folders), sum(current), len(finished), seconds, sum(gpu for _, gpu in finished))


def _finished_run_cost(folder: Path) -> tuple[float, bool] | None:
    """The run time of the finished run a folder holds (a comparison pair's results.json, or a run entry's
    provenance.json) and whether any of its segments ran on a GPU; None when it holds none (never run, interrupted,
    failed)."""
    provenance, results = (_read_json(folder / name) for name in ("provenance.json", "results.json"))
    if results.get("state") == FINISHED_STATE:
        seconds = results.get("wall_seconds")
    elif provenance.get("exit_code") == 0:
        seconds = provenance.get("wall_seconds")
    else:
        return None
    if not isinstance(seconds, int | float):
        return None
    segments = run_segments(folder)
    return float(seconds), any(isinstance(s.get("machine"), dict) and s["machine"].get("cuda") for s in segments)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def run_entry(entry: Entry, since: str | None = None) -> int:
    """Run one entry as its own process (its Ctrl-C handling is fairfl's); the exit status. With `since`, reuse what
    ran at that commit or later (a comparison's pairs, or a run entry's whole run)."""
    for path in prune(entry):
        print(f"removed {path} (no longer in {entry.compare})", flush=True)
    if ran_since(entry, since):
        print(f"\n=== {entry.name}: ran at or after {since[:12]} before, reused", flush=True)
        return 0
    cmd = entry.command(since)
    print(f"\n=== {entry.name}: {shlex.join(cmd)}", flush=True)
    argv = [sys.executable, "-m", "fairfl.compose", *cmd[1:]]
    if entry.run:
        entry.output.mkdir(parents=True, exist_ok=True)
        record = {"command": shlex.join(cmd), **run_provenance(time.time())}
        started = time.monotonic()
        with (entry.output / "console.log").open("w") as log:
            code = _call(argv, stdout=log, stderr=subprocess.STDOUT)
        print((entry.output / "console.log").read_text()[-2000:], flush=True)
        record.update(exit_code=code, wall_seconds=round(time.monotonic() - started, 1))
        (entry.output / "provenance.json").write_text(json.dumps(record, indent=2) + "\n")
        return code
    return _call(argv)


@dataclass(frozen=True)
class Verdict:
    """What `--verify` found for one entry."""

    entry: str
    pair: str  # "label seed N", or "" when nothing was re-run
    outcome: str  # "reproduced", "differs", "failed", "skipped", "interrupted"
    detail: str


def verify(entry: Entry, scratch: Path) -> Verdict:
    """Re-run one committed run of a comparison entry (the first, in the file's order, that has its final model's
    sha256 and ran on no machine with a GPU) into `scratch` and compare the final model's sha256 with the committed
    run's."""
    if not entry.compare:
        return Verdict(entry.name, "", "skipped", f"a single run: `make results RESULTS_ONLY={entry.name}` re-runs it")
    spec = load_comparison(entry.compare)
    found = _committed_cpu_run(entry, spec)
    if isinstance(found, Verdict):
        return found
    run, seed, committed = found
    pair, committed_dir = f"{run.label} seed {seed}", entry.output / run.slug / f"seed{seed}"
    try:  # loaded, so the comparison is by value, in today's schema (its defaults filled in)
        committed_yaml = load_experiment(str(committed_dir / "experiment.yaml"), {}).to_yaml()
    except ConfigError as err:
        return Verdict(entry.name, pair, "skipped", f"its experiment.yaml no longer loads: {err}")
    if spec.experiment(run, seed).to_yaml() != committed_yaml:
        return Verdict(
            entry.name, pair, "skipped", f"{entry.compare} now makes another experiment than the committed run's"
        )
    out = (scratch / entry.name / run.slug / f"seed{seed}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "experiment.yaml").write_text(committed_yaml)
    transport = entry.transport or spec.transport
    argv = [sys.executable, "-m", "fairfl.compose", "run", str(out / "experiment.yaml"), "--transport", transport]
    argv += ["--output", str(out)]
    if transport == "inprocess":
        argv += ["--set", f"runtime.checkpoint_dir={json.dumps(str(out / 'checkpoint'))}"]
    print(f"\n=== {entry.name}: {pair} again, into {out}", flush=True)
    with (out / "run.log").open("w") as log:
        code = _call(argv, stdout=log, stderr=subprocess.STDOUT)
    if code in STOPPED_BY_SIGNAL:
        return Verdict(entry.name, pair, "interrupted", f"stopped; its log: {out / 'run.log'}")
    try:
        now = str(json.loads((out / "results.json").read_text())["final_model_sha256"]) if code == 0 else None
    except (OSError, ValueError, KeyError, TypeError):
        now = None
    if now is None:
        return Verdict(entry.name, pair, "failed", f"exit status {code}; its log: {out / 'run.log'}")
    if now == committed:
        return Verdict(entry.name, pair, "reproduced", f"final model sha256 {now[:16]}… as committed")
    detail = f"final model sha256 {now[:16]}…, committed {committed[:16]}…"
    then = sorted(
        {str(p["machine"].get("torch")) for p in run_segments(committed_dir) if isinstance(p.get("machine"), dict)}
    )
    here = str(run_provenance(time.time())["machine"].get("torch"))
    if then and then != [here]:  # another torch may compute other bits: not this code's doing
        return Verdict(
            entry.name, pair, "differs elsewhere", f"{detail}; committed with torch {', '.join(then)}, here {here}"
        )
    return Verdict(entry.name, pair, "differs", detail)


def _committed_cpu_run(entry: Entry, spec: ComparisonSpec) -> tuple[RunSpec, int, str] | Verdict:
    """The first (run, seed, committed sha256) of the comparison that was committed with its final model's sha256 and
    ran on no machine with a GPU (a GPU's kernels give other bits elsewhere), or the Verdict saying why none."""
    gpus: set[str] = set()
    for run in spec.runs:
        for seed in run.seeds:
            run_dir = entry.output / run.slug / f"seed{seed}"
            try:
                committed = str(json.loads((run_dir / "results.json").read_text())["final_model_sha256"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            on_gpu = {str(p["machine"]["cuda"]) for p in run_segments(run_dir) if _cuda(p)}
            if not on_gpu:
                return run, seed, committed
            gpus |= on_gpu
    if gpus:
        return Verdict(
            entry.name, "", "skipped", f"every committed run ran on a machine with {', '.join(sorted(gpus))}"
        )
    return Verdict(entry.name, "", "skipped", f"no committed run with its final model's sha256 under {entry.output}")


def _cuda(provenance: dict[str, Any]) -> bool:
    machine = provenance.get("machine")
    return isinstance(machine, dict) and bool(machine.get("cuda"))


def render_verdicts(verdicts: list[Verdict], revision: str) -> str:
    lines = [f"verified at {revision}:", "", "| result | run | outcome | detail |", "|---|---|---|---|"]
    lines += [f"| {v.entry} | {v.pair or '—'} | {v.outcome} | {v.detail} |" for v in verdicts]
    return "\n".join(lines) + "\n"


def _call(argv: list[str], **kwargs: Any) -> int:
    """Run a fairfl command in its own session and pass each SIGINT/SIGTERM on to it once, so fairfl stops the way it
    does at a terminal (a first signal ends the run in order, a second forces) and this script waits for it."""
    process = subprocess.Popen(argv, cwd=REPO, start_new_session=True, **kwargs)

    def forward(signum: int, _frame: Any) -> None:
        if process.poll() is None:
            process.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        code = process.wait()
        return 128 - code if code < 0 else code  # killed by signal n: the shell's 128 + n, never "success"
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def render_index(entries: list[Entry]) -> str:
    """docs/results/claims.md: every comparison's claims, held or not, from its comparison.json."""
    lines = [
        "# What holds where",
        "",
        "Every claim the committed comparisons test, as their reports state it (generated by "
        "`python scripts/results.py --index` from each folder's comparison.json; `make results` re-runs them). A claim "
        "holds when its one-sided test over seeds gives p below its alpha (0.05 unless its file says) and every "
        "planned seed finished; each folder's comparison.md says how it was tested.",
        "",
        "| Result | " + " | ".join(CLAIM_HEADINGS) + " | Commit |",
        "|---|---|---|---|---:|---:|---:|---|---|",
    ]
    for entry in entries:
        report_path = entry.output / "comparison.json"
        if not entry.compare or not report_path.is_file():
            continue
        report = json.loads(report_path.read_text())
        commits = sorted({r.get("revision") or "unknown" for r in report.get("runs", [])})
        commit = ", ".join(c[:10] + ("+dirty" if c.endswith("+dirty") else "") for c in commits)
        for c in report.get("claims", []):
            cells = [f"[{entry.name}]({entry.name}/comparison.md)", *claim_cells(c), commit]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated entry names (default: all)")
    parser.add_argument("--list", action="store_true", help="list the entries and exit")
    parser.add_argument("--index", action="store_true", help="only rewrite docs/results/claims.md")
    parser.add_argument("--allow-dirty", action="store_true", help="run from a checkout with uncommitted changes")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="re-run one committed run of each comparison into runs/verify/ and compare final models' sha256 (exit 1 "
        "when one differs)",
    )
    parser.add_argument(
        "--since",
        metavar="COMMIT",
        help="reuse only results that ran at COMMIT or a later commit (every other run runs again); default: reuse "
        "every finished run of the same experiment. With --list: how many runs of each entry ran at COMMIT or later",
    )
    args = parser.parse_args(argv)
    os.chdir(REPO)  # the manifest's paths, and the ones reports print, are relative to the repository
    try:
        entries = load_manifest(MANIFEST)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    chosen = entries
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in {e.name for e in entries}]
        if unknown:
            print(
                f"error: --only: unknown entry {unknown[0]!r}; entries: {', '.join(e.name for e in entries)}",
                file=sys.stderr,
            )
            return 2
        chosen = [e for e in entries if e.name in names]
    since = None
    if args.since:
        try:
            since = resolve_commit(args.since)
        except ValueError as err:
            print(f"error: --since: {err}", file=sys.stderr)
            return 2
    if args.list:
        for e in chosen:
            size = sum(len(r.seeds) for r in load_comparison(e.compare).runs) if e.compare else 1
            state = f"; {progress(e, since).describe(since)}" if since else ""
            print(f"{e.name}: {size} run(s){state}: {shlex.join(e.command())}")
        return 0
    if args.verify:
        return run_verification(chosen)
    worst = 0
    if not args.index:
        revision = source_revision()
        if revision is None or (revision["dirty"] and not args.allow_dirty):
            why = "not a git checkout" if revision is None else "uncommitted changes outside docs/ and runs/"
            print(
                f"error: {why}: results record the commit that ran them; commit first, or pass --allow-dirty",
                file=sys.stderr,
            )
            return 2
        print(f"re-running {len(chosen)} result(s) at {revision_text(revision)}", flush=True)
        for entry in chosen:
            code = run_entry(entry, since)
            if code in STOPPED_BY_SIGNAL:
                print(f"interrupted in {entry.name}; run the same command again to go on", file=sys.stderr)
                return code
            worst = max(worst, code)
    INDEX.write_text(render_index(entries))
    print(f"wrote {INDEX}")
    return worst


def run_verification(entries: list[Entry]) -> int:
    revision = source_revision()
    at = revision_text(revision) if revision is not None else "a checkout without git"
    parent = Path("runs") / "verify"
    parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=parent))  # never another call's
    print(f"verifying {len(entries)} result(s) at {at}: one committed run each, again, into {scratch}/", flush=True)
    verdicts = []
    for entry in entries:
        verdict = verify(entry, scratch)
        print(f"{entry.name}: {verdict.outcome}: {verdict.pair + ': ' if verdict.pair else ''}{verdict.detail}")
        verdicts.append(verdict)
        if verdict.outcome == "interrupted":
            break
    print("\n" + render_verdicts(verdicts, at), end="")
    if any(v.outcome == "interrupted" for v in verdicts):
        return 130
    return 1 if any(v.outcome in ("differs", "failed") for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
