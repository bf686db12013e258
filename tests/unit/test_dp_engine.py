"""DP runs on the aggregator side: config validation, the events a round spends, budget enforcement, the loss clip
bounds the server carries, FedFDP with λ = 0 against DP-FedAvg, client-level DP-FedAvg, and the presets."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scipy import stats

from aggregator_service.dp import DpController, affordable_rounds, effective_noise_multiplier, round_events, run_budget
from aggregator_service.engine import RoundEngine
from aggregator_service.peers import RemotePrivacy
from fairfl import accounting as accountant
from fairfl.compose.compare import load_comparison
from fairfl.compose.inprocess import InProcessTransport
from fairfl.compose.local_privacy import LocalPrivacy
from fairfl.compose.local_selection import LocalSelector
from fairfl.config import ConfigError, experiment_from_dict, load_experiment
from fairfl.metrics.fairness import psi, psi_telemetry
from fairfl.protocol import TRAIN, UPDATE, ClientResult
from fairfl.strategy import RoundContext
from fairfl.v1 import control_pb2, federation_pb2
from privacy_service.ledger import Event

REPO = Path(__file__).resolve().parents[2]


def dp_config(**over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "name": "dp",
        "seed": 3,
        "rounds": 3,
        "data": {"dataset": "synthetic", "num_clients": 4},
        "model": {"name": "mlp", "params": {"hidden": [16]}},
        "training": {"local_steps": 1, "lr": 1.0, "batch_size": 20, "loss_eval_batches": 1},
        "strategy": {"name": "fedfair"},
        "selection": {"method": "full", "clients_per_round": 4},
        "evaluation": {"every": 100},
        "runtime": {"agents": 2},
        "privacy": {"enabled": True, "epsilon": 8.0, "sample_rate": 0.1, "noise_multiplier": 1.5, "clip_norm": 1.0},
    }
    for dotted, value in over.items():
        node = cfg
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return cfg


def run_inprocess(config: Any) -> tuple[Any, list[control_pb2.RoundEvent], LocalPrivacy]:
    events: list[control_pb2.RunEvent] = []
    privacy = LocalPrivacy()
    engine = RoundEngine(
        "run", config, InProcessTransport(), LocalSelector(config.selection.method), privacy, events.append
    )
    summary = engine.run()
    return summary, [e.round for e in events if e.HasField("round")], privacy


# --- config -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"privacy.delta": 1.5}, "privacy.delta: must be in (0, 1)"),
        ({"privacy.epsilon": 0.0}, "privacy.epsilon: must be > 0"),
        ({"privacy.sample_rate": 0.0}, "privacy.sample_rate: must be in (0, 1]"),
        ({"privacy.noise_multiplier": -1.0}, "privacy.noise_multiplier: must be > 0"),
        ({"privacy.clip_norm": 0.0}, "privacy.clip_norm: must be > 0"),
        ({"privacy.loss_clip_min": 5.0}, "privacy.loss_clip_min: 5.0 exceeds loss_clip_init"),
        ({"privacy.orders": [1.0, 2.0]}, "privacy.orders[0]: must be > 1"),
        ({"privacy.accountant": "pld", "privacy.orders": [2.0]}, "privacy.orders: apply only to accountant rdp"),
        ({"privacy.mode": "joint_batch", "privacy.loss_noise_multiplier": 0.0}, "privacy.loss_noise_multiplier"),
        ({"privacy.mode": "both"}, "privacy.mode: 'both' is not one of"),
        ({"privacy.principal": "server"}, "privacy.principal: 'server' is not one of"),
        ({"privacy.sigma": 2.0}, "privacy.sigma: unknown field"),
        ({"strategy.name": "fedeba_plus"}, "strategy.name: 'fedeba_plus' has no DP procedure"),
        ({"privacy.loss_noise_multiplier": 0.0}, "privacy.loss_noise_multiplier: strategy fedfair uses"),
        ({"training.local_epochs": 1, "training.local_steps": None}, "training.local_epochs: DP-SGD counts"),
        (
            {"privacy.principal": "federation"},
            "strategy.name: 'fedfair' has no DP procedure for privacy.principal federation (client-level DP-FedAvg)",
        ),
    ],
)
def test_privacy_config_errors_name_the_field(over: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        experiment_from_dict(dp_config(**over))
    assert message in str(err.value)


def test_disabled_privacy_is_not_validated() -> None:
    cfg = experiment_from_dict(dp_config(**{"privacy.enabled": False, "privacy.delta": 7.0, "strategy.name": "afl"}))
    assert not cfg.privacy.enabled and round_events(cfg, [0, 1], 10) == []
    assert run_budget("r", cfg).principal_kind == "none"


# --- events -----------------------------------------------------------------------------------------------------------


def test_round_events_per_mode() -> None:
    theorem3 = experiment_from_dict(dp_config(**{"training.local_steps": 3}))
    assert round_events(theorem3, [2, 0], 10) == [
        Event("0", "gradient", 0.1, 1.5, 3),
        Event("0", "loss", 0.1, 5.0, 1),
        Event("2", "gradient", 0.1, 1.5, 3),
        Event("2", "loss", 0.1, 5.0, 1),
    ]
    grad_only = experiment_from_dict(dp_config(**{"privacy.mode": "gradient_only"}))
    assert round_events(grad_only, [1], 10) == [Event("1", "gradient", 0.1, 1.5, 1)]
    joint = experiment_from_dict(dp_config(**{"privacy.mode": "joint_batch", "training.local_steps": 2}))
    sigma_eff = effective_noise_multiplier(1.5, 5.0)
    assert round_events(joint, [1], 10) == [Event("1", "joint", 0.1, sigma_eff, 1), Event("1", "gradient", 0.1, 1.5, 1)]
    assert effective_noise_multiplier(2.0, 5.0) == pytest.approx(1.856953, abs=1e-6)  # spec §2.6 (b)
    fed = experiment_from_dict(
        dp_config(**{"privacy.principal": "federation", "strategy.name": "fedavg", "selection.method": "random"})
    )
    fed.selection.clients_per_round = 2
    assert round_events(fed, [0, 3], 4) == [Event("federation", "model", 0.5, 1.5, 1)]
    # Agents dropped: 2 drawn from the 3 live candidates, so each live client's chance (the accountant's q) is 2/3.
    assert round_events(fed, [0, 3], 3) == [Event("federation", "model", 2 / 3, 1.5, 1)]
    with pytest.raises(ValueError, match="cannot sample 2 of 1 candidates"):
        round_events(fed, [0, 3], 1)
    budget = run_budget("r", fed)
    assert (budget.principal_kind, budget.epsilon, budget.delta) == ("federation", 8.0, 1e-5)


def test_affordable_rounds_match_the_spec_vectors() -> None:
    """seed-fedfdp §2.5 with dp_accounting's orders: Theorem 3 allows 688 rounds at ε = 3.52, gradient-only 782."""
    preset = load_experiment(REPO / "experiments/fedfdp/fmnist_cnn.yaml")
    assert affordable_rounds(preset) == 688 == preset.rounds
    parity = load_experiment(REPO / "experiments/fedfdp/fmnist_cnn.yaml", {"privacy.mode": "gradient_only"})
    assert affordable_rounds(parity) == 782
    assert accountant.paper_parity_max_rounds(0.05, 2.0, 3.52, 1e-5) == 778  # the paper's T (code bisection)


# --- enforcement ------------------------------------------------------------------------------------------------------


def budget_for_exactly(config: Any, rounds: int) -> float:
    """An ε strictly between what `rounds` and `rounds + 1` rounds of the config's events spend."""
    specs = [accountant.EventSpec(e.sample_rate, e.noise_multiplier, e.count) for e in round_events(config, [0], 10)]

    def eps(t: int) -> float:
        return accountant.epsilon([accountant.EventSpec(q, s, n * t) for q, s, n in specs], config.privacy.delta)[0]

    return (eps(rounds) + eps(rounds + 1)) / 2


def test_budget_allowing_n_rounds_stops_the_run_after_exactly_n() -> None:
    config = experiment_from_dict(dp_config(rounds=9))
    config.privacy.epsilon = budget_for_exactly(config, 4)
    assert affordable_rounds(config) == 4
    summary, rounds, privacy = run_inprocess(config)
    assert summary.state == control_pb2.RUN_STATE_STOPPED
    assert summary.rounds_completed == 4 and [r.round for r in rounds] == [1, 2, 3, 4]
    assert summary.message.startswith("privacy budget exhausted: round 5 of run 'run' refused: principal ")
    assert f"> budget ε = {config.privacy.epsilon:.6g}" in summary.message
    spends = privacy.ledger.spend("run")
    assert len(spends) == 4 and all(s.epsilon <= config.privacy.epsilon for s in spends)
    assert privacy.ledger.rounds_recorded("run") == 4
    assert rounds[-1].evaluated  # the budget's last round is evaluated like a configured last round
    assert rounds[-1].epsilon_spent == pytest.approx(max(s.epsilon for s in spends))
    assert [r.epsilon_spent for r in rounds] == sorted(r.epsilon_spent for r in rounds)


def test_remote_privacy_enforces_and_replays(tmp_path: Path) -> None:
    from privacy_service.server import serve

    server = serve("127.0.0.1:0", str(tmp_path / "ledger.sqlite"))
    try:
        config = experiment_from_dict(dp_config(rounds=5))
        config.privacy.epsilon = budget_for_exactly(config, 2)
        gate = RemotePrivacy(f"127.0.0.1:{server.port}")
        gate.start("r", config)
        gate.start("r", config)  # idempotent
        first = gate.authorize_round("r", 1, config, [0, 1, 2, 3], 4)
        assert gate.authorize_round("r", 1, config, [0, 1, 2, 3], 4) == first  # a retried call: replay, nothing added
        gate.authorize_round("r", 2, config, [0, 1, 2, 3], 4)
        from aggregator_service.engine import RunStopped

        with pytest.raises(RunStopped, match="privacy budget exhausted: round 3 of run 'r' refused"):
            gate.authorize_round("r", 3, config, [0, 1, 2, 3], 4)
        assert server.ledger is not None and server.ledger.rounds_recorded("r") == 2
        gate.channel.close()
    finally:
        server.stop(0)


def test_remote_privacy_retries_a_busy_refusal_and_never_takes_it_for_a_spent_budget(tmp_path: Path) -> None:
    """The privacy service's access guard answers RESOURCE_EXHAUSTED when a caller is over its rate or share, as the
    ledger does for a spent budget; the reason it names (fairfl.rpc_refusals.REFUSAL_KEY) tells them apart: the gate
    retries a busy refusal and the round is recorded, where a spent budget would stop the run."""
    from fairfl.rpc_guard import AccessPolicy
    from privacy_service.server import serve

    authorize = "/fairfl.v1.Privacy/AuthorizeRound"
    busy = AccessPolicy(rate_limited=frozenset({authorize}), rate=2.0, burst=1)  # the second call waits ~0.5 s
    server = serve("127.0.0.1:0", str(tmp_path / "ledger.sqlite"), policy=busy)
    try:
        config = experiment_from_dict(dp_config(rounds=5))
        gate = RemotePrivacy(f"127.0.0.1:{server.port}")
        gate.start("r", config)
        started = time.monotonic()
        gate.authorize_round("r", 1, config, [0, 1, 2, 3], 4)
        gate.authorize_round("r", 2, config, [0, 1, 2, 3], 4)  # refused as rate_limited at first, then recorded
        assert time.monotonic() - started >= 0.3  # it did wait for the rate limit
        assert server.ledger is not None and server.ledger.rounds_recorded("r") == 2
        gate.channel.close()
    finally:
        server.stop(0)


# --- the loss clip bound the server carries ---------------------------------------------------------------------------


def result(cid: int, noisy: float) -> ClientResult:
    return ClientResult("t", "r", 1, cid, TRAIN, 10, loss_before=1.0, loss_after=1.0, noisy_loss=noisy)


def test_controller_carries_each_clients_loss_clip() -> None:
    config = experiment_from_dict(dp_config())
    dp = DpController(config)
    cfg = federation_pb2.LocalTrainingConfig(local_steps=1)
    dp.configure(cfg)
    assert cfg.dp.sample_rate == 0.1 and cfg.dp.noise_multiplier == 1.5 and cfg.dp.clip_norm == 1.0
    assert cfg.dp.loss_noise_multiplier == 5.0 and cfg.dp.loss_clip_min == 0.1 and not cfg.dp.shared_loss_batch

    def task_for(cid: int) -> federation_pb2.Task:
        task = federation_pb2.Task(client_id=cid)
        task.train.CopyFrom(cfg)
        dp.fill(task)
        return task

    assert task_for(0).train.dp.loss_clip == 2.5  # C_l^0
    dp.observe([result(0, 0.73), result(1, -0.4), result(2, math.nan)])
    assert task_for(0).train.dp.loss_clip == 0.73  # Eq. 16: the previous noisy loss
    assert task_for(1).train.dp.loss_clip == 0.1  # floored at loss_clip_min
    assert task_for(2).train.dp.loss_clip == 2.5  # no release yet
    assert dp.floor_hits == 1
    restored = DpController(config)
    restored.load_state_dict(dp.state_dict())
    assert restored.loss_clip == dp.loss_clip


def test_noisy_losses_feed_fedfdp_and_the_next_bounds() -> None:
    summary, rounds, _ = run_inprocess(experiment_from_dict(dp_config()))
    assert summary.state == control_pb2.RUN_STATE_COMPLETED, summary.message
    metrics = [{m.name: m.value for m in r.strategy_metrics} for r in rounds]
    # Without plaintext telemetry only the private forms are reported: no Ψ of noiseless losses, no train loss.
    assert all({"global_loss", "psi_noisy"} <= set(m) and not {"psi", "psi_before"} & set(m) for m in metrics)
    assert all(math.isnan(r.mean_train_loss) for r in rounds)
    assert len({m["global_loss"] for m in metrics}) == 3  # F = Σ p_i F̃_i moves every round
    assert rounds[-1].evaluated
    summary_t, rounds_t, _ = run_inprocess(experiment_from_dict(dp_config(**{"privacy.plaintext_telemetry": True})))
    assert torch.equal(summary_t.final_params, summary.final_params)  # telemetry does not change the run
    assert all({"psi", "psi_before", "psi_noisy"} <= {m.name for m in r.strategy_metrics} for r in rounds_t)


def test_fedfdp_with_lambda_zero_is_dp_fedavg_bit_for_bit() -> None:
    fdp, _, _ = run_inprocess(experiment_from_dict(dp_config(**{"strategy.params": {"fair_lambda": 0.0}})))
    avg, _, _ = run_inprocess(experiment_from_dict(dp_config(**{"strategy.name": "fedavg"})))
    fair, _, _ = run_inprocess(experiment_from_dict(dp_config(**{"strategy.params": {"fair_lambda": 1.0}})))
    assert torch.equal(fdp.final_params, avg.final_params)
    assert not torch.equal(fair.final_params, avg.final_params)


def test_dp_fedprox_with_one_local_step_is_dp_fedavg_bit_for_bit() -> None:
    """One DP-SGD step from x_t: the proximal gradient μ(w − x_t) is 0, so DP-FedProx is DP-FedAvg exactly (the
    layerwise clipping path takes the zero prox term without changing a bit); with two steps the term acts."""
    prox = {"strategy.name": "fedprox", "strategy.params": {"mu": 0.5}}
    one, _, _ = run_inprocess(experiment_from_dict(dp_config(**prox)))
    avg, _, _ = run_inprocess(experiment_from_dict(dp_config(**{"strategy.name": "fedavg"})))
    assert torch.equal(one.final_params, avg.final_params)
    two_steps = {"training.local_steps": 2, "rounds": 2}
    two, _, _ = run_inprocess(experiment_from_dict(dp_config(**prox, **two_steps)))
    avg_two, _, _ = run_inprocess(experiment_from_dict(dp_config(**{"strategy.name": "fedavg"}, **two_steps)))
    assert not torch.equal(two.final_params, avg_two.final_params)


@pytest.mark.parametrize("strategy", ["fedprox", "qffl"])
def test_dp_baselines_run(strategy: str) -> None:
    summary, rounds, privacy = run_inprocess(experiment_from_dict(dp_config(**{"strategy.name": strategy})))
    assert summary.state == control_pb2.RUN_STATE_COMPLETED, summary.message
    assert privacy.ledger.rounds_recorded("run") == 3 and rounds[-1].epsilon_spent > 0
    assert "psi_noisy" in {m.name for m in rounds[-1].strategy_metrics}


def test_gradient_only_and_joint_modes_account_as_configured() -> None:
    for mode, mechanisms in (("gradient_only", {"gradient"}), ("joint_batch", {"joint"})):
        summary, _, privacy = run_inprocess(experiment_from_dict(dp_config(**{"privacy.mode": mode})))
        assert summary.state == control_pb2.RUN_STATE_COMPLETED, summary.message
        assert {e.mechanism for e in privacy.ledger.events("run")} == mechanisms


# --- client-level DP-FedAvg -------------------------------------------------------------------------------------------


def test_client_level_aggregation_clips_updates_and_adds_calibrated_noise() -> None:
    config = experiment_from_dict(
        dp_config(
            **{
                "privacy.principal": "federation",
                "strategy.name": "fedavg",
                "privacy.clip_norm": 0.5,
                "privacy.noise_multiplier": 1.0,
                "privacy.epsilon": 50.0,
            }
        )
    )
    dp = DpController(config)
    params = torch.zeros(20000)
    ctx = RoundContext("r", 1, params, [0, 1, 2, 3], federation_pb2.LocalTrainingConfig(), lambda t: None)  # type: ignore[arg-type,return-value]
    huge = ClientResult("t", "r", 1, 0, TRAIN, 10, payloads={UPDATE: torch.full((20000,), 100.0)})
    out = dp.aggregate(ctx, [[huge]])
    # one clipped update of norm 0.5 along (1, …, 1)/√d, divided by m = 4, plus N(0, (σC/m)²)
    noise = out.params.double().numpy() - 0.5 / 4 / math.sqrt(20000)
    assert np.std(noise) == pytest.approx(1.0 * 0.5 / 4, rel=0.03)
    assert stats.kstest(noise / (0.5 / 4), "norm").pvalue > 1e-3
    assert out.weights == {0: 0.25}
    events: list[control_pb2.RunEvent] = []
    summary = RoundEngine(
        "fed", config, InProcessTransport(), LocalSelector("full"), LocalPrivacy(), events.append
    ).run()
    assert summary.state == control_pb2.RUN_STATE_COMPLETED, summary.message


def test_client_level_rounds_report_no_psi_even_with_loss_telemetry() -> None:
    """Only the noisy model leaves a client-level DP round: the engine's Ψ telemetry stays out of it too."""
    config = experiment_from_dict(
        dp_config(
            **{
                "privacy.principal": "federation",
                "strategy.name": "fedavg",
                "privacy.epsilon": 50.0,
                "training.loss_telemetry": True,
            }
        )
    )
    summary, rounds, _ = run_inprocess(config)
    assert summary.state == control_pb2.RUN_STATE_COMPLETED, summary.message
    assert rounds and all(not r.strategy_metrics for r in rounds)


# --- presets ----------------------------------------------------------------------------------------------------------


def test_presets_and_comparisons_load() -> None:
    for path in sorted((REPO / "experiments/fedfdp").glob("*.compare.yaml")):
        spec = load_comparison(path)
        for run in spec.runs:
            config = spec.experiment(run, run.seeds[0])
            assert config.privacy.enabled and config.data.num_clients == 10 and config.data.alpha == 0.1
            # every run fits its budget: the ledger will not stop it before its configured last round
            assert config.rounds == affordable_rounds(config), (path.name, run.label)


def test_cnn_width_fields() -> None:
    from fairfl.data import DataSignature
    from fairfl.models import build_run_model

    fmnist = DataSignature((1, 28, 28), 10)
    small = experiment_from_dict(
        dp_config(**{"model": {"name": "cnn", "params": {"channels": [16, 32], "hidden": 128}}})
    )
    model = build_run_model(small, fmnist)
    assert sum(p.numel() for p in model.parameters()) == 80202
    paper = build_run_model(experiment_from_dict(dp_config(**{"model": {"name": "cnn"}})), fmnist)
    assert sum(p.numel() for p in paper.parameters()) == 582026  # FedAvgCNN (seed-fedfdp §4)
    with pytest.raises(ConfigError, match=r"model.params.channels: expected 2 conv widths"):
        experiment_from_dict(dp_config(**{"model": {"name": "cnn", "params": {"channels": [8]}}}))
    with pytest.raises(ConfigError, match=r"model.params.hidden: must be >= 1"):
        experiment_from_dict(dp_config(**{"model": {"name": "cnn", "params": {"hidden": 0}}}))


def test_fedfdp_global_loss_is_the_weighted_noisy_loss() -> None:
    from aggregator_service.strategies.fedfair import FedFair, FedFairParams
    from fairfl.codec import CodecError
    from fairfl.protocol import check_result

    cfg = federation_pb2.LocalTrainingConfig(local_steps=1, lr=1.0)
    cfg.dp.sample_rate = 0.05
    ctx = RoundContext("r", 1, torch.zeros(3), [0, 1, 2], cfg, lambda t: None)  # type: ignore[arg-type,return-value]
    results = []
    for cid, (n, noisy) in enumerate([(10, 1.0), (30, 2.0), (60, math.nan)]):
        r = ClientResult("t", "r", 1, cid, TRAIN, n, loss_before=1.0, loss_after=0.5 + cid, noisy_loss=noisy)
        r.payloads[UPDATE] = torch.ones(3)
        results.append(r)
    strategy = FedFair(FedFairParams(fair_lambda=0.1), 1.0)
    plan = strategy.configure(ctx, 0, [])
    assert plan is not None and plan.train is not None and plan.train.dp.fair_lambda == pytest.approx(0.1)
    out = strategy.aggregate(ctx, [results])
    # p = (0.1, 0.3, 0.6); client 2 released nothing: F = (0.1·1 + 0.3·2) / 0.4
    assert out.metrics["global_loss"] == pytest.approx(0.7 / 0.4) == strategy.global_loss
    assert not {"psi", "psi_before", "psi_noisy"} & set(out.metrics)  # under DP, Ψ is all the engine's telemetry
    telemetry = psi_telemetry(results)
    assert telemetry["psi"] == pytest.approx(psi([0.5, 1.5, 2.5], [10, 30, 60]))
    assert telemetry["psi_noisy"] == pytest.approx(psi([1.0, 2.0], [10, 30]))  # over the two releases
    bad = ClientResult("t", "r", 1, 0, TRAIN, 10, loss_before=1.0, loss_after=1.0, noisy_loss=math.inf)
    bad.payloads[UPDATE] = torch.ones(3)
    with pytest.raises(CodecError, match="noisy_loss must be finite"):
        check_result(bad)
    bad.noisy_loss = -0.3  # noise can make a release negative: accepted
    check_result(bad)
