"""fairfl.telemetry and the services' metric updates, in-process: conventions, the gRPC interceptor, fairness and
privacy series, run scoping and client limits."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from aggregator_service.monitoring import RunMonitor
from fairfl import codec, telemetry
from fairfl.announce import announcement, parse_announcement
from fairfl.config import experiment_from_dict
from fairfl.metrics.fairness import client_disagreement, fairness_report, psi, weight_entropy
from fairfl.rpc_channel import open_channel
from fairfl.rpc_metrics import GrpcMetricsInterceptor
from fairfl.rpc_server import start_server
from fairfl.telemetry import CATALOG, REGISTRY
from fairfl.v1 import clustering_pb2, clustering_pb2_grpc, control_pb2, privacy_pb2_grpc
from fairfl.v1 import privacy_pb2 as pb

REPO = Path(__file__).resolve().parents[2]
# Label names and why each is bounded (see docs/observability.md).
BOUNDED_LABELS = {
    "run_id",  # one run per process at a time (RunScope)
    "client_id",  # below runtime.metrics_client_limit
    "principal",  # below the privacy service's client limit
    "cluster",  # below the clustering service's client limit
    "service",  # registered gRPC services
    "method",  # their methods, or a proto enum (selection / clustering method)
    "code",  # gRPC status codes
    "phase",  # round phases
    "reason",  # rejection reasons: status codes and 'duplicate'
    "tail",  # worst | best
    "fraction",  # 0.05 | 0.1
    "name",  # strategy diagnostics, fixed in code
    "strategy",  # configured strategy names
    "dataset",  # configured dataset names
    "component",  # aggregator | clustering | privacy | agent
    "version",
    "outcome",  # submitted | refused | failed
    "cache",  # hit | miss
}
UNITS = ("_seconds", "_bytes", "_ratio", "_timestamp_seconds")


def sample(metric: str, /, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(metric, labels)


@pytest.fixture(autouse=True, scope="module")
def _enabled() -> None:
    for component in telemetry.COMPONENTS:
        telemetry.enable(component)


def test_catalog_follows_prometheus_naming_conventions() -> None:
    assert len(CATALOG) > 50
    for name, spec in CATALOG.items():
        assert re.fullmatch(r"fairfl_[a-z0-9_]+", name), name
        assert (spec.kind == "counter") == name.endswith("_total"), f"{name}: _total is for counters only"
        if spec.kind == "histogram":
            assert name.endswith(UNITS), f"{name}: a histogram needs a base-unit suffix"
        assert not re.search(r"_(ms|milliseconds|percent|kb|mb|minutes|count|sum|bucket)(_|$)", name), name
        assert set(spec.labels) <= BOUNDED_LABELS, f"{name}: unbounded label {set(spec.labels) - BOUNDED_LABELS}"
        assert spec.help and spec.components, name
    assert {c for s in CATALOG.values() for c in s.components} == set(telemetry.COMPONENTS)


def test_docs_describe_every_metric() -> None:
    docs = (REPO / "docs" / "observability.md").read_text()
    missing = [name for name in CATALOG if f"`{name}`" not in docs]
    assert not missing, f"docs/observability.md does not describe {missing}"


@pytest.mark.parametrize(
    ("line", "ports"),
    [
        ("LISTENING 50051\n", (50051, None)),
        ("LISTENING 50051 METRICS 9464\n", (50051, 9464)),
        ("METRICS 9464", (None, 9464)),
        ("", None),
        ("starting up", None),
        ("LISTENING x", None),
    ],
)
def test_announcement_lines_parse_back_compatibly(line: str, ports: tuple[int | None, int | None] | None) -> None:
    assert parse_announcement(line) == ports
    if ports is not None and ports[0] is not None:
        assert int(line.split()[1]) == ports[0]  # readers of the old one-port line still work


def test_announcement_formats() -> None:
    endpoint = telemetry.MetricsEndpoint(9464, None)
    assert announcement(50051, endpoint) == "LISTENING 50051 METRICS 9464"
    assert announcement(50051, None) == "LISTENING 50051"
    assert announcement(None, endpoint) == "METRICS 9464"


# --- gRPC interceptor -------------------------------------------------------------------------------------------------

Req = health_pb2.HealthCheckRequest
Rep = health_pb2.HealthCheckResponse


def _echo_service(server: grpc.Server) -> list[str]:
    def unary(request: Req, context: grpc.ServicerContext) -> Rep:
        if request.service == "missing":
            context.abort(grpc.StatusCode.NOT_FOUND, "no such thing")
        if request.service == "boom":
            raise RuntimeError("bug")
        return Rep(status=Rep.SERVING)

    def server_stream(request: Req, context: grpc.ServicerContext) -> Iterator[Rep]:
        for _ in range(3):
            yield Rep(status=Rep.SERVING)
        if request.service == "missing":
            context.abort(grpc.StatusCode.NOT_FOUND, "ran out")

    def client_stream(requests: Iterator[Req], context: grpc.ServicerContext) -> Rep:
        return Rep(status=Rep.SERVING if sum(1 for _ in requests) == 4 else Rep.NOT_SERVING)

    def bidi(requests: Iterator[Req], context: grpc.ServicerContext) -> Iterator[Rep]:
        for _ in requests:
            yield Rep(status=Rep.SERVING)

    codec = {"request_deserializer": Req.FromString, "response_serializer": Rep.SerializeToString}
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(unary, **codec),
        "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream, **codec),
        "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream, **codec),
        "Bidi": grpc.stream_stream_rpc_method_handler(bidi, **codec),
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Echo", handlers)])
    return ["test.Echo"]


def test_interceptor_counts_every_call_kind_with_its_status_and_bytes() -> None:
    running = start_server("127.0.0.1:0", _echo_service, max_workers=4)
    before = {
        key: sample("fairfl_grpc_server_handled_total", service="test.Echo", method=m, code=c) or 0.0
        for key, (m, c) in {
            "ok": ("Unary", "OK"),
            "nf": ("Unary", "NOT_FOUND"),
            "unk": ("Unary", "UNKNOWN"),
            "ss": ("ServerStream", "OK"),
            "ss_nf": ("ServerStream", "NOT_FOUND"),
            "cs": ("ClientStream", "OK"),
            "bidi": ("Bidi", "OK"),
        }.items()
    }
    try:
        with open_channel(f"127.0.0.1:{running.port}") as channel:

            def call(kind: str, method: str) -> grpc.UnaryUnaryMultiCallable:
                return getattr(channel, kind)(
                    f"/test.Echo/{method}",
                    request_serializer=Req.SerializeToString,
                    response_deserializer=Rep.FromString,
                )

            assert call("unary_unary", "Unary")(Req(service="x"), timeout=5).status == Rep.SERVING
            for service, code in (("missing", grpc.StatusCode.NOT_FOUND), ("boom", grpc.StatusCode.UNKNOWN)):
                with pytest.raises(grpc.RpcError) as err:
                    call("unary_unary", "Unary")(Req(service=service), timeout=5)
                assert err.value.code() == code
            assert len(list(call("unary_stream", "ServerStream")(Req(), timeout=5))) == 3
            with pytest.raises(grpc.RpcError):
                list(call("unary_stream", "ServerStream")(Req(service="missing"), timeout=5))
            four = iter([Req(service="abc")] * 4)
            assert call("stream_unary", "ClientStream")(four, timeout=5).status == Rep.SERVING
            assert len(list(call("stream_stream", "Bidi")(iter([Req()] * 2), timeout=5))) == 2
    finally:
        running.stop(0)

    def delta(key: str, method: str, code: str) -> float:
        now = sample("fairfl_grpc_server_handled_total", service="test.Echo", method=method, code=code) or 0.0
        return now - before[key]

    assert delta("ok", "Unary", "OK") == 1
    assert delta("nf", "Unary", "NOT_FOUND") == 1
    assert delta("unk", "Unary", "UNKNOWN") == 1
    assert delta("ss", "ServerStream", "OK") == 1
    assert delta("ss_nf", "ServerStream", "NOT_FOUND") == 1
    assert delta("cs", "ClientStream", "OK") == 1
    assert delta("bidi", "Bidi", "OK") == 1
    # Four 5-byte requests (field tag, length, "abc") arrived on ClientStream; Bidi answered two 2-byte replies.
    assert sample("fairfl_grpc_server_received_bytes_total", service="test.Echo", method="ClientStream") == 20
    assert sample("fairfl_grpc_server_sent_bytes_total", service="test.Echo", method="Bidi") == 4
    assert sample("fairfl_grpc_server_handling_seconds_count", service="test.Echo", method="Unary") >= 3


def test_interceptor_builds_each_methods_wrapper_once_and_keeps_its_thread_pool() -> None:
    """The wrapped handler is reused while the inner one stays the same (no per-call wrapping), and a behavior that
    asked grpcio for a thread pool of its own (the access guard's health checks) keeps it through the wrapper."""
    from concurrent import futures

    pool = futures.ThreadPoolExecutor(1)

    def check(request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext) -> None:
        return None

    check.__dict__["experimental_thread_pool"] = pool
    inner = grpc.unary_unary_rpc_method_handler(check)
    interceptor = GrpcMetricsInterceptor()

    class Details(grpc.HandlerCallDetails):
        method = "/grpc.health.v1.Health/Check"
        invocation_metadata = ()

    first = interceptor.intercept_service(lambda _: inner, Details())
    assert first is not None and interceptor.intercept_service(lambda _: inner, Details()) is first
    assert first.unary_unary.experimental_thread_pool is pool
    other = grpc.unary_unary_rpc_method_handler(check)
    assert interceptor.intercept_service(lambda _: other, Details()) is not first, "a new inner handler is wrapped anew"
    assert interceptor.intercept_service(lambda _: None, Details()) is None
    pool.shutdown()


# --- aggregator: fairness and system metrics from RunEvents -----------------------------------------------------------


def _round_event(round_number: int, accuracies: list[float], losses: list[float]) -> control_pb2.RunEvent:
    samples = [10 + i for i in range(len(accuracies))]
    report = fairness_report(accuracies, losses=losses, num_samples=samples, missing_clients=1)
    event = control_pb2.RoundEvent(
        round=round_number,
        selected=[0, 1],
        duration_seconds=0.25,
        mean_train_loss=0.7,
        aggregation_weights=[0.25, 0.75],
        evaluated=True,
        epsilon_spent=0.5 * round_number,
        fairness=control_pb2.FairnessReport(**report.to_dict()),
        clients=[
            control_pb2.ClientEvaluation(client_id=i, accuracy=a, loss=loss, num_samples=n)
            for i, (a, loss, n) in enumerate(zip(accuracies, losses, samples, strict=True))
        ],
    )
    event.strategy_metrics.add(name="tau_eff", value=0.1)
    return control_pb2.RunEvent(run_id="", round=event)


def test_run_monitor_exports_a_rounds_fairness_in_base_units() -> None:
    config = experiment_from_dict({"rounds": 5, "runtime": {"metrics_client_limit": 3}})
    monitor = RunMonitor("unit-run", config)
    accuracies, losses = [50.0, 62.5, 80.0, 91.0, 33.0], [1.2, 0.9, 0.5, 0.3, 1.6]
    rounds_before = sample("fairfl_rounds_completed_total") or 0.0
    monitor(control_pb2.RunEvent(run_id="unit-run", status=control_pb2.RunStatus(state=control_pb2.RUN_STATE_RUNNING)))
    monitor(_round_event(2, accuracies, losses))
    report = fairness_report(accuracies, losses=losses)
    run = {"run_id": "unit-run"}
    assert sample("fairfl_rounds_completed_total") == rounds_before + 1
    assert sample("fairfl_run_active", **run) == 1
    assert sample("fairfl_run_round", **run) == 2
    assert sample("fairfl_run_rounds", **run) == 5
    assert sample("fairfl_run_epsilon_spent", **run) == 1.0
    assert sample("fairfl_fairness_evaluation_round", **run) == 2
    assert sample("fairfl_fairness_accuracy_mean_ratio", **run) == pytest.approx(report.mean / 100, abs=1e-15)
    assert sample("fairfl_fairness_accuracy_variance", **run) * 1e4 == pytest.approx(report.variance, abs=1e-9)
    tail = sample("fairfl_fairness_accuracy_tail_ratio", tail="worst", fraction="0.05", **run)
    assert tail * 100 == pytest.approx(report.worst_5, abs=1e-9)
    assert sample("fairfl_fairness_accuracy_tail_ratio", tail="best", fraction="0.1", **run) == 0.91
    assert sample("fairfl_fairness_jain_index", **run) == pytest.approx(report.jain_index)
    assert sample("fairfl_fairness_missing_clients", **run) == 1
    assert sample("fairfl_fairness_psi", **run) == pytest.approx(psi(losses, [10, 11, 12, 13, 14]))
    assert sample("fairfl_fairness_client_disagreement", **run) == pytest.approx(client_disagreement(losses))
    assert sample("fairfl_fairness_aggregation_weight_entropy", **run) == pytest.approx(weight_entropy([1, 3]))
    assert sample("fairfl_strategy_metric", name="tau_eff", **run) == 0.1
    assert sample("fairfl_evaluation_client_accuracy_ratio_count", **run) == 5
    assert sample("fairfl_evaluation_client_accuracy_ratio_bucket", le="0.5", **run) == 2  # 33% and 50%
    # Per-client series only below the limit (3).
    assert sample("fairfl_client_accuracy_ratio", client_id="2", **run) == 0.8
    assert sample("fairfl_client_loss", client_id="0", **run) == 1.2
    assert sample("fairfl_client_accuracy_ratio", client_id="3", **run) is None

    monitor(
        control_pb2.RunEvent(run_id="unit-run", status=control_pb2.RunStatus(state=control_pb2.RUN_STATE_COMPLETED))
    )
    assert sample("fairfl_run_active", **run) == 0
    # A new run takes over: the old run's series go, so run_id stays bounded.
    RunMonitor("unit-run-2", config)
    assert sample("fairfl_fairness_accuracy_mean_ratio", **run) is None
    assert sample("fairfl_client_accuracy_ratio", client_id="2", **run) is None
    assert sample("fairfl_run_active", run_id="unit-run-2") == 1
    # Events of a superseded run no longer touch the series.
    monitor(_round_event(3, accuracies, losses))
    assert sample("fairfl_run_round", **run) is None


def test_undefined_fairness_inputs_are_skipped_not_raised() -> None:
    config = experiment_from_dict({"rounds": 2})
    monitor = RunMonitor("unit-degenerate", config)
    event = _round_event(1, [40.0], [0.5])
    del event.round.aggregation_weights[:]
    event.round.aggregation_weights.extend([0.0, 0.0])  # no positive sum: entropy undefined
    monitor(event)
    run = {"run_id": "unit-degenerate"}
    assert sample("fairfl_fairness_aggregation_weight_entropy", **run) is None
    assert sample("fairfl_fairness_client_disagreement", **run) == 0.0
    assert sample("fairfl_fairness_accuracy_mean_ratio", **run) == 0.4


# --- privacy service --------------------------------------------------------------------------------------------------


def _event(principal: str, count: int = 1) -> pb.PrivacyEvent:
    return pb.PrivacyEvent(
        principal=principal, mechanism=pb.MECHANISM_GRADIENT, sample_rate=0.01, noise_multiplier=1.1, count=count
    )


def test_privacy_service_exports_spend_per_run_and_principal() -> None:
    from privacy_service.server import serve

    running = serve("127.0.0.1:0", ":memory:", client_limit=2)
    try:
        with open_channel(f"127.0.0.1:{running.port}") as channel:
            stub = privacy_pb2_grpc.PrivacyStub(channel)
            stub.RegisterBudget(
                pb.RegisterBudgetRequest(
                    run_id="dp-unit",
                    epsilon=4.0,
                    delta=1e-5,
                    accountant=pb.ACCOUNTANT_RDP,
                    principal_kind=pb.PRINCIPAL_KIND_CLIENT,
                ),
                timeout=10,
            )
            refused_before = sample("fairfl_privacy_rounds_refused_total")
            for round_number in (1, 2):
                stub.AuthorizeRound(
                    pb.AuthorizeRoundRequest(
                        run_id="dp-unit",
                        round=round_number,
                        events=[_event("0", 100), _event("1", 50 * round_number), _event("7", 10)],
                    ),
                    timeout=10,
                )
            with pytest.raises(grpc.RpcError) as err:
                stub.AuthorizeRound(
                    pb.AuthorizeRoundRequest(run_id="dp-unit", round=3, events=[_event("0", 10**6)]), timeout=10
                )
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            spend = stub.GetSpend(pb.GetSpendRequest(run_id="dp-unit"), timeout=10)
        text = telemetry.exposition().decode()  # a scrape refreshes the per-principal series
    finally:
        running.stop(0)
    per_principal = {s.principal: s.epsilon for s in spend.spends}
    run = {"run_id": "dp-unit"}
    assert sample("fairfl_privacy_rounds_refused_total") == refused_before + 1
    assert sample("fairfl_privacy_epsilon_spent", **run) == spend.max_epsilon > 0
    assert sample("fairfl_privacy_epsilon_budget", **run) == 4.0
    assert sample("fairfl_privacy_budget_used_ratio", **run) == pytest.approx(spend.max_epsilon / 4.0)
    assert sample("fairfl_privacy_principal_epsilon_spent", principal="0", **run) == per_principal["0"]
    assert sample("fairfl_privacy_principal_epsilon_spent", principal="1", **run) == per_principal["1"]
    assert sample("fairfl_privacy_principal_epsilon_spent", principal="7", **run) is None  # above the limit
    assert 'fairfl_privacy_epsilon_spent{run_id="dp-unit"}' in text
    assert math.isclose(max(per_principal.values()), spend.max_epsilon)


def test_clustering_service_exports_clusters_nmi_and_selection_time() -> None:
    from clustering_service.server import serve

    rows = np.array([[0.0, 0.0], [0.1, 0.0], [0.0, 0.1], [5.0, 5.0], [5.1, 5.0], [9.0, 0.0]], dtype=np.float32)
    running = serve("127.0.0.1:0", client_limit=2)
    selections_before = sample("fairfl_clustering_selections_total", method="random") or 0.0
    try:
        with open_channel(f"127.0.0.1:{running.port}") as channel:
            stub = clustering_pb2_grpc.ClusteringStub(channel)
            request = clustering_pb2.ClusterRequest(
                run_id="clu-unit",
                method=clustering_pb2.CLUSTER_METHOD_HIERARCHICAL,
                num_clusters=3,
                client_ids=list(range(6)),
                rows=codec.tensor_to_proto("rows", rows),
                true_groups=[0, 0, 0, 1, 1, 2],
            )
            reply = stub.Cluster(request, timeout=10)
            stub.Select(
                clustering_pb2.SelectRequest(
                    run_id="clu-unit",
                    round=1,
                    num_to_select=2,
                    candidates=[1, 2, 3],
                    sampler="random",
                    seed=0,
                ),
                timeout=10,
            )
            del request.true_groups[:]  # unknown groups: no NMI, rather than the previous clustering's
            stub.Cluster(request, timeout=10)
    finally:
        running.stop(0)
    run = {"run_id": "clu-unit"}
    assert sorted(reply.sizes) == [1, 2, 3] and reply.nmi == pytest.approx(1.0)
    assert sample("fairfl_clustering_clusters", **run) == 3
    sizes = {c: sample("fairfl_clustering_cluster_clients", cluster=c, **run) for c in ("0", "1", "2")}
    assert sizes == {"0": reply.sizes[0], "1": reply.sizes[1], "2": None}  # cluster indices below the limit (2)
    assert sample("fairfl_clustering_nmi", **run) is None
    assert sample("fairfl_clustering_duration_seconds_count", method="hierarchical") >= 2
    assert sample("fairfl_clustering_selections_total", method="random") == selections_before + 1
    assert sample("fairfl_clustering_selection_duration_seconds_count", method="random") >= 1


def test_run_scope_keeps_one_run() -> None:
    scope = telemetry.RunScope("clustering")
    assert scope.enter("a")
    telemetry.CLUSTERS.labels("a").set(3)
    assert not scope.enter("a")
    assert sample("fairfl_clustering_clusters", run_id="a") == 3
    assert scope.enter("b")
    assert sample("fairfl_clustering_clusters", run_id="a") is None


def test_metrics_endpoint_serves_the_registry_on_a_free_port() -> None:
    import urllib.request

    endpoint = telemetry.serve_metrics(0, "127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    finally:
        endpoint.stop()
    assert endpoint.port > 0
    assert "# TYPE fairfl_build_info gauge" in text
    assert "_created" not in text
    assert all(line.startswith(("#", "fairfl_")) for line in text.splitlines() if line)


def test_monitor_refuses_runs_whose_processes_it_does_not_start(capsys: pytest.CaptureFixture[str]) -> None:
    from fairfl.compose.cli import main

    config = str(REPO / "experiments" / "quickstart.yaml")
    assert main(["run", config, "--monitor", "--transport", "inprocess"]) == 2
    assert main(["run", config, "--monitor", "--aggregator", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err.count("--monitor watches the processes this command starts") == 2
