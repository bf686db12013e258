"""gRPC server and channel construction shared by every service: options, health, reflection, deadlines."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fairfl.telemetry import GrpcMetricsInterceptor

log = logging.getLogger(__name__)

# Big payloads are streamed in chunks, so gRPC's default per-message limit (4 MiB) is left alone. Chunks stay below it.
CHUNK_BYTES = 2 * 1024 * 1024

# Deadlines (seconds) for calls whose duration does not depend on payload size.
SHORT_DEADLINE = 10.0
# Deadline for one streamed transfer; generous because models may be large.
TRANSFER_DEADLINE = 600.0

KEEPALIVE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS: list[tuple[str, int]] = [
    *KEEPALIVE_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.max_concurrent_streams", 256),
    ("grpc.so_reuseport", 0),
]
CHANNEL_OPTIONS: list[tuple[str, int]] = [*KEEPALIVE_OPTIONS]


@dataclass
class RunningServer:
    """A started gRPC server with its health servicer, so owners can flip serving status on shutdown."""

    server: grpc.Server
    port: int
    health: health.HealthServicer

    def set_serving(self, service_names: Iterable[str], serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *service_names]:
            self.health.set(name, status)

    def stop(self, grace: float = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()


def start_server(
    bind: str,
    register: Callable[[grpc.Server], Iterable[str]],
    *,
    max_workers: int = 32,
    interceptors: Iterable[grpc.ServerInterceptor] = (),
) -> RunningServer:
    """Start a server on `bind` ("host:port"; port 0 picks a free one) with health and reflection.

    `register` adds the service's servicers and returns their full names (e.g. "fairfl.v1.Privacy"). Every server
    counts and times its RPCs for Prometheus (fairfl.telemetry); the metrics are served where the process says.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        options=SERVER_OPTIONS,
        interceptors=[GrpcMetricsInterceptor(), *interceptors],
    )
    names = list(register(server))
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    try:
        port = server.add_insecure_port(bind)
    except RuntimeError as err:  # grpcio raises RuntimeError when the address cannot be bound
        raise OSError(f"could not bind gRPC server to {bind!r}: address in use or not available") from err
    if port == 0:
        raise OSError(f"could not bind gRPC server to {bind!r}: address in use or not available")
    server.start()
    running = RunningServer(server=server, port=port, health=health_servicer)
    running.set_serving(names, True)
    log.info("serving %s on %s (port %d)", ", ".join(names), bind, port)
    return running


def open_channel(address: str) -> grpc.Channel:
    """An insecure channel to `address` with the shared keepalive options."""
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def wait_for_serving(address: str, timeout: float = 30.0, service: str = "") -> None:
    """Block until the health service at `address` reports SERVING, or raise TimeoutError."""
    import time

    deadline = time.monotonic() + timeout
    last_error = ""
    with open_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last_error = f"status {reply.status}"
            except grpc.RpcError as err:  # not up yet
                last_error = f"{err.code().name}: {err.details()}"
            time.sleep(0.05)
    raise TimeoutError(f"service at {address} not SERVING after {timeout:.0f}s ({last_error})")


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """Abort the RPC with a status and an actionable message (raises)."""
    context.abort(code, message)


def serve_until_signal(
    running: RunningServer, service_names: Iterable[str], on_stop: Callable[[], None] | None = None
) -> None:
    """Block until SIGTERM or SIGINT, then report NOT_SERVING, drain in-flight calls and run `on_stop`."""
    import signal
    import threading

    stop = threading.Event()

    def _handle(signum: int, _frame: object) -> None:
        log.info("signal %d received, shutting down", signum)
        stop.set()

    signal.signal(signal.SIGTERM, _handle)
    signal.signal(signal.SIGINT, _handle)
    stop.wait()
    running.set_serving(service_names, False)
    running.stop(grace=2.0)
    if on_stop is not None:
        on_stop()


def configure_logging(level: str = "INFO") -> None:
    """One log format for every process, so interleaved output of a local run stays readable."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname).1s %(name)s[%(process)d] %(message)s",
        datefmt="%H:%M:%S",
    )
