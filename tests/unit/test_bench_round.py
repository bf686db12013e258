"""bench_round's plain PyTorch loop does the experiment's work: replaying the in-process run's selections, it ends
with the model the engine ends with (so the ratio compares like with like), and it refuses what it cannot replay."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_round
from benchlib import RunTrace, with_overrides

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
    # ... and so are the clients' tasks, summed per round, and the evaluation in the rounds that run it (every 2).
    assert len(plain.task_seconds) == len(plain.eval_round_seconds) == config.rounds
    assert all(s > 0 for s in plain.task_seconds)
    assert [s > 0 for s in plain.eval_round_seconds] == [False, True, False, True]
    assert sum(plain.eval_round_seconds) == pytest.approx(plain.eval_seconds)
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
    bench_round.check_plain_loop_applies(config)  # FedAvg with SGD and uniform selection: fine
    for overrides, word in (
        ({"strategy.name": "fedprox"}, "strategy"),
        ({"training.optimizer": "adam"}, "optimizer"),
        ({"selection.method": "power_of_choice"}, "selection.method"),
    ):
        with pytest.raises(SystemExit, match=word):
            bench_round.check_plain_loop_applies(with_overrides(config, overrides))


def timed_loop(passes: list[float], tasks: list[float], evals: list[float], cpu: list[float]) -> bench_round.PlainLoop:
    """A one-thread loop's record of three rounds (round 1 is setup and left out of every figure)."""
    return bench_round.PlainLoop(
        arrivals=[1.0, 2.0, 3.0],
        cpu=cpu,
        loss_pass_seconds=passes,
        loss_pass_cpu=passes,
        task_seconds=tasks,
        eval_round_seconds=evals,
    )


def test_the_ideal_parallel_floor_divides_the_one_thread_loops_client_work_over_the_cores() -> None:
    plain = timed_loop([0.1, 0.1, 0.1], [9.0, 0.6, 0.8], [5.0, 0.0, 0.2], [0.0, 1.0, 2.0])
    # Rounds 2-3: tasks 0.7 and evaluation 0.1 per round; the F_i passes only when the clients run them.
    assert bench_round.LoopTiming.of(plain, False).work == pytest.approx(0.8)
    assert bench_round.LoopTiming.of(plain, True).work == pytest.approx(0.9)
    assert bench_round.LoopTiming.of(plain, False).ideal_floor(2) == pytest.approx(0.4)
    assert bench_round.LoopTiming.of(plain, False).ideal_floor(0) == pytest.approx(0.8)  # never fewer than one core


def test_a_run_is_measured_against_the_ideal_floor_and_the_one_thread_loops_cpu() -> None:
    trace = RunTrace("r", None, arrivals=[10.0, 10.6, 11.2], cpu=[{"agg": 1.0, "a0": 0.0}, {}, {"agg": 1.2, "a0": 1.8}])
    one = bench_round.LoopTiming.of(timed_loop([0.0] * 3, [0.0, 0.5, 0.5], [0.0] * 3, [0.0, 0.8, 1.6]), False)
    two = bench_round.LoopTiming.of(timed_loop([0.0] * 3, [0.0, 0.3, 0.3], [0.0] * 3, [0.0, 1.0, 2.0]), False)
    inprocess = bench_round.InProcessTiming.of([0.0, 0.5, 1.0], [0.0, 0.4, 1.0], [])
    assert (inprocess.seconds, inprocess.cpu) == pytest.approx((0.5, 0.5))
    pair = bench_round.Pair(trace, {1: one, 2: two}, inprocess, cores=2)
    assert pair.grpc_s == pytest.approx(0.6) and pair.grpc_cpu == pytest.approx(1.0)
    assert pair.ideal_floor == pytest.approx(0.25)  # the one-thread loop's 0.5 s of client work over 2 cores
    assert pair.over_floor() == pytest.approx({"grpc": 2.4, "grpc_cpu": 1.25, "inprocess": 2.0, "inprocess_cpu": 0.625})


def test_presets_both_and_the_all_participating_workload() -> None:
    both = bench_round.presets_for("both", None)
    assert [p.prefix for p in both] == ["", "all_"]  # the default preset's keys are issue #9's, unprefixed
    assert [p.config for p in bench_round.presets_for("all", None)] == [bench_round.ALL_PARTICIPATING_CONFIG]
    custom = bench_round.presets_for("both", "some/experiment.yaml")
    assert [(p.config, p.prefix) for p in custom] == [(Path("some/experiment.yaml"), "")]
    config = with_overrides(
        bench_round.benchlib.load_config(bench_round.ALL_PARTICIPATING_CONFIG), {"rounds": bench_round.DEFAULT_ROUNDS}
    )
    bench_round.check_plain_loop_applies(config)
    assert (config.data.dataset, config.data.num_clients, config.data.partition) == ("fashion_mnist", 10, "shards")
    assert config.data.shards_per_client == 2 and config.selection.clients_per_round == 10
    assert config.model.params["hidden"] == [200, 200]
    assert (config.training.local_steps, config.training.batch_size) == (10, 50)
    assert config.evaluation.every > config.rounds  # evaluated in the last round only
    assert not bench_round.loss_passes_run(config)
