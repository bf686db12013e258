"""Running a comparison: every (run, seed) is one `fairfl run` in its own subprocess, at most `jobs` at a time."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

from fairfl.compose.compare.spec import ComparisonSpec, RunSpec
from fairfl.compose.compare.summary import ComparisonResult, RunFailure, SeedSummary

LOG_TAIL_LINES = 20


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
    repo_root = str(Path(__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo_root, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "fairfl.compose", "run", str(experiment), "--transport", transport]
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
