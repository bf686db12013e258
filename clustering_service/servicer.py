"""gRPC servicer for fairfl.v1.Clustering: decode, validate, delegate, encode. No algorithm lives here."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import grpc
import numpy as np
from numpy.typing import NDArray

from clustering_service import clustering, samplers
from clustering_service.state import StateStore
from fairfl import codec, telemetry
from fairfl.plugins import params_from_struct
from fairfl.rpc_refusals import abort
from fairfl.sampling import SAMPLERS, InvalidInput, Sampler, SelectionInput, Signature
from fairfl.schema import ConfigError
from fairfl.v1 import clustering_pb2, clustering_pb2_grpc, tensor_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = "fairfl.v1.Clustering"
_FLOAT_DTYPES = (tensor_pb2.DTYPE_FLOAT32, tensor_pb2.DTYPE_FLOAT64)


def decode_float_tensor(message: tensor_pb2.Tensor, what: str, ndim: int) -> NDArray[np.float64]:
    """A float32/float64 tensor of rank `ndim` as float64 numpy; raises InvalidInput naming `what`."""
    if message.spec.dtype not in _FLOAT_DTYPES:
        raise InvalidInput(
            f"{what}: dtype must be DTYPE_FLOAT32 or DTYPE_FLOAT64, got {codec.dtype_name(message.spec.dtype)}"
        )
    if len(message.spec.shape) != ndim:
        raise InvalidInput(f"{what}: expected a {ndim}-D tensor, got shape {list(message.spec.shape)}")
    try:
        tensor = codec.tensor_from_proto(message)
    except codec.CodecError as err:
        raise InvalidInput(f"{what}: {err}") from None
    arr = tensor.numpy().astype(np.float64)
    if not np.isfinite(arr).all():
        raise InvalidInput(f"{what}: contains NaN or inf")
    return arr


def signature_from_proto(msg: clustering_pb2.ClientSignature) -> Signature:
    vectors = {
        name: decode_float_tensor(getattr(msg, name), f"client {msg.client_id}: {name}", ndim=1)
        for name in ("bias_update", "activation")
        if msg.HasField(name)
    }
    return Signature(client_id=msg.client_id, round=msg.round, num_samples=msg.num_samples, loss=msg.loss, **vectors)


def selection_input_from_proto(request: clustering_pb2.SelectRequest, params: Any = None) -> SelectionInput:
    """The transport-free request; its constructor does the validation shared with the in-process path. `params` is
    the sampler's Params instance (sampler_request resolves it)."""
    n = len(request.candidates)
    similarity = None
    if request.HasField("similarity"):
        similarity = decode_float_tensor(request.similarity, "similarity", ndim=2)
    return SelectionInput(
        run_id=request.run_id,
        round=request.round,
        num_to_select=request.num_to_select,
        candidates=np.asarray(request.candidates, dtype=np.int64).reshape(n),
        seed=request.seed,
        params=params,
        # Unset repeated fields arrive empty: treat empty as "not given" rather than as a length mismatch.
        candidate_losses=np.asarray(request.candidate_losses) if request.candidate_losses else None,
        candidate_num_samples=np.asarray(request.candidate_num_samples) if request.candidate_num_samples else None,
        similarity=similarity,
    )


def sampler_of(request: clustering_pb2.SelectRequest) -> tuple[str, type[Sampler], Any]:
    """(reference, class, Params instance) of the request's sampler, resolved through the registry; InvalidInput
    naming the field (`sampler`, `sampler_params.<key>`) when it cannot be used."""
    if not request.sampler:
        raise InvalidInput("sampler: required (a registered sampler name or package.module:attr)")
    try:
        cls = SAMPLERS.load(request.sampler, "sampler")
        params = params_from_struct(cls.Params, request.sampler_params, "sampler_params")
    except ConfigError as err:  # PluginError: not importable, not a Sampler, unknown name, bad parameter
        raise InvalidInput(str(err)) from None
    return request.sampler, cls, params


def _require_run_id(run_id: str) -> None:
    if not run_id:
        raise InvalidInput("run_id is required")


def cluster_reply(request: clustering_pb2.ClusterRequest) -> clustering_pb2.ClusterReply:
    """One Cluster call without the transport: the servicer and the aggregator's in-process peer both run this, so
    both transports give the same clusters for the same request. Raises InvalidInput naming the bad field."""
    labels = _cluster_labels(request)
    nmi = clustering.nmi(request.true_groups, labels) if request.true_groups else math.nan
    return clustering_pb2.ClusterReply(
        labels=labels.tolist(),
        sizes=clustering.cluster_sizes(labels).tolist(),
        equal_cluster_weights=clustering.equal_cluster_weights(labels).tolist(),
        nmi=nmi,
    )


def _cluster_labels(request: clustering_pb2.ClusterRequest) -> NDArray[np.int64]:
    methods = (clustering_pb2.CLUSTER_METHOD_SPECTRAL, clustering_pb2.CLUSTER_METHOD_HIERARCHICAL)
    if request.method not in methods:
        raise InvalidInput(
            f"method must be CLUSTER_METHOD_SPECTRAL or CLUSTER_METHOD_HIERARCHICAL, got {request.method}"
        )
    ids = np.asarray(request.client_ids, dtype=np.int64)
    n = ids.size
    if n == 0:
        raise InvalidInput("client_ids is empty")
    if np.unique(ids).size != n:
        raise InvalidInput("client_ids must be unique")
    if request.true_groups and len(request.true_groups) != n:
        raise InvalidInput(f"true_groups has {len(request.true_groups)} entries for {n} client_ids")
    has_rows, has_sim = request.HasField("rows"), request.HasField("similarity")
    if has_rows == has_sim:
        raise InvalidInput("give exactly one of rows [n, D] or similarity [n, n]")
    rows = similarity = None
    if has_rows:
        rows = decode_float_tensor(request.rows, "rows", ndim=2)
        if rows.shape[0] != n:
            raise InvalidInput(f"rows has {rows.shape[0]} rows for {n} client_ids")
    else:
        similarity = decode_float_tensor(request.similarity, "similarity", ndim=2)
        if similarity.shape != (n, n):
            raise InvalidInput(f"similarity must be [{n}, {n}] for {n} client_ids, got {list(similarity.shape)}")
    if not 1 <= request.num_clusters <= n:
        raise InvalidInput(f"num_clusters must be in [1, {n}] (number of clients), got {request.num_clusters}")

    if request.method == clustering_pb2.CLUSTER_METHOD_SPECTRAL:
        if request.linkage:
            raise InvalidInput("linkage applies to HIERARCHICAL clustering only; leave it empty for SPECTRAL")
        if similarity is None:
            similarity = clustering.similarity_from_rows(rows)
        return clustering.spectral_clusters(similarity, request.num_clusters, request.seed)
    linkage = request.linkage or "ward"
    if similarity is None:
        return clustering.hierarchical_clusters(rows, request.num_clusters, linkage)
    # Ward needs distances: the ones implied by the inner products, so similarity and rows agree (S = A Aᵀ).
    distance = clustering.distance_from_similarity(similarity)
    return clustering.hierarchical_clusters(distance, request.num_clusters, linkage, precomputed=True)


_SCOPE = telemetry.RunScope("clustering")  # run-scoped series of one run per process


def _method_label(enum: Any, value: int, prefix: str) -> str:
    """A bounded label from a proto enum value: its name without the prefix, lower case."""
    try:
        return enum.Name(value).removeprefix(prefix).lower()
    except ValueError:
        return "unknown"


class ClusteringServicer(clustering_pb2_grpc.ClusteringServicer):
    def __init__(self, store: StateStore | None = None, client_limit: int = telemetry.DEFAULT_CLIENT_LIMIT) -> None:
        self.store = store if store is not None else StateStore()
        self.client_limit = client_limit  # cluster indices exported as labels stay below this

    def ReportSignatures(
        self, request: clustering_pb2.ReportSignaturesRequest, context: grpc.ServicerContext
    ) -> clustering_pb2.ReportSignaturesReply:
        try:
            _require_run_id(request.run_id)
            signatures = [signature_from_proto(s) for s in request.signatures]
            stored = self.store.run(request.run_id).put(signatures)
        except InvalidInput as err:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"ReportSignatures(run {request.run_id!r}): {err}")
        telemetry.SIGNATURES.inc(len(signatures))
        log.debug("run %s: stored %d of %d signatures", request.run_id, stored, len(signatures))
        return clustering_pb2.ReportSignaturesReply(stored=stored, instance_id=self.store.instance_id)

    def Select(
        self, request: clustering_pb2.SelectRequest, context: grpc.ServicerContext
    ) -> clustering_pb2.SelectReply:
        try:
            _require_run_id(request.run_id)
            ref, cls, params = sampler_of(request)
            selection = selection_input_from_proto(request, params)
            sampler = cls()
            out = samplers.run_sampler(sampler, selection, self.store.run(request.run_id))
        except InvalidInput as err:  # the request, or a sampler finding it unusable for its method
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"Select(run {request.run_id!r}): {err}")
        # The reference as sent: a registered name, or the module:attr of a sampler this process could load.
        telemetry.SELECTIONS.labels(ref).inc()
        telemetry.SELECTION_DURATION.labels(ref).observe(out.seconds)
        log.debug(
            "run %s round %d: %s selected %d of %d in %.2f ms",
            request.run_id,
            request.round,
            ref,
            len(out.selected),
            len(request.candidates),
            out.seconds * 1e3,
        )
        return clustering_pb2.SelectReply(
            selected=out.selected,
            cluster_of_selected=out.cluster_of_selected,
            selection_seconds=out.seconds,
            needs_losses=out.needs_losses,
            instance_id=self.store.instance_id,
        )

    def Cluster(
        self, request: clustering_pb2.ClusterRequest, context: grpc.ServicerContext
    ) -> clustering_pb2.ClusterReply:
        started = time.perf_counter()
        try:
            reply = cluster_reply(request)
        except InvalidInput as err:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"Cluster(run {request.run_id!r}): {err}")
        self._export_clusters(request, list(reply.sizes), reply.nmi, time.perf_counter() - started)
        return reply

    def _export_clusters(
        self, request: clustering_pb2.ClusterRequest, sizes: list[int], nmi: float, seconds: float
    ) -> None:
        method = _method_label(clustering_pb2.ClusterMethod, request.method, "CLUSTER_METHOD_")
        telemetry.CLUSTERING_DURATION.labels(method).observe(seconds)
        if not request.run_id:  # clustering is stateless and may be anonymous; run-scoped gauges need a run
            return
        run = request.run_id
        _SCOPE.enter(run)
        telemetry.CLUSTERS.labels(run).set(len(sizes))
        # The scope holds one run, so clearing drops only this run's previous clustering.
        telemetry.CLUSTER_SIZE.clear()
        for index, size in enumerate(sizes[: self.client_limit]):
            telemetry.CLUSTER_SIZE.labels(run, str(index)).set(size)
        telemetry.CLUSTERING_NMI.clear()
        if not math.isnan(nmi):
            telemetry.CLUSTERING_NMI.labels(run).set(nmi)

    def ForgetRun(
        self, request: clustering_pb2.ForgetRunRequest, context: grpc.ServicerContext
    ) -> clustering_pb2.ForgetRunReply:
        if not request.run_id:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, "ForgetRun: run_id is required")
        if self.store.forget(request.run_id):
            log.info("run %s: state forgotten", request.run_id)
        return clustering_pb2.ForgetRunReply()
