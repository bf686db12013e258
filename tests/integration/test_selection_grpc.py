"""HiCS-FL and power-of-choice over gRPC against the in-process oracle: the aggregator reports signatures to and asks
selections of a separate clustering-service process (and probes candidates' losses through real agents); the same
seed must give the same clients every round and the same model, bit for bit. One cluster serves both runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from fairfl.compose.launcher import LocalCluster
from fairfl.config import ExperimentConfig, experiment_from_dict
from fairfl.v1 import control_pb2, control_pb2_grpc
from tests.integration.test_grpc_equivalence import oracle

NUM_CLIENTS = 12


def _config(method: str, rounds: int, params: dict[str, object]) -> ExperimentConfig:
    return experiment_from_dict(
        {
            "name": f"selection-{method}",
            "seed": 11,
            "rounds": rounds,
            "data": {"dataset": "synthetic", "num_clients": NUM_CLIENTS},
            "model": {"name": "mlp", "params": {"hidden": [16]}},
            "training": {"local_steps": 4, "batch_size": 16, "lr": 0.05},
            "selection": {"method": method, "clients_per_round": 4, "params": params},
            "evaluation": {"every": 100},
            "runtime": {"agents": 2, "round_timeout_s": 60, "register_timeout_s": 60},
        }
    )


CONFIGS = {
    # K = 4 of 12: rounds 1-3 are HiCS-FL's warm-up, rounds 4-5 cluster the bias updates reported so far.
    "hics": _config("hics", 5, {"temperature": 0.01}),
    "powd": _config("power_of_choice", 2, {"candidates": 8}),
}


@pytest.mark.integration
def test_selection_over_grpc_matches_inprocess(tmp_path: Path) -> None:
    got: dict[str, list[control_pb2.RoundEvent]] = {}
    with LocalCluster(tmp_path / "logs") as cluster:
        aggregator, _clustering, _privacy = cluster.start_services(tmp_path)
        cluster.start_agents(aggregator.address, NUM_CLIENTS, 2, "cpu", 1)
        with cluster.open_channel(aggregator.address) as channel:
            control = control_pb2_grpc.RunControlStub(channel)
            for run_id, config in CONFIGS.items():  # one run at a time, the same agents
                control.StartRun(
                    control_pb2.StartRunRequest(experiment_yaml=config.to_yaml(), run_id=run_id), timeout=30
                )
                events = list(control.WatchRun(control_pb2.WatchRunRequest(run_id=run_id), timeout=300))
                final = [e.status for e in events if e.HasField("status")][-1]
                assert final.state == control_pb2.RUN_STATE_COMPLETED, final.message
                got[run_id] = [e.round for e in events if e.HasField("round")]
    for run_id, config in CONFIGS.items():
        _, want = oracle(config)
        rounds = got[run_id]
        assert [r.round for r in rounds] == list(range(1, config.rounds + 1))
        assert [list(r.selected) for r in rounds] == [list(r.selected) for r in want], run_id
        assert [r.model_sha256 for r in rounds] == [r.model_sha256 for r in want], run_id
        assert all(r.selection_seconds > 0 for r in rounds)
    # HiCS-FL's warm-up visited every client once; the clustered rounds then chose from the reported signatures.
    assert sorted(c for r in got["hics"][:3] for c in r.selected) == list(range(NUM_CLIENTS))
