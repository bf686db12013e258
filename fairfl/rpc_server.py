"""Construction of FairFL's gRPC servers: options, health (on the main port and an optional plaintext health port),
reflection, the metrics and access interceptors, binding, and serving until a signal.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fairfl.rpc import CORE_MESSAGE_BYTES, KEEPALIVE_OPTIONS, MAX_MESSAGE_BYTES, tune_allocator
from fairfl.rpc_guard import DEFAULT_WORKERS, AccessInterceptor, AccessPolicy
from fairfl.rpc_metrics import GrpcMetricsInterceptor
from fairfl.rpc_security import TransportSecurity

log = logging.getLogger(__name__)


SERVER_OPTIONS: list[tuple[str, int]] = [
    *KEEPALIVE_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.max_concurrent_streams", 256),
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", CORE_MESSAGE_BYTES),
]

# The plaintext health port has no access guard: gRPC core keeps the message limit there.
HEALTH_SERVER_OPTIONS: list[tuple[str, int]] = [
    *(option for option in SERVER_OPTIONS if option[0] != "grpc.max_receive_message_length"),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class _HealthServicer(health.HealthServicer):
    """grpc.health.v1 as grpcio serves it, with a message on its NOT_FOUND for a service name it does not know (grpcio
    sends none), as every refusal here has."""

    def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext) -> Any:
        reply = super().Check(request, context)
        if context.code() is grpc.StatusCode.NOT_FOUND:
            context.set_details(
                f'no health status for service {request.service[:200]!r}: ask for the server ("") or one of the '
                "gRPC services it serves"
            )
        return reply


@dataclass
class RunningServer:
    """A started gRPC server with its health servicer, so owners can flip serving status on shutdown."""

    server: grpc.Server
    port: int
    health: health.HealthServicer
    health_server: grpc.Server | None = None  # plaintext, health only (--health-bind)
    health_port: int = 0
    guard: AccessInterceptor | None = None

    def set_serving(self, service_names: Iterable[str], serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *service_names]:
            self.health.set(name, status)

    def stop(self, grace: float = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        if self.health_server is not None:
            self.health_server.stop(0).wait()
        if self.guard is not None:
            self.guard.close()


def start_server(
    bind: str,
    register: Callable[[grpc.Server], Iterable[str]],
    *,
    max_workers: int = DEFAULT_WORKERS,
    interceptors: Iterable[grpc.ServerInterceptor] = (),
    security: TransportSecurity | None = None,
    policy: AccessPolicy | None = None,
    health_bind: str = "",
) -> RunningServer:
    """Start a server on `bind` ("host:port"; port 0 picks a free one) with health and reflection.

    `register` adds the service's servicers and returns their full names (e.g. "fairfl.v1.Privacy"). Every server
    counts and times its RPCs for Prometheus (fairfl.telemetry); the metrics are served where the process says. With
    `security` the port speaks mutual TLS only; without it, plaintext (processes choose it explicitly: see
    security_from_args). `policy` says who may call what (roles apply on TLS servers) and how much one caller may run
    at once (default: AccessPolicy(); ValueError when its limits do not fit `max_workers`, see server_limits).
    `health_bind` adds a plaintext port serving only grpc.health.v1, for probes that cannot present a certificate.
    """
    tune_allocator()
    guard = AccessInterceptor(policy or AccessPolicy(), tls_on=security is not None, workers=max_workers)
    try:
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
            options=SERVER_OPTIONS,
            # Metrics outermost, so refusals by the access check are counted with their status code too.
            interceptors=[GrpcMetricsInterceptor(), guard, *interceptors],
        )
        names = list(register(server))
        health_servicer = _HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        port = _bind(server, bind, security)
        health_server, health_port = None, 0
        if health_bind:
            health_server = grpc.server(
                futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="health"), options=HEALTH_SERVER_OPTIONS
            )
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)  # the same serving status
            health_port = _bind(health_server, health_bind, None)
            health_server.start()
    except BaseException:
        guard.close()
        raise
    server.start()
    running = RunningServer(server, port, health_servicer, health_server, health_port, guard)
    running.set_serving(names, True)
    log.info(
        "serving %s on %s (port %d, %s)%s",
        ", ".join(names),
        bind,
        port,
        f"mutual TLS as {security.identity.describe()}" if security is not None else "PLAINTEXT, no authentication",
        f"; health in plaintext on port {health_port}" if health_server is not None else "",
    )
    return running


def _bind(server: grpc.Server, bind: str, security: TransportSecurity | None) -> int:
    try:
        if security is None:
            port = server.add_insecure_port(bind)
        else:
            port = server.add_secure_port(bind, security.server_credentials())
    except RuntimeError as err:  # grpcio raises RuntimeError when the address cannot be bound
        raise OSError(f"could not bind gRPC server to {bind!r}: address in use or not available") from err
    if port == 0:
        raise OSError(f"could not bind gRPC server to {bind!r}: address in use or not available")
    return port


def serve_until_signal(
    running: RunningServer,
    service_names: Iterable[str],
    on_stop: Callable[[], None] | None = None,
    before_drain: Callable[[], None] | None = None,
) -> None:
    """Block until SIGTERM or SIGINT, then report NOT_SERVING, run `before_drain` (e.g. release long polls), drain
    in-flight calls and run `on_stop`."""
    import signal

    stop = threading.Event()

    def _handle(signum: int, _frame: object) -> None:
        log.info("signal %d received, shutting down", signum)
        stop.set()

    signal.signal(signal.SIGTERM, _handle)
    signal.signal(signal.SIGINT, _handle)
    stop.wait()
    running.set_serving(service_names, False)
    if before_drain is not None:
        before_drain()
    running.stop(grace=2.0)
    if on_stop is not None:
        on_stop()
