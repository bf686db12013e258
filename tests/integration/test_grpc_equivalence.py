"""The distributed path against the in-process oracle: same seed, same global model.

Aggregator, clustering and privacy services and two client agents run as separate OS processes on loopback.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aggregator_service.engine import RoundEngine
from fairfl import codec
from fairfl.compose.inprocess import InProcessTransport
from fairfl.compose.launcher import LocalCluster
from fairfl.compose.local_privacy import LocalPrivacy
from fairfl.compose.local_selection import LocalClusterer, LocalSelector
from fairfl.config import ExperimentConfig, experiment_from_dict
from fairfl.data.datasets import DatasetNotFoundError, load_dataset
from fairfl.v1 import control_pb2, control_pb2_grpc, privacy_pb2, privacy_pb2_grpc

STRATEGY_PARAMS = {"fedavg": {}, "fedeba_plus": {"alpha": 0.9, "tau": 0.1}}


def _config(dataset: str, strategy: str = "fedavg", placement: str = "partitioned") -> ExperimentConfig:
    num_clients = 12 if dataset == "synthetic" else 20
    return experiment_from_dict(
        {
            "name": "equivalence",
            "seed": 7,
            "rounds": 3,
            "data": {"dataset": dataset, "num_clients": num_clients, "partition": "shards", "shards_per_client": 2},
            "model": {"name": "mlp", "params": {"hidden": [32, 16]}},
            "training": {"local_steps": 5, "batch_size": 20, "lr": 0.05},
            "selection": {"clients_per_round": 4},
            "strategy": {"name": strategy, "params": STRATEGY_PARAMS[strategy]},
            "evaluation": {"every": 1},
            "runtime": {"agents": 2, "round_timeout_s": 60, "register_timeout_s": 60, "placement": placement},
        }
    )


def oracle(config: ExperimentConfig) -> tuple[torch.Tensor, list[control_pb2.RoundEvent]]:
    events: list[control_pb2.RunEvent] = []
    selector = LocalSelector(config.selection.method)
    engine = RoundEngine(
        "oracle", config, InProcessTransport(), selector, LocalPrivacy(), events.append, clusterer=LocalClusterer()
    )
    summary = engine.run()
    assert summary.state == control_pb2.RUN_STATE_COMPLETED, summary.message
    return summary.final_params, [e.round for e in events if e.HasField("round")]


def fetch_model(control: control_pb2_grpc.RunControlStub, run_id: str) -> torch.Tensor:
    _, tensors = codec.receive_bundle(control.FetchModel(control_pb2.GetRunRequest(run_id=run_id), timeout=30))
    return torch.cat([t.reshape(-1) for _, t in tensors])


def run_over_grpc(config: ExperimentConfig, workdir: Path) -> tuple[torch.Tensor, list[control_pb2.RunEvent], str]:
    with LocalCluster(workdir / "logs") as cluster:
        aggregator, _clustering, privacy = cluster.start_services(workdir)
        agents = cluster.start_agents(
            aggregator.address,
            config.data.num_clients,
            config.runtime.agents,
            "cpu",
            1,
            placement=config.agent_placement(),
        )
        assert len({a.process.pid for a in agents} | {aggregator.process.pid, privacy.process.pid}) == 4
        with cluster.open_channel(aggregator.address) as channel:  # mTLS as the launcher's operator
            control = control_pb2_grpc.RunControlStub(channel)
            control.StartRun(control_pb2.StartRunRequest(experiment_yaml=config.to_yaml(), run_id="eq"), timeout=30)
            events = list(control.WatchRun(control_pb2.WatchRunRequest(run_id="eq"), timeout=300))
            params = fetch_model(control, "eq")
        with cluster.open_channel(privacy.address) as channel:
            spend = privacy_pb2_grpc.PrivacyStub(channel).GetSpend(privacy_pb2.GetSpendRequest(run_id="eq"), timeout=10)
        agent_logs = "".join((workdir / "logs" / f"agent-{i}.log").read_text() for i in range(2))
    return params, events, agent_logs + f"\nrounds_recorded={spend.rounds_recorded}"


def _fashion_mnist_available() -> bool:
    try:
        load_dataset("fashion_mnist", "test")
    except DatasetNotFoundError:
        return False
    return True


@pytest.mark.integration
@pytest.mark.parametrize(
    ("dataset", "strategy", "placement"),
    [
        ("synthetic", "fedavg", "partitioned"),
        ("fashion_mnist", "fedavg", "replicated"),  # every agent hosts every client: tasks go to the least loaded
        ("synthetic", "fedeba_plus", "replicated"),
    ],
)
def test_grpc_matches_inprocess(dataset: str, strategy: str, placement: str, tmp_path: Path) -> None:
    if dataset == "fashion_mnist" and not _fashion_mnist_available():
        pytest.skip("Fashion-MNIST is not installed (Debian package dataset-fashion-mnist)")
    config = _config(dataset, strategy, placement)
    phases = 2 if strategy == "fedeba_plus" else 1  # FedEBA+: probe (loss + gradient at x_t), then aligned training
    expected, oracle_rounds = oracle(config)
    params, events, logs = run_over_grpc(config, tmp_path)

    final = [e.status for e in events if e.HasField("status")][-1]
    assert final.state == control_pb2.RUN_STATE_COMPLETED, final.message
    rounds = [e.round for e in events if e.HasField("round")]
    assert [r.round for r in rounds] == [1, 2, 3]
    # Same selection and the same evaluation of every client, round by round.
    for got, want in zip(rounds, oracle_rounds, strict=True):
        assert list(got.selected) == list(want.selected)
        assert got.results_accepted == phases * len(got.selected) and got.results_rejected == 0
        assert list(got.aggregation_weights) == list(want.aggregation_weights)
        assert list(got.strategy_metrics) == list(want.strategy_metrics)
        assert got.model_sha256 == want.model_sha256  # streamed in arrival order, summed to the same bits
        assert [c.accuracy for c in got.clients] == pytest.approx([c.accuracy for c in want.clients], abs=1e-9)
        assert len(got.clients) == config.data.num_clients
    assert params.shape == expected.shape
    assert torch.equal(params, expected)
    assert not torch.equal(expected, oracle_initial(config)), "training must have moved the model"
    # Both agents did work, and the privacy service logged every round of the (non-private) run.
    assert "registered as" in logs and "rounds_recorded=3" in logs
    hosted = config.data.num_clients if placement == "replicated" else config.data.num_clients // 2
    assert logs.count(f"prepared run eq: {hosted} local clients") == 2


def oracle_initial(config: ExperimentConfig) -> torch.Tensor:
    from aggregator_service.engine import initial_model

    return initial_model(config)[1]
