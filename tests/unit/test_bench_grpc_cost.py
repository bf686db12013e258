"""scripts/bench_grpc_cost.py's split of the aggregator's CPU per round: an exact fit of its four runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from bench_grpc_cost import FEW, MANY, VARIANTS, Variant, by_role, split_aggregator_cpu


def test_the_split_recovers_the_costs_that_made_the_four_runs() -> None:
    fixed, per_model_mb, per_task, per_update_mb = 4.0, 6.0, 0.75, 1.5
    model_mb = {"tiny": 0.025, "big": 0.8}

    def cpu(v: Variant) -> float:
        mb = model_mb[v.model]
        return fixed + mb * per_model_mb + v.tasks * (per_task + mb * per_update_mb)

    split = split_aggregator_cpu({v: cpu(v) for v in VARIANTS}, model_mb)
    assert split == pytest.approx(
        {"fixed": fixed, "per_model_mb": per_model_mb, "per_task": per_task, "per_update_mb": per_update_mb}
    )
    assert {(v.model, v.tasks) for v in VARIANTS} == {(m, t) for m in ("tiny", "big") for t in (FEW, MANY)}


def test_agents_are_summed_and_services_kept_by_name() -> None:
    assert by_role({"agent-0": 0.5, "agent-1": 0.25, "aggregator": 0.1, "privacy": 0.01}) == {
        "agents": 0.75,
        "aggregator": 0.1,
        "privacy": 0.01,
    }
