"""FairFL clustering service: client selection (samplers/) and stateless clustering (clustering.py).

The samplers and clustering functions take and return plain Python/numpy objects, so the aggregator's in-process
transport calls them directly; `ClusteringServicer` is the thin gRPC layer over the same code.
"""

from clustering_service.clustering import (
    distance_from_similarity,
    equal_cluster_weights,
    hierarchical_clusters,
    nmi,
    similarity_from_rows,
    spectral_clusters,
)
from clustering_service.errors import InvalidInput
from clustering_service.samplers import (
    Sampler,
    SelectionInput,
    SelectionMethod,
    SelectionOutput,
    SelectionParams,
    get_sampler,
    select,
)
from clustering_service.server import main, serve
from clustering_service.servicer import SERVICE_NAME, ClusteringServicer
from clustering_service.state import RunState, Signature, StateStore

__all__ = [
    "SERVICE_NAME",
    "ClusteringServicer",
    "InvalidInput",
    "RunState",
    "Sampler",
    "SelectionInput",
    "SelectionMethod",
    "SelectionOutput",
    "SelectionParams",
    "Signature",
    "StateStore",
    "distance_from_similarity",
    "equal_cluster_weights",
    "get_sampler",
    "hierarchical_clusters",
    "main",
    "nmi",
    "select",
    "serve",
    "similarity_from_rows",
    "spectral_clusters",
]
