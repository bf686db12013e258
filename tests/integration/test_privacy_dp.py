"""DP runs over gRPC with real processes: the privacy service is SIGKILLed mid-run and restarted on the same ledger
file; and the distributed DP path against the in-process oracle (seeded DP randomness ⇒ the same model)."""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from aggregator_service.dp import round_events
from fairfl import accounting as accountant
from fairfl.compose.launcher import LocalCluster
from fairfl.compose.local_privacy import LocalPrivacy
from fairfl.config import ConfigError, ExperimentConfig, experiment_from_dict
from fairfl.privacy import RANDOMNESS_ENV
from fairfl.rpc_channel import open_channel
from fairfl.rpc_security import TransportSecurity
from fairfl.v1 import control_pb2, control_pb2_grpc, privacy_pb2, privacy_pb2_grpc

ROUNDS = 8
REPO = Path(__file__).resolve().parents[2]


def dp_config(rounds: int = ROUNDS, **privacy: Any) -> ExperimentConfig:
    return experiment_from_dict(
        {
            "name": "dp",
            "seed": 11,
            "rounds": rounds,
            "data": {"dataset": "synthetic", "num_clients": 6},
            "model": {"name": "mlp", "params": {"hidden": [16]}},
            "training": {"local_steps": 2, "lr": 1.0, "batch_size": 20, "loss_eval_batches": 1},
            "strategy": {"name": "fedfair", "params": {"fair_lambda": 0.5}},
            "selection": {"method": "full", "clients_per_round": 6},
            "evaluation": {"every": 4},
            "runtime": {"agents": 2, "round_timeout_s": 60, "register_timeout_s": 60},
            "privacy": {
                "enabled": True,
                "epsilon": 20.0,
                "sample_rate": 0.1,
                "noise_multiplier": 1.2,
                "clip_norm": 1.0,
                **privacy,
            },
        }
    )


def uninterrupted_epsilon(config: ExperimentConfig, rounds: int) -> float:
    """ε of one client after `rounds` uninterrupted rounds, from the accountant directly."""
    specs = [
        accountant.EventSpec(e.sample_rate, e.noise_multiplier, e.count * rounds)
        for e in round_events(config, [0], config.data.num_clients)
    ]
    return accountant.epsilon(specs, config.privacy.delta)[0]


def spend(address: str, run_id: str, security: TransportSecurity | None) -> privacy_pb2.GetSpendReply:
    with open_channel(address, security) as channel:
        return privacy_pb2_grpc.PrivacyStub(channel).GetSpend(privacy_pb2.GetSpendRequest(run_id=run_id), timeout=10)


@pytest.mark.integration
def test_privacy_service_killed_mid_run_loses_nothing_and_counts_nothing_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RANDOMNESS_ENV, "task")
    config = dp_config()
    db = tmp_path / "privacy-ledger.sqlite"
    with LocalCluster(tmp_path / "logs") as cluster:
        aggregator, _clustering, privacy = cluster.start_services(tmp_path)
        port = privacy.port
        cluster.start_agents(aggregator.address, config.data.num_clients, config.runtime.agents, "cpu", 1)
        with cluster.open_channel(aggregator.address) as channel:
            control = control_pb2_grpc.RunControlStub(channel)
            control.StartRun(control_pb2.StartRunRequest(experiment_yaml=config.to_yaml(), run_id="crash"), timeout=30)
            events = []
            killed_at = restarted_at = None
            for event in control.WatchRun(control_pb2.WatchRunRequest(run_id="crash"), timeout=300):
                events.append(event)
                if event.HasField("round") and event.round.round == 3 and killed_at is None:
                    cluster.kill("privacy")  # SIGKILL: no shutdown, no flush beyond what SQLite committed
                    killed_at = time.time()
                    time.sleep(2.0)  # meanwhile the aggregator asks a dead service to authorize the next round
                    restarted = cluster.start_service(
                        "privacy-restarted", "privacy_service", ["--bind", f"127.0.0.1:{port}", "--db", str(db)]
                    )
                    assert restarted.port == port
                    restarted_at = time.time()
        final = [e.status for e in events if e.HasField("status")][-1]
        assert final.state == control_pb2.RUN_STATE_COMPLETED, final.message
        rounds = [e.round for e in events if e.HasField("round")]
        assert [r.round for r in rounds] == list(range(1, ROUNDS + 1))

        reply = spend(f"127.0.0.1:{port}", "crash", cluster.security)
        want = uninterrupted_epsilon(config, ROUNDS)
        assert reply.rounds_recorded == ROUNDS
        assert len(reply.spends) == config.data.num_clients
        for s in reply.spends:
            assert s.epsilon == pytest.approx(want, rel=1e-12), s.principal
            assert s.events == 2 * ROUNDS  # gradient + loss per round, each recorded once
        assert rounds[-1].epsilon_spent == pytest.approx(want, rel=1e-12)

        # A replayed call (the same round, the same events) is acknowledged and adds nothing.
        with cluster.open_channel(f"127.0.0.1:{port}") as channel:
            stub = privacy_pb2_grpc.PrivacyStub(channel)
            from aggregator_service.peers import _MECHANISM_ENUM

            request = privacy_pb2.AuthorizeRoundRequest(
                run_id="crash",
                round=5,
                events=[
                    privacy_pb2.PrivacyEvent(
                        principal=e.principal,
                        mechanism=_MECHANISM_ENUM[e.mechanism],  # type: ignore[arg-type]
                        sample_rate=e.sample_rate,
                        noise_multiplier=e.noise_multiplier,
                        count=e.count,
                    )
                    for e in round_events(config, list(range(6)), 6)
                ],
            )
            again = stub.AuthorizeRound(request, timeout=10)
            assert again.granted and again.replayed
        after = spend(f"127.0.0.1:{port}", "crash", cluster.security)
        assert [s.epsilon for s in after.spends] == [s.epsilon for s in reply.spends]
        assert after.rounds_recorded == ROUNDS
    # The run went on across the restart: rounds were recorded before the kill and after the restart, and the round
    # the aggregator was authorizing during the outage waited for the restarted service.
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as ledger:
        recorded = dict(ledger.execute("SELECT round, recorded_at FROM rounds WHERE run_id = 'crash'").fetchall())
    assert killed_at is not None and restarted_at is not None
    assert sorted(recorded) == list(range(1, ROUNDS + 1))
    assert all(recorded[r] < killed_at for r in (1, 2, 3))
    assert recorded[5] >= restarted_at - 1.0 and max(recorded.values()) >= restarted_at - 1.0


@pytest.mark.integration
def test_dp_run_over_grpc_matches_inprocess(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.integration.test_grpc_equivalence import oracle, run_over_grpc

    monkeypatch.setenv(RANDOMNESS_ENV, "task")  # seeded DP sampling and noise in the agents: reproducible
    config = dp_config(rounds=3)
    expected, oracle_rounds = oracle(config)
    params, events, _logs = run_over_grpc(config, tmp_path)
    final = [e.status for e in events if e.HasField("status")][-1]
    assert final.state == control_pb2.RUN_STATE_COMPLETED, final.message
    rounds = [e.round for e in events if e.HasField("round")]
    for got, want in zip(rounds, oracle_rounds, strict=True):
        assert got.epsilon_spent == pytest.approx(want.epsilon_spent, rel=1e-12)
        got_metrics = {m.name: m.value for m in got.strategy_metrics}
        want_metrics = {m.name: m.value for m in want.strategy_metrics}
        assert got_metrics["global_loss"] == pytest.approx(want_metrics["global_loss"], abs=1e-6)
    assert float((params - expected).abs().max()) <= 1e-6
    assert not torch.equal(expected, torch.zeros_like(expected))


# --- the sound range (issue #18): refused before round 1 --------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize(
    ("transport", "sigma"), [("inprocess", "1.0e-156"), ("grpc", "1.0e-156"), ("inprocess", "1.0e+300")]
)
def test_cli_refuses_a_noise_multiplier_outside_the_sound_range(transport: str, sigma: str, tmp_path: Path) -> None:
    """The issue's reproduction: this run used to complete with epsilon_spent 0 (σ = 1e-156) or end in INTERNAL."""
    sets = [f"privacy.noise_multiplier={sigma}", f"privacy.loss_noise_multiplier={sigma}", "privacy.epsilon=1.0"]
    command = [sys.executable, "-m", "fairfl.compose", "run", "experiments/quickstart.yaml", "--transport", transport]
    command += ["--rounds", "2", "--output", str(tmp_path / "run"), "--set", "privacy.enabled=true"]
    for s in sets:
        command += ["--set", s]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, done.stdout
    assert "privacy.noise_multiplier: must be in [0.3, 10000]" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr + done.stdout
    assert not (tmp_path / "run").exists()  # refused at load: nothing started, nothing written


@pytest.mark.integration
@pytest.mark.parametrize(("transport", "said"), [("inprocess", "ConfigError: privacy.noise_multiplier"), ("grpc", "")])
def test_cli_fails_a_run_the_ledger_cannot_resolve_with_its_reason(transport: str, said: str, tmp_path: Path) -> None:
    """σ and q inside the sound range whose rounds the accountant still rounds to ε = 0: the config loads, and the run
    fails before round 1 with the ledger's reason (in-process: naming the fields; over gRPC: the privacy service's
    words, not a gRPC error's repr), no traceback in the output or the services' logs."""
    command = [sys.executable, "-m", "fairfl.compose", "run", "experiments/quickstart.yaml", "--transport", transport]
    command += ["--rounds", "2", "--output", str(tmp_path / "run"), "--set", "privacy.enabled=true"]
    for s in ("noise_multiplier=9000", "loss_noise_multiplier=9000", "sample_rate=0.001", "epsilon=1.0"):
        command += ["--set", f"privacy.{s}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "RUN_STATE_FAILED" in output and "gives ε = 0.0" in output and said in output, output
    assert "_InactiveRpcError" not in output
    logs = [p.read_text() for p in (tmp_path / "run").rglob("*.log")]
    assert "Traceback" not in output + "".join(logs)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["rounds_completed"] == 0


def test_in_process_ledger_refuses_an_unaccountable_run_before_round_1() -> None:
    """A config built without loading (so without its validation) still meets the sound range at LocalPrivacy.start,
    as does one inside the range whose rounds the accountant cannot resolve (ε = 0)."""
    config = dp_config()
    privacy = LocalPrivacy()
    bad_sigma = dataclasses.replace(config, privacy=dataclasses.replace(config.privacy, noise_multiplier=1e-156))
    with pytest.raises(ConfigError, match=r"^privacy\.noise_multiplier: must be in \[0\.3, 10000\]"):
        privacy.start("bad-sigma", bad_sigma)
    unresolved = dataclasses.replace(
        config,
        privacy=dataclasses.replace(
            config.privacy, noise_multiplier=9000.0, loss_noise_multiplier=9000.0, sample_rate=0.001
        ),
    )
    with pytest.raises(ConfigError, match=r"^privacy\.noise_multiplier, privacy\.sample_rate.*ε = 0\.0"):
        privacy.start("unresolved", unresolved)
    assert privacy.run_ids == []  # no budget was registered for either
    privacy.start("fine", config)
    assert privacy.authorize_round("fine", 1, config, [0, 1], config.data.num_clients) > 0
