"""Client side of FairFL's gRPC: channels with the shared options and the process's transport security, and waiting
for a server to report SERVING.
"""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fairfl.rpc import KEEPALIVE_OPTIONS, tune_allocator
from fairfl.rpc_security import TransportSecurity, process_security

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    *KEEPALIVE_OPTIONS,
    # Reconnect soon after a peer restarts (docs/reliability.md): gRPC's default backoff grows to 120 s.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 5_000),
]


def open_channel(address: str, security: TransportSecurity | None = None) -> grpc.Channel:
    """A channel to `address` with the shared options: mutual TLS with `security` (default: the process's, see
    use_security), plaintext when neither is set."""
    tune_allocator()
    security = security or process_security()
    if security is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(address, security.channel_credentials(), options=CHANNEL_OPTIONS)


def wait_for_serving(
    address: str, timeout: float = 30.0, service: str = "", security: TransportSecurity | None = None
) -> None:
    """Block until the health service at `address` reports SERVING, or raise TimeoutError."""
    deadline = time.monotonic() + timeout
    last_error = ""
    with open_channel(address, security) as channel:
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
