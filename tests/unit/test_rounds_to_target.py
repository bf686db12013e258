"""scripts/rounds_to_target.py: rounds to several accuracy targets per run and seed of a comparison folder."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rounds_to_target", REPO / "scripts" / "rounds_to_target.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_run(folder: Path, run: str, seed: int, curve: list[float]) -> None:
    directory = folder / run / f"seed{seed}"
    directory.mkdir(parents=True)
    rounds = [{"round": i + 1, "fairness": {"mean": acc}} for i, acc in enumerate(curve)]
    rounds.insert(1, {"round": 0})  # a round without an evaluation is skipped
    (directory / "results.json").write_text(json.dumps({"rounds": rounds}))


def test_rounds_to_each_target_per_seed_and_their_mean_over_the_seeds_that_reached_it(
    tmp_path: Path, script: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    write_run(tmp_path, "fast", 0, [40.0, 55.0, 61.0, 58.0])
    write_run(tmp_path, "fast", 1, [52.0, 59.0, 60.0, 62.5])
    write_run(tmp_path, "slow", 0, [30.0, 45.0, 50.0, 51.0])
    assert script.main([str(tmp_path), "--targets", "50,60"]) == 0
    out = capsys.readouterr().out
    assert "| fast | seed0 | 2 | 3 | 61.0 |" in out
    assert "| fast | seed1 | 1 | 3 | 62.5 |" in out
    assert "| slow | seed0 | 3 | — | 51.0 |" in out
    assert "| fast | 2 | 1.5 (2/2) | 3.0 (2/2) |" in out
    assert "| slow | 1 | 3.0 (1/1) | — (0/1) |" in out


@pytest.mark.parametrize("targets", ["", "abc", "0", "101", "50,x"])
def test_bad_targets_are_refused_with_a_message(tmp_path: Path, script: ModuleType, targets: str) -> None:
    write_run(tmp_path, "fast", 0, [40.0])
    with pytest.raises(SystemExit) as exit_info:
        script.main([str(tmp_path), "--targets", targets])
    assert exit_info.value.code == 2


def test_a_folder_without_results_is_refused(tmp_path: Path, script: ModuleType) -> None:
    with pytest.raises(SystemExit):
        script.main([str(tmp_path)])
    with pytest.raises(SystemExit):
        script.main([str(tmp_path / "missing")])
