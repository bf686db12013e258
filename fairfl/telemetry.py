"""Prometheus metrics of every FairFL process: the one catalog of metric definitions and the /metrics endpoint (the gRPC
server interceptor that updates the RPC series is fairfl.rpc_metrics; the launcher announcement, fairfl.announce).

Every metric is declared here, once, with the components that export it; the services import the objects and update
them. `CATALOG` is what docs/observability.md, the Grafana dashboards and the alert rules are checked against, and a
test checks it against each service's live /metrics output.

Conventions: one prefix (`fairfl_`), base units (seconds, bytes, ratios in 0..1, not percent), `_total` on counters,
label values from bounded sets only. Run-scoped series carry a `run_id` label and are dropped when a process moves on
to another run (`RunScope`), so a long-lived service holds the series of one run, not of every run it ever served.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from fairfl import __version__

log = logging.getLogger(__name__)

# `_created` series double every counter and histogram and no dashboard needs them.
disable_created_metrics()

PREFIX = "fairfl_"
Component = Literal["aggregator", "clustering", "privacy", "agent"]
COMPONENTS: tuple[Component, ...] = ("aggregator", "clustering", "privacy", "agent")
GRPC_SERVERS: tuple[Component, ...] = ("aggregator", "clustering", "privacy")
Kind = Literal["counter", "gauge", "histogram"]

METRICS_PORT_ENV = "FAIRFL_METRICS_PORT"
METRICS_HOST_ENV = "FAIRFL_METRICS_HOST"
CLIENT_LIMIT_ENV = "FAIRFL_METRICS_CLIENT_LIMIT"
DEFAULT_CLIENT_LIMIT = 100

# Buckets. Latencies span a health check (sub-ms) to a long-poll (seconds) and a watched run (minutes).
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
ACCURACY_BUCKETS = tuple(round(0.05 * i, 2) for i in range(1, 21))  # 0.05 .. 1.0: 5-point accuracy bins

REGISTRY = CollectorRegistry(auto_describe=True)


@dataclass(frozen=True)
class MetricSpec:
    """One metric as exported: `name` is the family name on /metrics (counters include `_total`)."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...]
    components: tuple[Component, ...]

    @property
    def sample_names(self) -> tuple[str, ...]:
        """The series names a query can use for this family."""
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


CATALOG: dict[str, MetricSpec] = {}
_METRICS: dict[str, Counter | Gauge | Histogram] = {}
_HOOKS: dict[str, list[Callable[[], None]]] = {}
_ENABLED: set[str] = set()
_ENABLE_LOCK = threading.Lock()


def _declare(spec: MetricSpec, metric: Any) -> Any:
    if spec.name in CATALOG:
        raise ValueError(f"metric {spec.name} declared twice")
    CATALOG[spec.name] = spec
    _METRICS[spec.name] = metric
    return metric


def _counter(name: str, help: str, labels: Iterable[str] = (), *, on: Iterable[Component]) -> Counter:
    assert name.endswith("_total"), name
    spec = MetricSpec(PREFIX + name, "counter", help, tuple(labels), tuple(on))
    return _declare(spec, Counter(spec.name, help, spec.labels, registry=None))


def _gauge(name: str, help: str, labels: Iterable[str] = (), *, on: Iterable[Component]) -> Gauge:
    spec = MetricSpec(PREFIX + name, "gauge", help, tuple(labels), tuple(on))
    return _declare(spec, Gauge(spec.name, help, spec.labels, registry=None))


def _histogram(
    name: str, help: str, buckets: tuple[float, ...], labels: Iterable[str] = (), *, on: Iterable[Component]
) -> Histogram:
    spec = MetricSpec(PREFIX + name, "histogram", help, tuple(labels), tuple(on))
    return _declare(spec, Histogram(spec.name, help, spec.labels, registry=None, buckets=buckets))


AGG: tuple[Component, ...] = ("aggregator",)

# --- every process -------------------------------------------------------------------------------------------------

BUILD_INFO = _gauge(
    "build_info", "Always 1: the component and FairFL version of this process.", ["component", "version"], on=COMPONENTS
)

# --- gRPC servers (updated by fairfl.rpc_metrics, installed by fairfl.rpc_server.start_server) ------------------------

GRPC_HANDLED = _counter(
    "grpc_server_handled_total",
    "RPCs completed by this server, by gRPC service, method and status code.",
    ["service", "method", "code"],
    on=GRPC_SERVERS,
)
GRPC_LATENCY = _histogram(
    "grpc_server_handling_seconds",
    "Time from receiving an RPC to finishing its response (streams: until the last message).",
    LATENCY_BUCKETS,
    ["service", "method"],
    on=GRPC_SERVERS,
)
GRPC_RECEIVED_BYTES = _counter(
    "grpc_server_received_bytes_total",
    "Serialized protobuf bytes of request messages received, by gRPC service and method.",
    ["service", "method"],
    on=GRPC_SERVERS,
)
GRPC_SENT_BYTES = _counter(
    "grpc_server_sent_bytes_total",
    "Serialized protobuf bytes of response messages sent, by gRPC service and method.",
    ["service", "method"],
    on=GRPC_SERVERS,
)
REQUESTS_REFUSED = _counter(
    "requests_refused_total",
    "Requests refused, by gRPC service and reason (a fixed word: role, unauthenticated, rate_limited, concurrency, "
    "capacity, idle, identity, replay, late, unknown, mismatch, integrity, non_finite, layout, size, malformed, "
    "data_signature, no_data_signature, client_data; any "
    "other refusal a handler answers counts under its status code in lower case, e.g. not_found, invalid_argument, "
    "failed_precondition, unavailable). TLS handshakes refused for a missing or foreign certificate never become "
    "requests; unary calls with a message over gRPC core's own 8 MiB limit are not counted.",
    ["service", "reason"],
    on=GRPC_SERVERS,
)

# --- aggregator: runs and rounds -------------------------------------------------------------------------------------

RUN_INFO = _gauge(
    "run_info", "Always 1 for the current run: its strategy and dataset.", ["run_id", "strategy", "dataset"], on=AGG
)
RUN_ACTIVE = _gauge(
    "run_active", "1 while the run is pending or running, 0 once it completed, stopped or failed.", ["run_id"], on=AGG
)
RUN_ROUND = _gauge("run_round", "Last round the run completed.", ["run_id"], on=AGG)
RUN_ROUNDS = _gauge("run_rounds", "Rounds the run is configured for.", ["run_id"], on=AGG)
RUN_LAST_PROGRESS = _gauge(
    "run_last_progress_timestamp_seconds",
    "Unix time the run last completed a round (its start time until the first round completes).",
    ["run_id"],
    on=AGG,
)
RUN_EPSILON = _gauge(
    "run_epsilon_spent",
    "Privacy loss ε spent so far as granted by the privacy service (largest over principals); 0 for non-private runs.",
    ["run_id"],
    on=AGG,
)
RUN_TRAIN_LOSS = _gauge(
    "run_train_loss_mean", "Mean local training loss of the last aggregated round.", ["run_id"], on=AGG
)
STRATEGY_METRIC = _gauge(
    "strategy_metric",
    "A strategy's own per-round diagnostic (e.g. psi, tau_eff, lambda_max), by name.",
    ["run_id", "name"],
    on=AGG,
)
ROUNDS_COMPLETED = _counter("rounds_completed_total", "Rounds completed (aggregated or not) by every run.", on=AGG)
ROUND_DURATION = _histogram(
    "round_duration_seconds", "Wall time of a whole round, selection to report.", DURATION_BUCKETS, on=AGG
)
PHASE_DURATION = _histogram(
    "round_phase_duration_seconds",
    "Wall time of one step of a round: select, authorize, publish, train, probe, aggregate or evaluate.",
    DURATION_BUCKETS,
    ["phase"],
    on=AGG,
)
TASKS_SENT = _counter(
    "tasks_sent_total", "Tasks dispatched to clients, by phase (train, probe, evaluate).", ["phase"], on=AGG
)
TASKS_UNANSWERED = _counter(
    "tasks_unanswered_total",
    "Tasks whose phase closed without an accepted result from the client (dropouts), by phase.",
    ["phase"],
    on=AGG,
)
RESULTS_ACCEPTED = _counter("results_accepted_total", "Client results accepted into a round.", on=AGG)
RESULTS_REJECTED = _counter(
    "results_rejected_total",
    "Client results refused: reason is the gRPC status returned (lower case) or 'duplicate'.",
    ["reason"],
    on=AGG,
)
RESULTS_LATE = _counter(
    "results_late_total", "Client results refused because their round had closed at its deadline.", on=AGG
)
CONNECTED_CLIENTS = _gauge(
    "connected_clients", "Logical clients hosted by agents that were heard from recently.", on=AGG
)
CONNECTED_AGENTS = _gauge("connected_agents", "Client agents that were heard from recently.", on=AGG)
CHECKPOINT_DURATION = _histogram(
    "checkpoint_duration_seconds", "Time to write one checkpoint of a run.", DURATION_BUCKETS, on=AGG
)

# --- aggregator: fairness of the global model, per evaluation round --------------------------------------------------

FAIRNESS_ROUND = _gauge("fairness_evaluation_round", "Round of the latest evaluation.", ["run_id"], on=AGG)
ACCURACY_MEAN = _gauge(
    "fairness_accuracy_mean_ratio", "Mean over clients of the test accuracy (0..1).", ["run_id"], on=AGG
)
ACCURACY_POOLED = _gauge(
    "fairness_accuracy_pooled_ratio", "Test accuracy pooled over all clients' test samples (0..1).", ["run_id"], on=AGG
)
ACCURACY_VARIANCE = _gauge(
    "fairness_accuracy_variance",
    "Population variance over clients of the test accuracy, in ratio² (×10⁴ for %²).",
    ["run_id"],
    on=AGG,
)
ACCURACY_STD = _gauge(
    "fairness_accuracy_std_ratio", "Population standard deviation of the clients' test accuracy.", ["run_id"], on=AGG
)
ACCURACY_TAIL = _gauge(
    "fairness_accuracy_tail_ratio",
    "Mean test accuracy of the worst or best fraction of clients (tail: worst|best, fraction: 0.05|0.1).",
    ["run_id", "tail", "fraction"],
    on=AGG,
)
JAIN_INDEX = _gauge(
    "fairness_jain_index", "Jain's fairness index of the clients' test accuracies (1 = all equal).", ["run_id"], on=AGG
)
ACCURACY_CV = _gauge(
    "fairness_accuracy_coefficient_of_variation", "Std / mean of the clients' test accuracies.", ["run_id"], on=AGG
)
LOSS_MEAN = _gauge("fairness_loss_mean", "Mean over clients of the test loss.", ["run_id"], on=AGG)
LOSS_VARIANCE = _gauge(
    "fairness_loss_variance", "Population variance over clients of the test loss.", ["run_id"], on=AGG
)
PSI = _gauge(
    "fairness_psi", "FedFDP's Ψ: test-loss variance weighted by the clients' test sample counts.", ["run_id"], on=AGG
)
DISAGREEMENT = _gauge(
    "fairness_client_disagreement",
    "Equitable-FL client disagreement of the clients' test losses (ordered-pair form).",
    ["run_id"],
    on=AGG,
)
WEIGHT_ENTROPY = _gauge(
    "fairness_aggregation_weight_entropy",
    "Shannon entropy (nats) of the last round's aggregation weights; log(n) for uniform weights.",
    ["run_id"],
    on=AGG,
)
EVALUATED_CLIENTS = _gauge(
    "fairness_evaluated_clients", "Clients evaluated in the latest evaluation.", ["run_id"], on=AGG
)
MISSING_CLIENTS = _gauge(
    "fairness_missing_clients", "Clients due for evaluation that returned no result.", ["run_id"], on=AGG
)
CLIENT_ACCURACY_HISTOGRAM = _histogram(
    "evaluation_client_accuracy_ratio",
    "Distribution of per-client test accuracy; every evaluation round observes every evaluated client once.",
    ACCURACY_BUCKETS,
    ["run_id"],
    on=AGG,
)
CLIENT_ACCURACY = _gauge(
    "client_accuracy_ratio",
    "Test accuracy of one client in the latest evaluation (client ids below runtime.metrics_client_limit only).",
    ["run_id", "client_id"],
    on=AGG,
)
CLIENT_LOSS = _gauge(
    "client_loss",
    "Test loss of one client in the latest evaluation (client ids below runtime.metrics_client_limit only).",
    ["run_id", "client_id"],
    on=AGG,
)

# --- clustering service ----------------------------------------------------------------------------------------------

CLU: tuple[Component, ...] = ("clustering",)
SELECTIONS = _counter(
    "clustering_selections_total", "Client selections served, by selection method.", ["method"], on=CLU
)
SELECTION_DURATION = _histogram(
    "clustering_selection_duration_seconds",
    "Time a sampler took to select a round's clients, by selection method.",
    DURATION_BUCKETS,
    ["method"],
    on=CLU,
)
CLUSTERING_DURATION = _histogram(
    "clustering_duration_seconds",
    "Time to cluster clients, by clustering method.",
    DURATION_BUCKETS,
    ["method"],
    on=CLU,
)
CLUSTERS = _gauge("clustering_clusters", "Number of clusters in the run's latest clustering.", ["run_id"], on=CLU)
CLUSTER_SIZE = _gauge(
    "clustering_cluster_clients",
    "Clients in each cluster of the run's latest clustering (cluster indices below the client limit only).",
    ["run_id", "cluster"],
    on=CLU,
)
CLUSTERING_NMI = _gauge(
    "clustering_nmi",
    "Normalized mutual information of the latest clustering against the true client groups, when they are known.",
    ["run_id"],
    on=CLU,
)
SIGNATURES = _counter("clustering_signatures_received_total", "Client signatures received.", on=CLU)

# --- privacy service -------------------------------------------------------------------------------------------------

PRIV: tuple[Component, ...] = ("privacy",)
PRIVACY_EPSILON = _gauge(
    "privacy_epsilon_spent", "Privacy loss ε spent by the run (largest over its principals).", ["run_id"], on=PRIV
)
PRIVACY_BUDGET = _gauge("privacy_epsilon_budget", "The run's ε budget; 0 for a non-private run.", ["run_id"], on=PRIV)
PRIVACY_USED = _gauge(
    "privacy_budget_used_ratio", "Spent ε / budget ε of the run (0 for a non-private run).", ["run_id"], on=PRIV
)
PRINCIPAL_EPSILON = _gauge(
    "privacy_principal_epsilon_spent",
    "ε spent by one principal (a client id below the client limit, or a named principal such as 'federation').",
    ["run_id", "principal"],
    on=PRIV,
)
ROUNDS_AUTHORIZED = _counter(
    "privacy_rounds_authorized_total", "Rounds whose spend was authorized (replays included).", on=PRIV
)
ROUNDS_REFUSED = _counter(
    "privacy_rounds_refused_total", "Rounds refused because they would exceed the budget (RESOURCE_EXHAUSTED).", on=PRIV
)

# --- client agent ----------------------------------------------------------------------------------------------------

AGT: tuple[Component, ...] = ("agent",)
AGENT_CLIENTS = _gauge("agent_hosted_clients", "Logical clients this agent hosts.", on=AGT)
AGENT_REGISTRATIONS = _counter("agent_registrations_total", "Successful registrations with the aggregator.", on=AGT)
AGENT_TASKS = _counter(
    "agent_tasks_total",
    "Tasks this agent ran, by phase and outcome (submitted, refused by the aggregator, failed locally).",
    ["phase", "outcome"],
    on=AGT,
)
AGENT_TASK_DURATION = _histogram(
    "agent_task_duration_seconds", "Local compute time of one task, by phase.", DURATION_BUCKETS, ["phase"], on=AGT
)
AGENT_MODEL_FETCHES = _counter(
    "agent_model_fetches_total",
    "Model look-ups by sha256, by cache outcome (hit; miss: fetched; inline: came with a poll reply).",
    ["cache"],
    on=AGT,
)
AGENT_RECEIVED_BYTES = _counter("agent_received_bytes_total", "Model payload bytes downloaded.", on=AGT)
AGENT_SENT_BYTES = _counter("agent_sent_bytes_total", "Result stream bytes uploaded (serialized chunks).", on=AGT)


# --- registration and exposition --------------------------------------------------------------------------------------


class _Exported(Collector):
    """A catalog metric in the registry, running its refresh hooks (if any) just before each scrape."""

    def __init__(self, name: str) -> None:
        self.name = name

    def collect(self) -> Iterable[Any]:
        for hook in _HOOKS.get(self.name, []):
            try:
                hook()
            except Exception:  # a failing refresh must not break the whole scrape
                log.exception("refreshing %s failed", self.name)
        return _METRICS[self.name].collect()

    def describe(self) -> Iterable[Any]:
        return _METRICS[self.name].describe()


def enable(component: Component) -> None:
    """Export `component`'s metrics from this process (idempotent; a test process may enable several)."""
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r}; expected one of {', '.join(COMPONENTS)}")
    with _ENABLE_LOCK:
        if component in _ENABLED:
            return
        _ENABLED.add(component)
        registered = {n for c in _ENABLED - {component} for n, s in CATALOG.items() if c in s.components}
        for name, spec in CATALOG.items():
            if component in spec.components and name not in registered:
                REGISTRY.register(_Exported(name))
        BUILD_INFO.labels(component, __version__).set(1)


def on_collect(metric: Counter | Gauge | Histogram, hook: Callable[[], None]) -> None:
    """Run `hook` before each scrape of `metric`: for values too costly to keep current on every update."""
    name = next(n for n, m in _METRICS.items() if m is metric)
    _HOOKS.setdefault(name, []).append(hook)


def exposition() -> bytes:
    """This process's /metrics text."""
    return generate_latest(REGISTRY)


def catalog_for(component: Component) -> dict[str, MetricSpec]:
    return {n: s for n, s in CATALOG.items() if component in s.components}


@dataclass
class MetricsEndpoint:
    port: int
    _server: Any

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_metrics(port: int, host: str = "0.0.0.0") -> MetricsEndpoint:
    """Serve /metrics on host:port (port 0 picks a free one; the endpoint says which)."""
    try:
        server, _thread = start_http_server(port, host, registry=REGISTRY)
    except OSError as err:
        raise OSError(f"could not serve /metrics on {host}:{port}: {err.strerror or err}") from err
    bound = int(server.server_port)
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return MetricsEndpoint(bound, server)


def add_metrics_arguments(parser: argparse.ArgumentParser, client_limit: bool = False) -> None:
    """The shared command-line options of the /metrics endpoint."""
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get(METRICS_PORT_ENV, "0")),
        help=f"port of the Prometheus /metrics endpoint; 0 picks a free one (announced on stdout), -1 turns it off "
        f"(env {METRICS_PORT_ENV}, default %(default)s)",
    )
    parser.add_argument(
        "--metrics-host",
        default=os.environ.get(METRICS_HOST_ENV, "0.0.0.0"),
        help=f"address the /metrics endpoint listens on (env {METRICS_HOST_ENV}, default %(default)s)",
    )
    if client_limit:
        parser.add_argument(
            "--metrics-client-limit",
            type=int,
            default=int(os.environ.get(CLIENT_LIMIT_ENV, str(DEFAULT_CLIENT_LIMIT))),
            help=f"export per-client series only for client ids below this (env {CLIENT_LIMIT_ENV}, "
            "default %(default)s)",
        )


def start_from_args(args: argparse.Namespace, component: Component) -> MetricsEndpoint | None:
    """Enable `component`'s metrics and serve them as the options say; None when turned off."""
    enable(component)
    if args.metrics_port < 0:
        return None
    return serve_metrics(args.metrics_port, args.metrics_host)


# --- run-scoped series -----------------------------------------------------------------------------------------------


class RunScope:
    """Holds one component's run-labelled series for a single run: entering another run drops the previous one's.

    Keeps the `run_id` label bounded in long-lived services; the previous run's history stays in Prometheus.
    """

    def __init__(self, component: Component) -> None:
        self.metrics = [_METRICS[n] for n, s in CATALOG.items() if component in s.components and "run_id" in s.labels]
        self.run_id: str | None = None
        self.lock = threading.Lock()

    def enter(self, run_id: str) -> bool:
        """Make `run_id` the current run; True when that dropped another run's series."""
        with self.lock:
            if run_id == self.run_id:
                return False
            for metric in self.metrics:
                metric.clear()
            self.run_id = run_id
            return True
