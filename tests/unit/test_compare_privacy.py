"""`fairfl compare` on DP runs: Ψ (strategy telemetry and on the global model) and the ledger's ε beside each run."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from fairfl.compose.compare import (
    ComparisonResult,
    ComparisonSpec,
    RunSpec,
    SeedSummary,
    render_markdown,
    render_table,
    summarize,
)


def results(psi_values: list[float], eps: float | None, losses: tuple[float, float]) -> dict[str, Any]:
    rounds = []
    for i, value in enumerate(psi_values, start=1):
        r: dict[str, Any] = {
            "round": 25 * i,
            "fairness": {"mean": 80.0, "variance": 4.0},
            "strategy_metrics": [{"name": "psi", "value": value}, {"name": "global_loss", "value": 0.5}],
            "clients": [
                {"client_id": 0, "accuracy": 78.0, "loss": losses[0], "num_samples": 100},
                {"client_id": 1, "accuracy": 82.0, "loss": losses[1], "num_samples": 300},
            ],
        }
        if eps is not None:
            r["epsilon_spent"] = eps
        rounds.append(r)
    return {"rounds": rounds, "final_fairness": {"mean": 80.0, "variance": 4.0}, "final_round": 25 * len(rounds)}


def test_extra_metrics_come_from_the_final_rounds() -> None:
    run = SeedSummary.from_results("FedFDP", 0, results([9.0, 1.0, 2.0, 3.0, 4.0, 5.0], 3.5173, (1.0, 2.0)))
    assert run.extra["psi"] == 5.0
    assert run.extra["psi_tail"] == pytest.approx(3.0)  # mean of the last 5 evaluated rounds
    # test losses 1 and 2 weighted 1:3: mean 1.75, Ψ = 0.25·0.75² + 0.75·0.25² = 0.1875
    assert run.extra["psi_test"] == pytest.approx(0.1875)
    assert run.extra["epsilon"] == 3.5173
    plain = results([1.0], None, (1.0, 1.0))
    for r in plain["rounds"]:
        r["strategy_metrics"] = []
    extra = SeedSummary.from_results("FedAvg", 0, plain).extra
    assert extra == {"psi": None, "psi_tail": None, "psi_before_tail": None, "psi_test": None, "epsilon": None}


def test_table_and_markdown_show_psi_and_the_ledger_epsilon(tmp_path: Path) -> None:
    a = SeedSummary.from_results("FedFDP", 0, results([2e-2, 3e-2], 3.5173, (1.0, 2.0)), "x")
    b = SeedSummary.from_results("FedFDP", 1, results([4e-2, 5e-2], 3.5173, (1.0, 2.0)), "y")
    table = render_table([summarize("FedFDP", [a, b])])
    header, _, row = table.splitlines()
    assert "Ψ (final round) | Ψ (mean, last 5 evaluations) | Ψ_test (global model) | ε spent (ledger)" in header
    assert "| 4.00e-02 ± 1.0e-02 | 3.50e-02 ± 1.0e-02 | 1.88e-01 ± 0.0e+00 | 3.5173 ± 0.0000 |" in row
    spec = ComparisonSpec("dp", tmp_path / "b.yaml", {}, [0, 1], [RunSpec("FedFDP", {}, [0, 1])])
    result = ComparisonResult(spec, tmp_path, 2, "inprocess", [a, b], [], datetime(2026, 1, 1).astimezone(), 1.0)
    md = render_markdown(result, "fairfl compare dp.yaml", {"platform": "p", "cpus": 2, "python": "3"})
    assert "| FedFDP | 1 | 50 | 80.00 | 5.000e-02 | 3.5173 |" in md
    assert "ε spent is what the privacy ledger recorded" in md
