"""`fairfl compare --resume` (issue #20): the (run, seed) pairs a previous invocation finished are reused, the missing
and unfinished ones run again, and the report is the one an uninterrupted comparison writes; Ctrl-C on a comparison
stops its runs in order and says how to resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.test_compare_cli import BASE as COMPARE_BASE

REPO = Path(__file__).resolve().parents[2]
BASE = {**COMPARE_BASE, "name": "tiny-resume"}  # the tiny synthetic federation test_compare_cli runs
RUNS = [
    {"label": "FedAvg", "set": {"strategy.name": "fedavg"}},
    {"label": "FedAvg lr 0.5", "set": {"strategy.server_lr": 0.5}},
]
PAIRS = [("fedavg", 0), ("fedavg", 1), ("fedavg-lr-0-5", 0), ("fedavg-lr-0-5", 1)]

pytestmark = pytest.mark.integration


def write_comparison(directory: Path, runs: list[dict[str, Any]]) -> None:
    (directory / "base.yaml").write_text(yaml.safe_dump(BASE))
    spec = {"name": "resume", "base": "base.yaml", "seeds": [0, 1], "jobs": 2, "runs": runs}
    (directory / "compare.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))


def compare_cmd(*extra: str) -> list[str]:
    return [sys.executable, "-m", "fairfl.compose", "compare", "compare.yaml", "--output", "report", *extra]


def compare(directory: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        compare_cmd(*extra), cwd=directory, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def without_wall_time(value: Any) -> Any:
    """The report with the run-time measurements left out (they differ between any two invocations)."""
    if isinstance(value, dict):
        return {k: without_wall_time(v) for k, v in value.items() if k not in ("wall_seconds", "log_tail")}
    if isinstance(value, list):
        return [without_wall_time(v) for v in value]
    return value


def test_resume_runs_only_the_missing_and_unfinished_pairs(tmp_path: Path) -> None:
    write_comparison(tmp_path, RUNS)
    first = compare(tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    report_dir = tmp_path / "report"
    full = json.loads((report_dir / "comparison.json").read_text())
    assert len(full["runs"]) == 4

    results = {pair: report_dir / pair[0] / f"seed{pair[1]}" / "results.json" for pair in PAIRS}
    (results[("fedavg", 1)]).unlink()  # never finished
    stopped = json.loads(results[("fedavg-lr-0-5", 0)].read_text())
    stopped["state"] = "RUN_STATE_STOPPED"  # interrupted: its results stand for fewer rounds than asked
    results[("fedavg-lr-0-5", 0)].write_text(json.dumps(stopped))
    kept = {pair: results[pair].stat().st_mtime_ns for pair in (("fedavg", 0), ("fedavg-lr-0-5", 1))}
    time.sleep(0.01)

    second = compare(tmp_path, "--resume")
    assert second.returncode == 0, second.stdout + second.stderr
    out = second.stdout
    assert "4 runs, 2 finished before (reused), 2 to run" in out
    assert "[resume] FedAvg seed 0: finished before, reused" in out
    assert "[resume] FedAvg lr 0.5 seed 1: finished before, reused" in out
    ran = sorted(
        line.split("] ", 1)[1].split(":")[0] for line in out.splitlines() if line.startswith("[") and "/2]" in line
    )
    assert ran == ["FedAvg lr 0.5 seed 0", "FedAvg seed 1"]  # the plan ran only the two
    for pair, mtime in kept.items():
        assert results[pair].stat().st_mtime_ns == mtime, f"{pair} ran again"
    for pair in PAIRS:
        assert json.loads(results[pair].read_text())["state"] == "RUN_STATE_COMPLETED"

    resumed = json.loads((report_dir / "comparison.json").read_text())
    assert [(r["label"], r["seed"]) for r in resumed["runs"]] == [(r["label"], r["seed"]) for r in full["runs"]]
    by_pair = {(r["label"], r["seed"]): r for r in full["runs"]}
    for run in resumed["runs"]:  # reused pairs: exactly as before, wall time included
        if (run["label"], run["seed"]) in (("FedAvg", 0), ("FedAvg lr 0.5", 1)):
            assert run == by_pair[(run["label"], run["seed"])]
    # The whole report equals the uninterrupted one but for run times: the re-run pairs reproduce their numbers.
    for key in ("algorithms", "runs", "failures"):
        assert without_wall_time(resumed[key]) == without_wall_time(full[key]), key
    assert (report_dir / "accuracy_over_rounds.png").stat().st_size > 0
    md = (report_dir / "comparison.md").read_text()
    assert "--resume`" in md and "; 2 of 4 finished runs reused from an earlier invocation)" in md


def test_resume_reruns_a_pair_whose_experiment_changed(tmp_path: Path) -> None:
    write_comparison(tmp_path, RUNS[:1])
    assert compare(tmp_path).returncode == 0
    write_comparison(tmp_path, [{**RUNS[0], "set": {"strategy.name": "fedavg", "training.lr": 0.1}}])
    again = compare(tmp_path, "--resume")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "0 finished before (reused), 2 to run" in again.stdout


def test_resume_reuses_a_pair_written_before_a_config_field_existed(tmp_path: Path) -> None:
    """A field added to the config since (here runtime.inprocess_pool, as if the pair predates it) takes its default,
    and how a pair ran (runtime.inprocess_workers) does not change what it computed: the finished pair is reused."""
    write_comparison(tmp_path, RUNS[:1])
    assert compare(tmp_path).returncode == 0
    stored = sorted((tmp_path / "report").glob("*/seed*/experiment.yaml"))
    assert len(stored) == 2
    for path in stored:
        lines = [line for line in path.read_text().splitlines() if "inprocess_pool:" not in line]
        path.write_text("\n".join(line.replace("inprocess_workers: auto", "inprocess_workers: 3") for line in lines))
    again = compare(tmp_path, "--resume")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "2 finished before (reused), 0 to run" in again.stdout
    # Any other field a stored experiment does not state may have computed otherwise before it existed: run again.
    for path in stored:
        path.write_text("\n".join(line for line in path.read_text().splitlines() if "lr_decay:" not in line))
    again = compare(tmp_path, "--resume")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "0 finished before (reused), 2 to run" in again.stdout


def test_ctrl_c_stops_the_comparison_and_resume_finishes_it(tmp_path: Path) -> None:
    slow = {"label": "Slow", "set": {"rounds": 5000, "evaluation.every": 1000}, "seeds": [0]}
    write_comparison(tmp_path, [{**RUNS[0], "seeds": [0]}, slow])
    spec = yaml.safe_load((tmp_path / "compare.yaml").read_text())
    spec["jobs"] = 1
    (tmp_path / "compare.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        compare_cmd(), cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, process_group=0
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # the fast pair finishes first (jobs 1, spec order); then the slow one runs
        lines.append(line)
        if line.startswith("[1/2] FedAvg seed 0: ok"):
            break
    slow_log = tmp_path / "report" / "slow" / "seed0" / "run.log"
    deadline = time.monotonic() + 120
    while "[pending]" not in (slow_log.read_text() if slow_log.exists() else ""):
        assert time.monotonic() < deadline, "the slow run never started its rounds"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    out = "".join(lines) + out
    assert proc.returncode == 130, out + err
    assert "Traceback" not in out + err
    assert "1 of 2 runs finished" in out
    assert "SIGINT: interrupted; to run the rest: fairfl compare compare.yaml --output report --resume" in out
    slow_results = json.loads((tmp_path / "report" / "slow" / "seed0" / "results.json").read_text())
    assert slow_results["state"] == "RUN_STATE_STOPPED"  # the child stopped its run and wrote what it finished
    assert (tmp_path / "report" / "comparison.json").is_file()

    slow["set"] = {"rounds": 4}  # finish the rest quickly: a changed experiment runs again, the other is reused
    write_comparison(tmp_path, [{**RUNS[0], "seeds": [0]}, slow])
    again = compare(tmp_path, "--resume")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "2 runs, 1 finished before (reused), 1 to run" in again.stdout
    assert "[1/1] Slow seed 0: ok" in again.stdout


def test_an_interrupted_pair_continues_from_its_checkpoint(tmp_path: Path) -> None:
    """Ctrl-C in the middle of a pair, then --resume with the same file: the pair goes on from its last completed
    round (not from round 1) and ends with the model an uninterrupted comparison's pair ends with."""
    long = {"label": "Long", "set": {"rounds": 400, "evaluation.every": 1}, "seeds": [0]}
    for directory in (tmp_path / "straight", tmp_path / "stopped"):
        directory.mkdir()
        write_comparison(directory, [long])
    assert compare(tmp_path / "straight").returncode == 0
    straight = tmp_path / "straight" / "report" / "long" / "seed0"
    assert not (straight / "checkpoint").exists()  # removed once the pair completed

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    where = tmp_path / "stopped"
    proc = subprocess.Popen(
        compare_cmd(), cwd=where, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, process_group=0
    )
    log = where / "report" / "long" / "seed0" / "run.log"
    deadline = time.monotonic() + 120
    while (log.read_text() if log.exists() else "").count("\nround ") < 20:
        assert time.monotonic() < deadline and proc.poll() is None, "the pair never got going"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    stopped = json.loads((log.parent / "results.json").read_text())
    assert stopped["state"] == "RUN_STATE_STOPPED" and 20 <= stopped["rounds_completed"] < 400

    again = compare(where, "--resume")
    assert again.returncode == 0, again.stdout + again.stderr
    assert (
        f"[resume] Long seed 0: continuing its interrupted run after round {stopped['rounds_completed']} from "
        "report/long/seed0/checkpoint/"
    ) in again.stdout
    provenance = json.loads((log.parent / "provenance.json").read_text())
    assert provenance["resumed"][0]["after_round"] == stopped["rounds_completed"]  # both invocations recorded
    final = json.loads((log.parent / "results.json").read_text())
    assert final["resumed_after_round"] == stopped["rounds_completed"]
    reference = json.loads((straight / "results.json").read_text())
    assert final["rounds_completed"] == 400
    assert final["final_model_sha256"] == reference["final_model_sha256"]
    assert f"resuming after round {stopped['rounds_completed']}" in log.read_text()  # appended to the first log
    assert log.read_text().startswith("$ ")
    assert not (log.parent / "checkpoint").exists()


def test_since_runs_again_what_ran_before_that_commit(tmp_path: Path) -> None:
    import subprocess as sp

    git = ["git", "-C", str(REPO)]
    head = sp.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    root = sp.run([*git, "rev-list", "--max-parents=0", "HEAD"], capture_output=True, text=True, check=True)
    oldest = root.stdout.split()[0]
    if oldest == head:
        pytest.skip("needs a repository with more than one commit (a shallow clone has one)")
    write_comparison(tmp_path, RUNS[:1])
    assert compare(tmp_path).returncode == 0
    report_dir = tmp_path / "report" / "fedavg"
    for seed, revision in ((0, head), (1, oldest)):  # as if seed 1 had run on the first commit's code
        provenance = report_dir / f"seed{seed}" / "provenance.json"
        provenance.write_text(json.dumps({**json.loads(provenance.read_text()), "revision": revision}))
    again = compare(tmp_path, "--resume", "--since", head)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "2 runs, 1 finished before (reused), 1 to run" in again.stdout
    assert "[resume] FedAvg seed 0: finished before, reused" in again.stdout
    assert "[1/1] FedAvg seed 1: ok" in again.stdout
    md = (tmp_path / "report" / "comparison.md").read_text()
    assert f"--resume --since {head}" in md

    legacy = report_dir / "seed0"  # a pair from before provenance.json: its commit was in revision.txt
    (legacy / "provenance.json").unlink()
    (legacy / "revision.txt").write_text(oldest + "\n")
    third = compare(tmp_path, "--resume", "--since", head)
    assert "FedAvg seed 0: ok" in third.stdout, third.stdout + third.stderr  # (seed 1 too, from a dirty tree)
    assert (legacy / "provenance.json").is_file() and not (legacy / "revision.txt").exists()  # no stale commit left

    refused = compare(tmp_path, "--since", head)
    assert refused.returncode == 2 and "--since picks which finished runs --resume reuses" in refused.stderr
    unknown = compare(tmp_path, "--resume", "--since", "no-such-commit")
    assert unknown.returncode == 2 and "--since: 'no-such-commit' is not a commit of this checkout" in unknown.stderr
