"""Selection and clustering in-process: the clustering service's code called directly, for runs whose every part is one
process (`fairfl run --transport inprocess`, `compare` workers, tests). The composition layer injects these into the
round engine; the aggregator service itself only ever reaches the clustering service over gRPC
(aggregator_service.peers, aggregator_service.clustering_peer), so no service imports another.

Both take the same requests as the gRPC peers and run the same code as the service (the sampler resolved through the
same registry, the same signature decoding, `cluster_reply`), so both transports select and cluster identically.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from aggregator_service.clustering_peer import ClusteringFailed
from aggregator_service.selection import SelectionContext, selection_input
from clustering_service.samplers import run_sampler
from clustering_service.servicer import cluster_reply, signature_from_proto
from clustering_service.state import StateStore
from fairfl.sampling import SAMPLERS, InvalidInput, SelectionOutput
from fairfl.v1 import clustering_pb2

__all__ = ["LocalClusterer", "LocalSelector"]


class LocalSelector:
    """The sampler `method` names (a registered name or module:attr, as in selection.method) run in this process,
    with the service's per-run signature store."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.sampler = SAMPLERS.load(method, "selection.method")()
        self.store = StateStore()
        self.latest: dict[tuple[str, int], clustering_pb2.ClientSignature] = {}  # (run, client): for checkpoints

    def select(self, context: SelectionContext) -> SelectionOutput:
        return run_sampler(self.sampler, selection_input(context), self.store.run(context.run_id), "selection.params")

    def report_signatures(self, run_id: str, signatures: Sequence[clustering_pb2.ClientSignature]) -> None:
        self.store.run(run_id).put([signature_from_proto(s) for s in signatures])
        for sig in signatures:
            old = self.latest.get((run_id, sig.client_id))
            if old is None or sig.round >= old.round:
                self.latest[(run_id, sig.client_id)] = sig

    def state_dict(self) -> dict[str, Any]:
        """The latest signature of every client (the store keeps nothing else), as in RemoteSelector.state_dict."""
        cached = sorted(self.latest.items())
        return {"signatures": [[run, np.frombuffer(s.SerializeToString(), dtype=np.uint8)] for (run, _), s in cached]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for run, raw in state.get("signatures", []):
            sig = clustering_pb2.ClientSignature.FromString(np.asarray(raw, dtype=np.uint8).tobytes())
            self.report_signatures(str(run), [sig])


class LocalClusterer:
    """The clustering service's Cluster call in-process (the same `cluster_reply` the servicer runs)."""

    def __call__(self, request: clustering_pb2.ClusterRequest) -> clustering_pb2.ClusterReply:
        try:
            return cluster_reply(request)
        except InvalidInput as err:
            raise ClusteringFailed(f"Cluster(run {request.run_id!r}) round {request.round}: {err}") from None
