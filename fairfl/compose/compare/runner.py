"""Running a comparison: every (run, seed) is one `fairfl run` in its own subprocess, at most `jobs` at a time.

Each pair writes into <output>/<run slug>/seed<seed>/ (experiment.yaml, run.log and the run's results). With `resume`,
a pair whose directory already holds a finished run of the same experiment (results.json of a COMPLETED run, written by
the same transport, next to an experiment.yaml of the same computation: finished_before) is reused as it is; every
other pair runs again. An in-process pair checkpoints every round into <run dir>/checkpoint/ (removed once it
completes), so with `resume` a pair that was interrupted (Ctrl-C, a killed session) continues from its last completed
round (`fairfl run --resume`, bit-identical to an uninterrupted run) instead of starting over.

The `fairfl run` children run in their own sessions: a signal to the comparison (Ctrl-C) is passed on to each running
child by `RunningChildren.signal`, so every child stops its run in order (fairfl.compose.interrupt) and writes what it
finished, and no pair that has not started yet is started.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import IO

import yaml

from aggregator_service.checkpoint import CheckpointError
from fairfl.compose.compare.spec import ComparisonSpec, RunSpec
from fairfl.compose.compare.summary import ComparisonResult, RunFailure, SeedSummary
from fairfl.compose.provenance import PROVENANCE_FILE, descends_from, run_provenance, run_segments
from fairfl.compose.resume import resumable_run, running_elsewhere, same_experiment, unstated_fields
from fairfl.config import ExperimentConfig, experiment_from_yaml
from fairfl.cores import usable_cores

LOG_TAIL_LINES = 20
FINISHED_STATE = "RUN_STATE_COMPLETED"
LEGACY_REVISION_FILE = "revision.txt"  # a pair's commit before provenance.json recorded it
CHECKPOINT_DIR = "checkpoint"  # an in-process pair's checkpoints while it runs (runtime.checkpoint_dir)


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class RunningChildren:
    """The `fairfl run` subprocesses running now; `cancel` keeps new ones from starting."""

    def __init__(self) -> None:
        self.cancel = threading.Event()
        self._lock = threading.Lock()
        self._processes: set[subprocess.Popen[bytes]] = set()

    def start(self, cmd: list[str], log: IO[str], env: dict[str, str]) -> subprocess.Popen[bytes] | None:
        """Start one child (None when cancelled); the lock makes start and `signal` exclusive, so no child starts
        unseen by a signal being passed on."""
        with self._lock:
            if self.cancel.is_set():
                return None
            process = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            self._processes.add(process)
            return process

    def done(self, process: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._processes.discard(process)

    def signal(self, signum: int) -> None:
        """Start no more children and pass `signum` on to the running ones."""
        with self._lock:
            self.cancel.set()
            for process in self._processes:
                if process.poll() is None:
                    with contextlib.suppress(OSError):  # it ended meanwhile
                        process.send_signal(signum)

    def force(self, grace_s: float = 5.0) -> str | None:
        """A forced stop: pass SIGINT on again (each child forces its own way out, killing its processes and writing
        what it received), give them `grace_s`, then SIGKILL the rest; a note for the forced exit's line."""
        self.signal(signal.SIGINT)
        with self._lock:
            processes = list(self._processes)
        deadline = time.monotonic() + grace_s
        killed = 0
        for process in processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                killed += 1
        return f"killed {killed} fairfl run processes" if killed else None


def _run_dir(output_dir: Path, run: RunSpec, seed: int) -> Path:
    return output_dir / run.slug / f"seed{seed}"


def _revisions(run_dir: Path) -> list[tuple[str, int]]:
    """(commit, the round it went on after) of every invocation that ran the pair, from its provenance.json
    (revision.txt before that file existed); empty when none is recorded."""
    segments = run_segments(run_dir)
    try:
        if segments:
            first, *resumed = segments
            return [(str(first["revision"]), 0)] + [(str(r["revision"]), int(r["after_round"])) for r in resumed]
    except (KeyError, ValueError, TypeError):
        pass
    try:
        revision = (run_dir / LEGACY_REVISION_FILE).read_text().strip()
        return [(revision, 0)] if revision else []
    except OSError:  # a pair finished before revisions were recorded
        return []


def _revision_of(run_dir: Path) -> str | None:
    """The commit that ran the pair; a pair resumed at other commits names them all ("A, resumed after round 120 at
    B")."""
    revisions = _revisions(run_dir)
    if not revisions:
        return None
    text = revisions[0][0]
    for commit, after in revisions[1:]:
        if commit != revisions[0][0]:
            text += f", resumed after round {after} at {commit}"
    return text


def _ran_since(run_dir: Path, since: str | None) -> bool:
    """Whether every invocation that ran the pair ran at commit `since` or later (always, without `since`)."""
    if since is None:
        return True
    revisions = _revisions(run_dir)
    return bool(revisions) and all(descends_from(commit, since) for commit, _ in revisions)


def finished_before(
    spec: ComparisonSpec, run: RunSpec, seed: int, output_dir: Path, transport: str, since: str | None = None
) -> SeedSummary | None:
    """The pair's results from an earlier invocation when they can stand in for running it again: a COMPLETED run of
    the same experiment (its experiment.yaml states every field and computes the same; how it ran,
    resume.EXECUTION_FIELDS, may differ or be unstated), over the same transport, whose results.json the report can
    read (and, with `since`, that ran at that commit or a later one)."""
    run_dir = _run_dir(output_dir, run, seed)
    if not _ran_since(run_dir, since):
        return None
    try:
        text, config = (run_dir / "experiment.yaml").read_text(), spec.experiment(run, seed)
        if unstated_fields(yaml.safe_load(text), config) or not same_experiment(experiment_from_yaml(text), config):
            return None
        results = json.loads((run_dir / "results.json").read_text())
        if results.get("state") != FINISHED_STATE or results.get("transport") != transport:
            return None
        summary = SeedSummary.from_results(run.label, seed, results, str(run_dir), spec.target_accuracy)
        return dataclasses.replace(summary, revision=_revision_of(run_dir))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, yaml.YAMLError):  # missing, unreadable, not ours
        return None


def _run_one(
    spec: ComparisonSpec,
    run: RunSpec,
    seed: int,
    output_dir: Path,
    transport: str,
    children: RunningChildren | None = None,
    jobs: int = 1,
    resume: bool = False,
    since: str | None = None,
) -> SeedSummary | RunFailure | None:
    """One experiment in its own `fairfl run` subprocess, one of `jobs` at a time; its output goes to
    <run dir>/run.log (appended to when it continues an interrupted run, one that ran since `since`). None: cancelled
    before it started."""
    children = children or RunningChildren()
    if children.cancel.is_set():
        return None
    run_dir = _run_dir(output_dir, run, seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoints = run_dir / CHECKPOINT_DIR
    holder = running_elsewhere(checkpoints)
    if holder is not None:  # e.g. an orphaned child of a comparison that was killed: never two writers, never rmtree
        message = f"process {holder} is still running this pair (checkpoints in {checkpoints}/); stop it, then resume"
        return RunFailure(run.label, seed, 2, message, str(run_dir / "run.log"))
    (run_dir / "results.json").unlink(missing_ok=True)  # never read a previous invocation's results
    experiment = run_dir / "experiment.yaml"
    config = spec.experiment(run, seed)
    experiment.write_text(config.to_yaml())
    cmd = [sys.executable, "-m", "fairfl.compose", "run", str(experiment), "--transport", transport]
    cmd += ["--output", str(run_dir)]
    if transport == "inprocess" and jobs > 1 and config.runtime.inprocess_workers == "auto":
        # Each run's "auto" would take every core: `jobs` runs side by side share them instead (same results).
        cmd += ["--set", f"runtime.inprocess_workers={max(1, usable_cores() // jobs)}"]
    if transport == "inprocess":  # JSON quoting: YAML would read a '#' or ': ' in the path as syntax
        cmd += ["--set", f"runtime.checkpoint_dir={json.dumps(str(checkpoints))}"]
    resumable = resume and transport == "inprocess" and _ran_since(run_dir, since)
    interrupted = _interrupted(config, checkpoints) if resumable else None
    keep_log = interrupted is not None
    if interrupted is not None:
        print(
            f"[resume] {run.label} seed {seed}: continuing its interrupted run after round {interrupted} from "
            f"{checkpoints}/",
            flush=True,
        )
        code = _start([*cmd, "--resume"], run_dir, children, interrupted)
        if code == 2:  # its checkpoint cannot be resumed (the child said why, in the log): run it over
            print(f"[resume] {run.label} seed {seed}: could not resume (see its run.log); starting over", flush=True)
            interrupted = None
    if interrupted is None:
        shutil.rmtree(checkpoints, ignore_errors=True)  # an older experiment's: never mixed into a new run
        (run_dir / LEGACY_REVISION_FILE).unlink(missing_ok=True)  # an older run's commit: provenance.json has this one
        code = _start(cmd, run_dir, children, keep_log=keep_log)
    if code is None:
        return None
    log_path = run_dir / "run.log"
    if code != 0:
        return RunFailure(run.label, seed, code, _tail(log_path), str(log_path))
    shutil.rmtree(checkpoints, ignore_errors=True)  # completed: results.json and the model file are what is kept
    try:
        results = json.loads((run_dir / "results.json").read_text())
        summary = SeedSummary.from_results(run.label, seed, results, str(run_dir), spec.target_accuracy)
        return dataclasses.replace(summary, revision=_revision_of(run_dir))
    except (OSError, ValueError, KeyError) as err:
        return RunFailure(run.label, seed, code, f"unusable results.json: {err}\n{_tail(log_path)}", str(log_path))


def _start(
    cmd: list[str], run_dir: Path, children: RunningChildren, after_round: int | None = None, keep_log: bool = False
) -> int | None:
    """Run one `fairfl run` child to its end: its exit code (None: cancelled). A fresh run writes a new run.log
    (`keep_log`: appended, after a resume that failed) and provenance.json; continuing one (`after_round`) appends to
    both, so they keep the whole run's history."""
    provenance = run_provenance(time.time())
    path = run_dir / PROVENANCE_FILE
    if after_round is not None:
        try:
            earlier = json.loads(path.read_text())
            earlier.setdefault("resumed", []).append({**provenance, "after_round": after_round})
            provenance = earlier
        except (OSError, ValueError, AttributeError):  # none or unreadable: this invocation's stands alone
            pass
    path.write_text(json.dumps(provenance, indent=2) + "\n")
    repo_root = str(Path(__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo_root, os.environ.get("PYTHONPATH")]))}
    with (run_dir / "run.log").open("a" if after_round is not None or keep_log else "w") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        process = children.start(cmd, log, env)
        if process is None:
            return None
        try:
            return process.wait()
        finally:
            children.done(process)


def _interrupted(config: ExperimentConfig, checkpoints: Path) -> int | None:
    """The last completed round of an interrupted (or crashed) run of this experiment in `checkpoints`, else None (a
    failed run is run over, not resumed: its failure would most likely repeat)."""
    try:
        at = dataclasses.replace(config.runtime, checkpoint_dir=str(checkpoints))
        loaded = resumable_run(dataclasses.replace(config, runtime=at), failed=False)
    except (CheckpointError, OSError, ValueError):  # unreadable: not resumed, the pair runs again from the start
        return None
    return None if loaded is None else loaded.checkpoint.round


def run_comparison(
    spec: ComparisonSpec,
    output_dir: Path,
    jobs: int | None = None,
    transport: str | None = None,
    *,
    resume: bool = False,
    since: str | None = None,
    children: RunningChildren | None = None,
) -> ComparisonResult:
    """Run every (run, seed) of the spec, at most `jobs` at a time; a failure is recorded, the others still finish.
    `resume`: reuse the pairs an earlier invocation finished in `output_dir` (finished_before; with `since`, only
    those that ran at that commit or later). `children`: the running subprocesses, for a caller that passes signals
    on (RunningChildren.signal); pairs it cancelled before they started are neither runs nor failures of the result."""
    jobs = jobs or spec.jobs
    transport = transport or spec.transport
    children = children or RunningChildren()
    output_dir.mkdir(parents=True, exist_ok=True)
    pairs = [(run, seed) for run in spec.runs for seed in run.seeds]
    reused: dict[tuple[str, int], SeedSummary] = {}
    if resume:
        for run, seed in pairs:
            previous = finished_before(spec, run, seed, output_dir, transport, since)
            if previous is not None:
                reused[(run.label, seed)] = previous
    work = [(run, seed) for run, seed in pairs if (run.label, seed) not in reused]
    started, t0 = datetime.now().astimezone(), time.monotonic()
    lock = threading.Lock()
    done = 0

    def task(item: tuple[RunSpec, int]) -> SeedSummary | RunFailure | None:
        nonlocal done
        run, seed = item
        t = time.monotonic()
        outcome = _run_one(spec, run, seed, output_dir, transport, children, jobs, resume, since)
        if outcome is None:
            return None
        with lock:
            done += 1
            if isinstance(outcome, SeedSummary):
                acc = outcome.final_fairness.get("mean")
                what = f"ok in {time.monotonic() - t:.1f}s, mean acc {acc:.2f}%" if acc is not None else "ok"
            elif outcome.exit_code == 130:
                what = f"interrupted; log {outcome.log_path}"
            else:
                what = f"FAILED (exit {outcome.exit_code}); log {outcome.log_path}"
            print(f"[{done}/{len(work)}] {run.label} seed {seed}: {what}", flush=True)
        return outcome

    plan = f"{len(pairs)} runs"
    if resume:
        plan += f", {len(reused)} finished before (reused), {len(work)} to run"
    print(f"comparison {spec.name}: {plan}, {jobs} at a time, transport {transport}, in {output_dir}/", flush=True)
    for run, seed in pairs:
        if (run.label, seed) in reused:
            print(f"[resume] {run.label} seed {seed}: finished before, reused", flush=True)
    outcomes: dict[tuple[str, int], SeedSummary | RunFailure | None] = dict(reused)
    if work:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for (run, seed), outcome in zip(work, pool.map(task, work), strict=True):
                outcomes[(run.label, seed)] = outcome
    ordered = [outcomes.get((run.label, seed)) for run, seed in pairs]  # spec order, whichever ran when
    return ComparisonResult(
        spec=spec,
        output_dir=output_dir,
        jobs=jobs,
        transport=transport,
        runs=[o for o in ordered if isinstance(o, SeedSummary)],
        failures=[o for o in ordered if isinstance(o, RunFailure)],
        started=started,
        wall_seconds=time.monotonic() - t0,
        reused=len(reused),
    )
