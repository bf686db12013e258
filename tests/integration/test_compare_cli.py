"""`fairfl compare` end to end: real `fairfl run` subprocesses on a tiny synthetic federation."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from fairfl.compose.results import FAIRNESS_COLUMNS

REPO = Path(__file__).resolve().parents[2]
BASE = {
    "name": "tiny-compare",
    "seed": 0,
    "rounds": 4,
    "data": {"dataset": "synthetic", "num_clients": 8},
    "model": {"name": "mlp", "params": {"hidden": [16]}},
    "training": {"local_steps": 3, "batch_size": 20, "lr": 0.05},
    "selection": {"clients_per_round": 3},
    "evaluation": {"every": 2},
    "runtime": {"agents": 2},
}

pytestmark = pytest.mark.integration


def compare(tmp_path: Path, runs: list[dict[str, Any]], *extra: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(BASE))
    spec = {"name": "tiny", "base": "base.yaml", "seeds": [0], "jobs": 2, "paper_source": "made-up", "runs": runs}
    (tmp_path / "compare.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "fairfl.compose", "compare", str(tmp_path / "compare.yaml"), *extra]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_compare_runs_every_seed_and_reports_what_the_runs_wrote(tmp_path: Path) -> None:
    runs = [
        {"label": "FedAvg", "set": {"strategy.name": "fedavg"}, "seeds": [0, 1], "paper": {"mean": "86.49 ± 0.09"}},
        {"label": "FedAvg server lr 0.5", "set": {"strategy.server_lr": 0.5}},
    ]
    out = tmp_path / "report"
    proc = compare(tmp_path, runs, "--output", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr

    for name in (
        "comparison.md",
        "comparison.csv",
        "comparison.json",
        "accuracy_distribution.png",
        "variance_over_rounds.png",
    ):
        assert (out / name).is_file(), name
    table = (out / "comparison.md").read_text()
    assert "Paper: Mean acc (%)" in table and "86.49 ± 0.09" in table
    assert "| FedAvg | 0, 1 |" in proc.stdout  # the table is printed at the end

    rows = list(csv.DictReader((out / "comparison.csv").open()))
    seed_rows = [r for r in rows if r["row"] == "seed"]
    assert [(r["algorithm"], r["seed"]) for r in seed_rows] == [
        ("FedAvg", "0"),
        ("FedAvg", "1"),
        ("FedAvg server lr 0.5", "0"),
    ]
    assert [r["algorithm"] for r in rows if r["row"] == "aggregate"] == ["FedAvg", "FedAvg server lr 0.5"]

    results = {}
    for row in seed_rows:
        slug = "fedavg" if row["algorithm"] == "FedAvg" else "fedavg-server-lr-0-5"
        run_dir = out / slug / f"seed{row['seed']}"
        res = json.loads((run_dir / "results.json").read_text())
        results[(row["algorithm"], row["seed"])] = res
        assert res["config"]["seed"] == int(row["seed"])
        assert res["transport"] == "inprocess"
        assert (run_dir / "run.log").is_file()
        for key in FAIRNESS_COLUMNS:
            expected = res["final_fairness"][key]
            assert (float(row[key]) if row[key] else None) == expected, key
        assert float(row["wall_seconds"]) == res["wall_seconds"]
        assert int(row["final_round"]) == res["final_round"] == 4
    assert results[("FedAvg server lr 0.5", "0")]["config"]["strategy"]["server_lr"] == 0.5

    # Seeds really change the run.
    seed0, seed1 = results[("FedAvg", "0")], results[("FedAvg", "1")]
    assert seed0["final_model_sha256"] != seed1["final_model_sha256"]
    assert seed0["final_fairness"] != seed1["final_fairness"]

    report = json.loads((out / "comparison.json").read_text())
    fedavg = report["algorithms"][0]
    assert fedavg["seeds"] == [0, 1]
    means = [seed0["final_fairness"]["mean"], seed1["final_fairness"]["mean"]]
    assert fedavg["metrics"]["mean"]["mean"] == pytest.approx(sum(means) / 2)
    assert fedavg["metrics"]["mean"]["std"] == pytest.approx(abs(means[0] - means[1]) / 2)
    assert [r for r, _, _ in fedavg["variance_by_round"]] == [2, 4]


def test_failed_run_is_reported_and_the_others_finish(tmp_path: Path) -> None:
    runs = [
        {"label": "good", "set": {}},
        {"label": "broken", "set": {"runtime.device": "cuda:99"}},  # valid config, fails when the run starts
    ]
    out = tmp_path / "report"
    proc = compare(tmp_path, runs, "--output", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED: broken seed 0, exit code 1" in proc.stdout
    assert "cuda:99" in proc.stdout  # the log tail says why
    assert (out / "good" / "seed0" / "results.json").is_file()
    rows = list(csv.DictReader((out / "comparison.csv").open()))
    assert [(r["algorithm"], r["row"]) for r in rows if r["row"] == "seed"] == [("good", "seed")]
    md = (out / "comparison.md").read_text()
    assert "## Failed runs" in md and "broken, seed 0: exit code 1" in md


def test_invalid_run_override_exits_before_training_and_names_the_field(tmp_path: Path) -> None:
    runs = [{"label": "ok", "set": {}}, {"label": "bad", "set": {"strategy.name": "nosuch"}}]
    out = tmp_path / "report"
    proc = compare(tmp_path, runs, "--output", str(out))
    assert proc.returncode == 2
    assert "runs[1] ('bad'): strategy.name: unknown strategy 'nosuch'" in proc.stderr
    assert not out.exists()  # nothing ran
