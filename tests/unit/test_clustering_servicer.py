"""ClusteringServicer called directly with a fake context: replies, and validation mapped onto status codes."""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest
from google.protobuf.struct_pb2 import Struct

from clustering_service.samplers import RandomSampler, SelectionInput
from clustering_service.servicer import ClusteringServicer
from clustering_service.state import RunState
from fairfl.codec import tensor_to_proto
from fairfl.v1 import clustering_pb2 as pb
from fairfl.v1 import tensor_pb2


class Aborted(Exception):
    pass


class FakeContext:
    """Records the status an RPC aborts with; like grpc's context, abort raises."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.trailing = metadata  # the refusal's reason, as a real context sends it

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise Aborted(details)


def _call(method, request) -> object:  # type: ignore[no-untyped-def]
    return method(request, FakeContext())


def _abort_of(method, request) -> tuple[grpc.StatusCode, str]:  # type: ignore[no-untyped-def]
    ctx = FakeContext()
    with pytest.raises(Aborted):
        method(request, ctx)
    assert ctx.code is not None
    return ctx.code, ctx.details


@pytest.fixture
def servicer() -> ClusteringServicer:
    return ClusteringServicer()


def _signature(client_id: int, bias: np.ndarray, round_: int = 0) -> pb.ClientSignature:
    return pb.ClientSignature(
        client_id=client_id, round=round_, num_samples=100, bias_update=tensor_to_proto("bias_update", bias), loss=0.5
    )


# --- ReportSignatures ----------------------------------------------------------------------------------------------


def test_report_signatures_stores_latest(servicer: ClusteringServicer) -> None:
    request = pb.ReportSignaturesRequest(
        run_id="r",
        signatures=[_signature(i, np.full(10, i, dtype=np.float32)) for i in range(3)]
        + [pb.ClientSignature(client_id=9, activation=tensor_to_proto("activation", np.ones(6)))],
    )
    assert _call(servicer.ReportSignatures, request).stored == 4
    state = servicer.store.get("r")
    assert state is not None and state.get(2).bias_update.tolist() == [2.0] * 10
    assert state.get(9).bias_update is None and state.get(9).activation.size == 6


def _bad_tensor(data: bytes, dtype: int, shape: list[int]) -> tensor_pb2.Tensor:
    return tensor_pb2.Tensor(spec=tensor_pb2.TensorSpec(name="bias_update", dtype=dtype, shape=shape), data=data)


@pytest.mark.parametrize(
    ("tensor", "match"),
    [
        (tensor_to_proto("b", np.arange(4, dtype=np.int32)), "DTYPE_FLOAT32 or DTYPE_FLOAT64"),
        (tensor_to_proto("b", np.ones((2, 2), dtype=np.float32)), "1-D"),
        (tensor_to_proto("b", np.array([1.0, np.inf])), "NaN or inf"),
        (_bad_tensor(b"\x00" * 7, tensor_pb2.DTYPE_FLOAT32, [2]), "bytes"),
        (_bad_tensor(b"", tensor_pb2.DTYPE_FLOAT32, [0]), "empty"),
    ],
)
def test_report_signatures_rejects_bad_tensors(
    servicer: ClusteringServicer, tensor: tensor_pb2.Tensor, match: str
) -> None:
    request = pb.ReportSignaturesRequest(run_id="r", signatures=[pb.ClientSignature(client_id=5, bias_update=tensor)])
    code, details = _abort_of(servicer.ReportSignatures, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "client 5" in details and match in details


def test_report_signatures_rejects_length_change_within_a_run(servicer: ClusteringServicer) -> None:
    _call(servicer.ReportSignatures, pb.ReportSignaturesRequest(run_id="r", signatures=[_signature(1, np.ones(10))]))
    request = pb.ReportSignaturesRequest(run_id="r", signatures=[_signature(2, np.ones(12))])
    code, details = _abort_of(servicer.ReportSignatures, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "client 2" in details and "length 12" in details
    code, _ = _abort_of(servicer.ReportSignatures, pb.ReportSignaturesRequest(signatures=[_signature(1, np.ones(3))]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT  # run_id missing


# --- Select ----------------------------------------------------------------------------------------------------------


def _select(**kw: object) -> pb.SelectRequest:
    fields: dict[str, object] = {
        "run_id": "r",
        "round": 4,
        "num_to_select": 3,
        "candidates": [8, 2, 6, 4, 0],
        "sampler": "random",
        "seed": 17,
    }
    fields.update(kw)
    return pb.SelectRequest(**fields)  # type: ignore[arg-type]


def test_select_random_matches_in_process_sampler(servicer: ClusteringServicer) -> None:
    reply = _call(servicer.Select, _select())
    oracle = RandomSampler().select(SelectionInput("r", 4, 3, np.asarray([8, 2, 6, 4, 0]), seed=17), RunState("r"))
    assert tuple(reply.selected) == oracle.selected
    assert list(reply.selected) == sorted(reply.selected) and len(reply.selected) == 3
    assert reply.selection_seconds >= 0.0 and len(reply.cluster_of_selected) == 0


def test_select_full(servicer: ClusteringServicer) -> None:
    reply = _call(servicer.Select, _select(sampler="full"))
    assert list(reply.selected) == [0, 2, 4, 6, 8]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"num_to_select": 0}, "num_to_select"),
        ({"num_to_select": 6}, "num_to_select"),
        ({"candidates": [1, 2, 2]}, "unique"),
        ({"sampler": ""}, "sampler: required"),
        ({"run_id": ""}, "run_id"),
        ({"candidate_losses": [0.1, 0.2]}, "candidate_losses"),
        ({"similarity": tensor_to_proto("s", np.eye(3))}, "similarity"),
    ],
)
def test_select_invalid_argument(servicer: ClusteringServicer, overrides: dict[str, object], match: str) -> None:
    code, details = _abort_of(servicer.Select, _select(**overrides))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and match in details


@pytest.mark.parametrize(
    ("sampler", "params", "match"),
    [
        ("hics", {}, "total_rounds is required"),
        ("hics", {"total_rounds": 10, "temperature": 0.0}, "sampler_params.temperature: must be > 0"),
        ("hics", {"total_rounds": 10, "candidates": 3}, "sampler_params: unknown parameter 'candidates'"),
        ("hics", {"total_rounds": 2.5}, "sampler_params.total_rounds: expected an integer"),
        ("power_of_choice", {"candidates": 2}, "must be >= num_to_select"),
        ("power_of_choice", {"gamma0": 1.0}, "valid parameters: candidates"),
        ("clustered_sampling", {}, "clustered_sampling needs similarity"),
        ("divfl", {"warmup_rounds": 0}, "divfl needs similarity"),
        ("random", {"lambda_entropy": 1.0}, "valid parameters: none"),
        ("no_such_sampler", {}, "sampler: unknown sampler 'no_such_sampler'"),
        ("no.such.module:Sampler", {}, "sampler: cannot import module 'no.such.module'"),
        ("fairfl.config:ExperimentConfig", {}, "sampler: 'fairfl.config:ExperimentConfig' is not a sampler"),
    ],
)
def test_select_bad_sampler_or_params_are_invalid_argument(
    servicer: ClusteringServicer, sampler: str, params: dict[str, object], match: str
) -> None:
    struct = Struct()
    struct.update(params)
    code, details = _abort_of(servicer.Select, _select(sampler=sampler, sampler_params=struct))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and match in details, details


def test_a_request_without_a_sampler_is_refused_naming_the_field(servicer: ClusteringServicer) -> None:
    code, details = _abort_of(servicer.Select, _select(sampler=""))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "sampler: required" in details, details


def _struct(**values: object) -> Struct:
    out = Struct()
    out.update(values)
    return out


# --- Cluster ---------------------------------------------------------------------------------------------------------

GROUPS = np.array([0, 1, 0, 2, 1, 2, 0, 1])


def _rows() -> np.ndarray:
    rng = np.random.default_rng(3)
    centres = -rng.uniform(0.5, 3.0, size=(3, 20))
    return (centres[GROUPS] + 0.01 * rng.standard_normal((GROUPS.size, 20))).astype(np.float32)


def _cluster(**kw: object) -> pb.ClusterRequest:
    fields: dict[str, object] = {
        "run_id": "r",
        "method": pb.CLUSTER_METHOD_SPECTRAL,
        "num_clusters": 3,
        "client_ids": list(range(10, 18)),
        "rows": tensor_to_proto("rows", _rows()),
        "seed": 1,
        "true_groups": GROUPS.tolist(),
    }
    fields.update(kw)
    return pb.ClusterRequest(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("method", [pb.CLUSTER_METHOD_SPECTRAL, pb.CLUSTER_METHOD_HIERARCHICAL])
@pytest.mark.parametrize("as_similarity", [False, True])
def test_cluster_recovers_groups(servicer: ClusteringServicer, method: int, as_similarity: bool) -> None:
    rows = _rows().astype(np.float64)
    kw: dict[str, object] = {"method": method}
    if as_similarity:
        kw.update(rows=None, similarity=tensor_to_proto("similarity", rows @ rows.T))
    reply = _call(servicer.Cluster, _cluster(**kw))
    assert list(reply.labels) == [0, 1, 0, 2, 1, 2, 0, 1]
    assert list(reply.sizes) == [3, 3, 2]
    assert reply.nmi == pytest.approx(1.0)
    assert list(reply.equal_cluster_weights) == pytest.approx([1 / 9, 1 / 9, 1 / 9, 1 / 6, 1 / 9, 1 / 6, 1 / 9, 1 / 9])


def test_cluster_nmi_is_nan_without_true_groups(servicer: ClusteringServicer) -> None:
    reply = _call(servicer.Cluster, _cluster(true_groups=[], method=pb.CLUSTER_METHOD_HIERARCHICAL, linkage="average"))
    assert math.isnan(reply.nmi) and sum(reply.equal_cluster_weights) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"method": pb.CLUSTER_METHOD_UNSPECIFIED}, "method"),
        ({"num_clusters": 0}, "num_clusters"),
        ({"num_clusters": 9}, "num_clusters"),
        ({"client_ids": list(range(7)), "true_groups": []}, "rows has 8 rows for 7"),
        ({"client_ids": [1] * 8}, "unique"),
        ({"client_ids": []}, "empty"),
        ({"rows": None}, "exactly one"),
        ({"similarity": tensor_to_proto("s", np.eye(8))}, "exactly one"),
        ({"rows": None, "similarity": tensor_to_proto("s", np.eye(7))}, "[8, 8]"),
        ({"rows": None, "similarity": tensor_to_proto("s", np.triu(np.ones((8, 8))))}, "symmetric"),
        ({"rows": tensor_to_proto("rows", np.ones(8))}, "2-D"),
        ({"true_groups": [0, 1]}, "true_groups"),
        ({"linkage": "ward"}, "linkage"),  # SPECTRAL takes no linkage
        ({"method": pb.CLUSTER_METHOD_HIERARCHICAL, "linkage": "median-ish"}, "linkage"),
    ],
)
def test_cluster_invalid_argument(servicer: ClusteringServicer, overrides: dict[str, object], match: str) -> None:
    code, details = _abort_of(servicer.Cluster, _cluster(**overrides))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and match in details


# --- ForgetRun -------------------------------------------------------------------------------------------------------


def test_forget_run(servicer: ClusteringServicer) -> None:
    _call(servicer.ReportSignatures, pb.ReportSignaturesRequest(run_id="r", signatures=[_signature(1, np.ones(3))]))
    _call(servicer.ForgetRun, pb.ForgetRunRequest(run_id="r"))
    assert servicer.store.get("r") is None
    _call(servicer.ForgetRun, pb.ForgetRunRequest(run_id="r"))  # idempotent
    code, _ = _abort_of(servicer.ForgetRun, pb.ForgetRunRequest())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
