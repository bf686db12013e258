"""bench_round's plain PyTorch loop does the experiment's work: replaying the in-process run's selections, it ends
with the model the engine ends with (so the ratio compares like with like), and it refuses what it cannot replay."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_round
from benchlib import with_overrides

from fairfl.config import experiment_from_dict

SMALL = {
    "name": "plain-loop",
    "seed": 3,
    "rounds": 4,
    "data": {"dataset": "synthetic", "num_clients": 12},
    "model": {"name": "mlp", "params": {"hidden": [16]}},
    "training": {"local_steps": 5, "batch_size": 8, "lr": 0.05, "lr_decay": 0.9},
    "strategy": {"name": "fedavg"},
    "selection": {"method": "random", "clients_per_round": 4},
    "evaluation": {"every": 2},
    "runtime": {"device": "cpu"},
}


def test_plain_loop_reproduces_the_engine_run() -> None:
    config = experiment_from_dict(SMALL)
    _, _, rounds = bench_round.inprocess_run(config)
    selections = [list(r.selected) for r in rounds]
    plain = bench_round.plain_loop(config, selections, loss_passes=True)
    assert len(plain.arrivals) == config.rounds
    assert plain.final_accuracy == pytest.approx(rounds[-1].fairness.mean, abs=0.01)
    # Timing is recorded per round, the loss passes apart from the rest.
    assert all(b >= a for a, b in zip(plain.arrivals, plain.arrivals[1:], strict=False))
    assert all(s > 0 for s in plain.loss_pass_seconds)
    without = bench_round.plain_loop(config, selections, loss_passes=False)
    assert without.final_accuracy == plain.final_accuracy and not any(without.loss_pass_seconds)


def test_the_floor_holds_the_loss_passes_exactly_when_the_clients_run_them() -> None:
    config = experiment_from_dict(SMALL)
    assert not bench_round.loss_passes_run(config)  # FedAvg reads no F_i: its clients skip the passes
    telemetry = experiment_from_dict({**SMALL, "training": {**SMALL["training"], "loss_telemetry": True}})
    assert bench_round.loss_passes_run(telemetry)
    plain = bench_round.PlainLoop(
        arrivals=[0.0, 1.0, 2.0], cpu=[0.0, 1.5, 3.0], loss_pass_seconds=[0.1, 0.2, 0.2], loss_pass_cpu=[0.1, 0.3, 0.3]
    )
    skipped, run = bench_round.LoopTiming.of(plain, False), bench_round.LoopTiming.of(plain, True)
    assert (skipped.floor, skipped.passes, skipped.with_passes) == pytest.approx((0.8, 0.2, 1.0))
    assert skipped.cpu == pytest.approx(1.2) and run.cpu == pytest.approx(1.5)
    assert run.floor == pytest.approx(1.0)


def test_plain_loop_refuses_experiments_it_cannot_replay() -> None:
    config = experiment_from_dict(SMALL)
    bench_round._check_plain_loop_applies(config)  # FedAvg with SGD and uniform selection: fine
    for overrides, word in (
        ({"strategy.name": "fedprox"}, "strategy"),
        ({"training.optimizer": "adam"}, "optimizer"),
        ({"selection.method": "power_of_choice"}, "selection.method"),
    ):
        with pytest.raises(SystemExit, match=word):
            bench_round._check_plain_loop_applies(with_overrides(config, overrides))
