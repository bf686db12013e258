"""Equitable-FL over gRPC against the in-process oracle: the aggregator asks the clustering service (its own process)
to cluster each round's activation vectors, and the run ends on the same model, round by round, as the in-process
engine with its in-process clustering under the same seed. Also the gRPC clustering peer on its own."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

from aggregator_service.clustering_peer import ClusteringFailed, RemoteClusterer
from aggregator_service.engine import RoundEngine
from clustering_service.servicer import ClusteringServicer
from fairfl import codec
from fairfl.compose.inprocess import InProcessTransport
from fairfl.compose.launcher import LocalCluster
from fairfl.compose.local_privacy import LocalPrivacy
from fairfl.compose.local_selection import LocalClusterer, LocalSelector
from fairfl.config import ExperimentConfig, experiment_from_dict
from fairfl.data.datasets import DatasetNotFoundError, load_dataset
from fairfl.rpc_server import start_server
from fairfl.v1 import clustering_pb2, clustering_pb2_grpc, control_pb2, control_pb2_grpc


def _fashion_mnist_available() -> bool:
    try:
        load_dataset("fashion_mnist", "test")
    except DatasetNotFoundError:
        return False
    return True


def _config() -> ExperimentConfig:
    # The paper's MNIST grouping, scaled down: groups of 2 and 4 clients with disjoint labels (classes 0-3 / 4-9).
    return experiment_from_dict(
        {
            "name": "equitable-equivalence",
            "seed": 5,
            "rounds": 3,
            "data": {
                "dataset": "fashion_mnist",
                "num_clients": 6,
                "partition": "label_groups",
                "group_sizes": [2, 4],
                "group_classes": [4, 6],
                "samples_per_class": 30,
                "test_per_client": 60,
            },
            "model": {"name": "mlp", "params": {"hidden": [32, 16]}},
            "training": {"local_epochs": 2, "batch_size": 20, "lr": 0.05},
            "strategy": {"name": "equitable", "params": {"num_clusters": 2, "mu": 0.01}},
            "selection": {"clients_per_round": 3},
            "evaluation": {"every": 3},
            "runtime": {"agents": 2, "round_timeout_s": 60, "register_timeout_s": 60},
        }
    )


def _clusters(event: control_pb2.RoundEvent) -> list[tuple[int, int, int]]:
    return [(c.client_id, c.cluster, c.true_group) for c in event.clusters]


def _metrics(event: control_pb2.RoundEvent) -> dict[str, float]:
    return {m.name: m.value for m in event.strategy_metrics}


@pytest.mark.integration
def test_equitable_over_grpc_matches_inprocess(tmp_path: Path) -> None:
    if not _fashion_mnist_available():
        pytest.skip("Fashion-MNIST is not installed (Debian package dataset-fashion-mnist)")
    config = _config()
    events: list[control_pb2.RunEvent] = []
    selector = LocalSelector(config.selection.method)
    oracle = RoundEngine(
        "oracle", config, InProcessTransport(), selector, LocalPrivacy(), events.append, clusterer=LocalClusterer()
    )
    summary = oracle.run()
    assert summary.state == control_pb2.RUN_STATE_COMPLETED, summary.message
    want = [e.round for e in events if e.HasField("round")]

    with LocalCluster(tmp_path / "logs") as cluster:
        aggregator, clustering, _privacy = cluster.start_services(tmp_path)
        cluster.start_agents(aggregator.address, config.data.num_clients, config.runtime.agents, "cpu", 1)
        with cluster.open_channel(aggregator.address) as channel:
            control = control_pb2_grpc.RunControlStub(channel)
            control.StartRun(control_pb2.StartRunRequest(experiment_yaml=config.to_yaml(), run_id="eq"), timeout=30)
            stream = list(control.WatchRun(control_pb2.WatchRunRequest(run_id="eq"), timeout=300))
            _, tensors = codec.receive_bundle(control.FetchModel(control_pb2.GetRunRequest(run_id="eq"), timeout=30))
        with urllib.request.urlopen(f"http://{clustering.metrics_address}/metrics", timeout=10) as page:
            scraped = page.read().decode()

    final = [e.status for e in stream if e.HasField("status")][-1]
    assert final.state == control_pb2.RUN_STATE_COMPLETED, final.message
    got = [e.round for e in stream if e.HasField("round")]
    assert [r.round for r in got] == [1, 2, 3]
    for g, w in zip(got, want, strict=True):
        assert list(g.selected) == list(w.selected)
        assert _clusters(g) == _clusters(w) and len(g.clusters) == 3
        assert list(g.aggregation_weights) == list(w.aggregation_weights)
        assert _metrics(g)["nmi"] == _metrics(w)["nmi"]
        assert g.model_sha256 == w.model_sha256  # the same model after every round
    assert any(_metrics(w)["all_groups_present"] == 1.0 and _metrics(w)["nmi"] == 1.0 for w in want)
    assert torch.equal(torch.cat([t.reshape(-1) for _, t in tensors]), summary.final_params)
    # The gRPC run clustered in the clustering service's process: one spectral Cluster call per round.
    calls = re.search(r'clustering_duration_seconds_count\{method="spectral"\} (\S+)', scraped)
    assert calls is not None and float(calls.group(1)) == 3.0


def test_remote_clusterer_matches_local_and_reports_refusals() -> None:
    def register(server: grpc.Server) -> list[str]:
        clustering_pb2_grpc.add_ClusteringServicer_to_server(ClusteringServicer(), server)
        return ["fairfl.v1.Clustering"]

    running = start_server("127.0.0.1:0", register)
    try:
        remote = RemoteClusterer(f"127.0.0.1:{running.port}")
        rows = torch.tensor([[-1.0, -3.0], [-1.1, -2.9], [-3.0, -1.0], [-2.8, -1.2]], dtype=torch.float64)
        request = clustering_pb2.ClusterRequest(
            run_id="r",
            round=1,
            method=clustering_pb2.CLUSTER_METHOD_SPECTRAL,
            num_clusters=2,
            client_ids=[3, 5, 8, 9],
            rows=codec.tensor_to_proto("activations", rows),
            seed=17,
            true_groups=[0, 0, 1, 1],
        )
        reply = remote(request)
        assert reply == LocalClusterer()(request)
        assert list(reply.labels) == [0, 0, 1, 1] and list(reply.equal_cluster_weights) == [0.25] * 4
        assert reply.nmi == pytest.approx(1.0)
        request.num_clusters = 5
        with pytest.raises(ClusteringFailed, match=r"INVALID_ARGUMENT: .*num_clusters must be in \[1, 4\]"):
            remote(request)
        remote.channel.close()
    finally:
        running.stop(0)
