"""FairFL clustering service: client selection (samplers/) and stateless clustering (clustering.py).

The samplers and clustering functions take and return plain Python/numpy objects, so the composition layer's
in-process selection (fairfl.compose.local_selection) calls them directly; `ClusteringServicer` is the thin gRPC
layer over the same code. Samplers are resolved through the registry (fairfl.sampling.SAMPLERS), so a user's sampler
named by module:attr runs in this process.
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
from clustering_service.samplers import Sampler, SelectionInput, SelectionOutput, get_sampler, select
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
    "SelectionOutput",
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
