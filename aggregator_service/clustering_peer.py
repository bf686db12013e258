"""How the engine reaches the clustering service's Cluster call: over gRPC (here), or the same code in-process
(fairfl.compose.local_selection.LocalClusterer, injected by the composition layer: a service imports no other).

Both take and return the protobuf messages and run `clustering_service.servicer.cluster_reply`, so a strategy gets
the same clusters from either transport for the same request (the request carries the seed of k-means).
"""

from __future__ import annotations

import grpc

from fairfl.rpc import SHORT_DEADLINE
from fairfl.rpc_channel import open_channel
from fairfl.v1 import clustering_pb2, clustering_pb2_grpc


class ClusteringFailed(RuntimeError):
    """The clustering service refused or could not serve a Cluster call; the message says why."""


class NoClusterer:
    """The engine's clusterer when none was given: a strategy that asks for clusters fails with the reason."""

    def __call__(self, request: clustering_pb2.ClusterRequest) -> clustering_pb2.ClusterReply:
        raise ClusteringFailed(
            f"round {request.round}: the strategy asked for clusters but this engine has no clustering peer "
            "(the aggregator needs --clustering; in-process, pass fairfl.compose.local_selection.LocalClusterer())"
        )


class RemoteClusterer:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = open_channel(address)
        self.stub = clustering_pb2_grpc.ClusteringStub(self.channel)

    def __call__(self, request: clustering_pb2.ClusterRequest) -> clustering_pb2.ClusterReply:
        try:
            return self.stub.Cluster(request, timeout=SHORT_DEADLINE, wait_for_ready=True)
        except grpc.RpcError as err:
            raise ClusteringFailed(
                f"clustering service at {self.address}: Cluster round {request.round} failed with "
                f"{err.code().name}: {err.details()}"
            ) from None

    def close(self) -> None:
        self.channel.close()
