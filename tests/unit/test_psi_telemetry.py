"""Ψ telemetry (issue #22): the engine reports psi / psi_before / psi_noisy for every strategy from the round's
training results, so FedEBA+ rows (and user strategies) carry Ψ into results.json and the comparison tables; a
strategy's own metric of the same name wins; no Ψ where no client measured the losses."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from fairfl.compose.cli import run_inprocess
from fairfl.compose.compare.summary import SeedSummary
from fairfl.compose.results import RunRecorder
from fairfl.config import ExperimentConfig, experiment_from_dict
from fairfl.metrics.fairness import psi, psi_telemetry, weight_entropy, weight_entropy_metrics
from fairfl.protocol import TRAIN, ClientResult
from fairfl.v1 import control_pb2

NAN = math.nan
PSI_FORMS = {"psi", "psi_before", "psi_noisy"}


def result(cid: int, n: int, before: float = NAN, after: float = NAN, noisy: float = NAN) -> ClientResult:
    return ClientResult("t", "r", 1, cid, TRAIN, n, loss_before=before, loss_after=after, noisy_loss=noisy)


# --- the function -----------------------------------------------------------------------------------------------------


def test_psi_telemetry_by_hand() -> None:
    results = [result(0, 10, 0.4, 0.3), result(1, 30, 1.2, 0.9), result(2, 60, 2.5, 1.6)]
    got = psi_telemetry(results)
    assert set(got) == {"psi", "psi_before"}  # no client released a noisy loss: that form is left out, not NaN
    # p = (0.1, 0.3, 0.6), F = Σ p_i F_i, Ψ = Σ p_i (F_i − F)²
    p = [0.1, 0.3, 0.6]
    for key, losses in (("psi", [0.3, 0.9, 1.6]), ("psi_before", [0.4, 1.2, 2.5])):
        mean = sum(pi * f for pi, f in zip(p, losses, strict=True))
        assert got[key] == pytest.approx(sum(pi * (f - mean) ** 2 for pi, f in zip(p, losses, strict=True)), abs=1e-12)


def test_psi_telemetry_renormalises_over_the_clients_that_reported_each_loss() -> None:
    results = [result(0, 10, after=1.0, noisy=2.0), result(1, 30, after=3.0), result(2, 60, noisy=5.0)]
    got = psi_telemetry(results)
    assert set(got) == {"psi", "psi_noisy"}
    assert got["psi"] == pytest.approx(psi([1.0, 3.0], [10, 30]))  # p = (1/4, 3/4) among the two that reported
    assert got["psi_noisy"] == pytest.approx(psi([2.0, 5.0], [10, 60]))
    assert psi_telemetry([]) == {}
    assert psi_telemetry([result(0, 10), result(1, 20)]) == {}  # losses not measured: nothing to report


def test_weight_entropy_metrics() -> None:
    assert weight_entropy_metrics([0.25, 0.75]) == {"weight_entropy": weight_entropy([0.25, 0.75])}
    assert weight_entropy_metrics([0.0, 0.0]) == {}  # q-FFL with every loss 0: no weight went anywhere


# --- in-process runs into results.json and the comparison summary -----------------------------------------------------


def config(strategy: str, loss_telemetry: bool, **params: Any) -> ExperimentConfig:
    return experiment_from_dict(
        {
            "name": "psi",
            "seed": 2,
            "rounds": 2,
            "data": {"dataset": "synthetic", "num_clients": 5},
            "model": {"name": "logreg"},
            "training": {"local_steps": 2, "batch_size": 8, "lr": 0.1, "loss_telemetry": loss_telemetry},
            "selection": {"clients_per_round": 3},
            "strategy": {"name": strategy, "params": params},
            "evaluation": {"every": 1},
        }
    )


def run(cfg: ExperimentConfig, out: Path) -> tuple[list[control_pb2.RoundEvent], SeedSummary]:
    """Run in-process as `fairfl run --inprocess` does, write results.json, and summarise it as `fairfl compare`."""
    recorder = RunRecorder(cfg, quiet=True)
    run_inprocess(cfg, recorder, "psi-run")
    assert recorder.status is not None and recorder.status.state == control_pb2.RUN_STATE_COMPLETED
    recorder.write(out)
    results = json.loads((out / "results.json").read_text())
    return recorder.rounds, SeedSummary.from_results(cfg.strategy.name, cfg.seed, results)


def metrics(event: control_pb2.RoundEvent) -> dict[str, float]:
    return {m.name: m.value for m in event.strategy_metrics}


@pytest.mark.parametrize(
    ("name", "params"),
    [("fedeba_plus", {"alpha": 0.5}), ("prac_fedeba_plus", {"alpha": 0.5}), ("fedeba", {})],
)
def test_fedeba_family_rows_carry_psi(tmp_path: Path, name: str, params: dict[str, Any]) -> None:
    rounds, summary = run(config(name, loss_telemetry=True, **params), tmp_path)
    assert len(rounds) == 2
    for event in rounds:
        got = metrics(event)
        assert {"psi", "psi_before", "weight_entropy"} <= set(got), got
        assert "psi_noisy" not in got  # no DP: nothing noisy was released
        assert got["psi"] > 0 and got["psi_before"] > 0
    assert summary.extra["psi"] == metrics(rounds[-1])["psi"]
    assert summary.extra["psi_tail"] is not None
    # Ψ at the global model: the mean over the evaluated rounds (both here) of the engine's psi_before
    assert summary.extra["psi_before_tail"] == pytest.approx(sum(metrics(e)["psi_before"] for e in rounds) / 2)
    assert summary.extra["psi_test"] is not None and summary.extra["psi_test"] > 0


def test_fedeba_reads_the_losses_so_reports_psi_without_loss_telemetry(tmp_path: Path) -> None:
    rounds, summary = run(config("fedeba_plus", loss_telemetry=False, alpha=0.5), tmp_path)
    assert all({"psi", "psi_before"} <= set(metrics(e)) for e in rounds)
    assert summary.extra["psi"] is not None


def test_no_psi_where_the_losses_are_not_measured(tmp_path: Path) -> None:
    """FedAvg reads no F_i: without training.loss_telemetry its clients skip the loss passes, so no Ψ anywhere."""
    rounds, summary = run(config("fedavg", loss_telemetry=False), tmp_path / "off")
    for event in rounds:
        assert not PSI_FORMS & set(metrics(event))
        assert "weight_entropy" in metrics(event)  # the strategy's own metric stays
    assert summary.extra["psi"] is None and summary.extra["psi_tail"] is None and summary.extra["psi_test"] is None
    measured, measured_summary = run(config("fedavg", loss_telemetry=True), tmp_path / "on")
    assert all({"psi", "psi_before"} <= set(metrics(e)) for e in measured)
    assert measured_summary.extra["psi"] is not None and measured_summary.extra["psi_test"] is not None
    # The telemetry never touches the model.
    assert [e.model_sha256 for e in measured] == [e.model_sha256 for e in rounds]
