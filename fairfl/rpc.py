"""gRPC server and channel construction shared by every service: options, health, reflection, deadlines, and
transport security (mutual TLS, who may call what, per-caller rate limits).

Security: a process gets its mTLS material from a directory (`--tls-dir`, env FAIRFL_TLS_DIR: ca.crt, tls.crt,
tls.key, as `fairfl certs` writes them) or runs plaintext only when told to (`--insecure`, env FAIRFL_INSECURE=1).
A TLS server requires and verifies a client certificate from the same CA in the handshake, so a caller without one,
or with one from another CA, never reaches a handler (grpcio reports that to the caller as UNAVAILABLE). The
`AccessPolicy` of a server then says which roles (fairfl.tls: service, agent) may call each of its gRPC services and
how fast one caller may call the rate-limited methods; refusals are PERMISSION_DENIED or RESOURCE_EXHAUSTED with a
message, counted in fairfl_requests_refused_total by reason.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fairfl import telemetry, tls
from fairfl.telemetry import GrpcMetricsInterceptor

log = logging.getLogger(__name__)

# Big payloads are streamed in chunks, so gRPC's default per-message limit (4 MiB) is kept, and set explicitly: no
# single message (a chunk, a header with its signature vectors) may exceed it. Chunks stay below it.
CHUNK_BYTES = 2 * 1024 * 1024
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# Blobs (models) up to this size may travel inline in a poll reply, at most this much per reply (< MAX_MESSAGE_BYTES).
INLINE_BLOB_BYTES = 2 * 1024 * 1024

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
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    *KEEPALIVE_OPTIONS,
    # Reconnect soon after a peer restarts (docs/reliability.md): gRPC's default backoff grows to 120 s.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 5_000),
]

# glibc malloc: a freed chunk-sized block (2-4 MiB: message buffers, serialised protos) is returned to the kernel and
# the next one faults its pages in again, which on a small VM costs more than moving the bytes (~1 s per GiB
# streamed). Buffers up to 32 MiB (glibc's ceiling for this setting) come from the heap, and the heap keeps up to
# 128 MiB of freed memory before giving it back.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MALLOC_TRIM_THRESHOLD = 128 * 1024 * 1024
MALLOC_MMAP_THRESHOLD = 32 * 1024 * 1024
_allocator_tuned = False


def tune_allocator() -> None:
    """Keep streaming buffers' memory in the process (see MALLOC_*); once per process, a no-op off glibc."""
    global _allocator_tuned
    if _allocator_tuned:
        return
    _allocator_tuned = True
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): its allocator's defaults stand
        return
    mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD)
    mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)


TLS_DIR_ENV = "FAIRFL_TLS_DIR"
INSECURE_ENV = "FAIRFL_INSECURE"
HEALTH_BIND_ENV = "FAIRFL_HEALTH_BIND"


# -- transport security ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransportSecurity:
    """One process's mTLS material: the deployment CA and this process's certificate and key (PEM)."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    source: str = ""  # where it was read from, for messages

    @classmethod
    def from_dir(cls, directory: str | Path) -> TransportSecurity:
        """Read ca.crt, tls.crt and tls.key from `directory`; ValueError naming what is missing."""
        path = Path(directory)
        files = {name: path / name for name in (tls.CA_CERT, tls.CERT, tls.KEY)}
        missing = [str(f) for f in files.values() if not f.is_file()]
        if missing:
            raise ValueError(
                f"TLS directory {path} lacks {', '.join(missing)}; create certificates with `fairfl certs` "
                "(or run plaintext with --insecure)"
            )
        security = cls(*(files[n].read_bytes() for n in (tls.CA_CERT, tls.CERT, tls.KEY)), source=str(path))
        try:
            security.identity  # noqa: B018 - fail at start-up, not at the first call, on a certificate that is no identity
        except tls.TlsError as err:
            raise ValueError(f"{files[tls.CERT]}: {err}") from err
        return security

    @classmethod
    def from_issued(cls, issued: tls.Issued) -> TransportSecurity:
        return cls(issued.ca_pem, issued.cert_pem, issued.key_pem, source=issued.name)

    @property
    def identity(self) -> tls.Identity:
        return tls.identity_of(self.cert_pem)

    def server_credentials(self) -> grpc.ServerCredentials:
        # require_client_auth: the handshake itself refuses callers without a certificate from this CA.
        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca_pem, self.key_pem, self.cert_pem)


def add_transport_arguments(parser: argparse.ArgumentParser, server: bool = True) -> None:
    """The shared options that choose mTLS or plaintext (and, for servers, the plaintext health port)."""
    parser.add_argument(
        "--tls-dir",
        default=os.environ.get(TLS_DIR_ENV, ""),
        help=f"directory with ca.crt, tls.crt and tls.key (from `fairfl certs`): mutual TLS on every connection "
        f"(env {TLS_DIR_ENV})",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        default=os.environ.get(INSECURE_ENV, "").lower() in ("1", "true", "yes"),
        help=f"plaintext gRPC without authentication: only on a trusted network (env {INSECURE_ENV}=1)",
    )
    if server:
        parser.add_argument(
            "--health-bind",
            default=os.environ.get(HEALTH_BIND_ENV, ""),
            help="also serve grpc.health.v1 alone, in plaintext, on this host:port, for probes that cannot do mTLS "
            f"(Kubernetes' native gRPC probes; env {HEALTH_BIND_ENV})",
        )


def security_from_args(args: argparse.Namespace) -> TransportSecurity | None:
    """The process's security as its options say: TLS material, or None for an explicit --insecure.

    Raises ValueError when neither or both are given: plaintext is never a silent default.
    """
    if args.tls_dir and args.insecure:
        raise ValueError("choose either --tls-dir (mutual TLS) or --insecure (plaintext), not both")
    if args.insecure:
        return None
    if not args.tls_dir:
        raise ValueError(
            f"no TLS material: pass --tls-dir DIR (env {TLS_DIR_ENV}; create it with `fairfl certs`), or --insecure "
            f"(env {INSECURE_ENV}=1) to run plaintext on a trusted network"
        )
    return TransportSecurity.from_dir(args.tls_dir)


def transport_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> TransportSecurity | None:
    """security_from_args for an entry point: a usage error (exit 2) with the reason instead of a traceback; the
    result becomes the process's channel security (use_security)."""
    try:
        security = security_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    use_security(security)
    return security


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """Per-caller limits of a server's rate-limited methods (AccessPolicy)."""
    parser.add_argument(
        "--rate-limit",
        type=float,
        default=float(os.environ.get("FAIRFL_RATE_LIMIT", "200")),
        help="calls a second one caller (certificate) may make to the rate-limited methods; 0 = off "
        "(env FAIRFL_RATE_LIMIT, default %(default)s)",
    )
    parser.add_argument(
        "--rate-burst",
        type=int,
        default=int(os.environ.get("FAIRFL_RATE_BURST", "1000")),
        help="calls one caller may make at once before the rate applies (env FAIRFL_RATE_BURST, default %(default)s)",
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=int(os.environ.get("FAIRFL_MAX_IN_FLIGHT", "64")),
        help="rate-limited calls one caller may have running at once; 0 = no limit (env FAIRFL_MAX_IN_FLIGHT, "
        "default %(default)s)",
    )


def caller(context: grpc.ServicerContext) -> tls.Identity | None:
    """The verified identity of the caller of an RPC on a TLS server; None on a plaintext server."""
    pem = context.auth_context().get("x509_pem_cert")
    return tls.identity_of(pem[0]) if pem else None


def principal(context: grpc.ServicerContext) -> str:
    """A stable key for the caller: its certificate fingerprint, or "" on a plaintext server (everyone alike)."""
    identity = caller(context)
    return identity.fingerprint if identity is not None else ""


@dataclass(frozen=True)
class AccessPolicy:
    """Who may call a server's gRPC services, and how fast.

    `roles` maps a full service name (e.g. "fairfl.v1.Privacy") to the certificate roles allowed to call it; services
    not listed (health, reflection) are open to every verified identity. `rate_limited` lists full method names
    ("/fairfl.v1.Federation/SubmitResult") each caller may call at most `rate` times a second on average, `burst` at
    once, with at most `max_in_flight` of them running at a time (a slow stream holds a worker thread).
    """

    roles: Mapping[str, frozenset[str]] = field(default_factory=dict)
    rate_limited: frozenset[str] = frozenset()
    rate: float = 0.0  # 0: no rate limit
    burst: int = 1
    max_in_flight: int = 0  # 0: no limit


class RateLimiter:
    """Token buckets per caller: `rate` tokens a second up to `burst`; the least recently seen callers are forgotten
    beyond `max_callers`, so the table stays bounded whoever connects."""

    def __init__(self, rate: float, burst: int, max_callers: int = 10_000) -> None:
        self.rate = rate
        self.burst = max(1, burst)
        self.max_callers = max_callers
        self.buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, time)
        self.lock = threading.Lock()

    def allow(self, key: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        with self.lock:
            tokens, last = self.buckets.pop(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - last) * self.rate)
            allowed = tokens >= 1.0
            self.buckets[key] = (tokens - 1.0 if allowed else tokens, now)
            while len(self.buckets) > self.max_callers:
                self.buckets.popitem(last=False)
            return allowed


class _InFlight:
    """Calls running per caller, capped."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count: dict[str, int] = {}
        self.lock = threading.Lock()

    def enter(self, key: str) -> bool:
        with self.lock:
            if self.count.get(key, 0) >= self.limit:
                return False
            self.count[key] = self.count.get(key, 0) + 1
            return True

    def leave(self, key: str) -> None:
        with self.lock:
            left = self.count.get(key, 1) - 1
            if left:
                self.count[key] = left
            else:
                self.count.pop(key, None)


def refuse(context: grpc.ServicerContext, service: str, reason: str, code: grpc.StatusCode, message: str) -> NoReturn:
    """Count a refusal under `reason` (a fixed word from the code, never caller input) and abort the RPC (raises)."""
    telemetry.REQUESTS_REFUSED.labels(service, reason).inc()
    context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")


class AccessInterceptor(grpc.ServerInterceptor):
    """Enforces an AccessPolicy before a handler runs: role per service (TLS servers), then rate and in-flight limits
    per caller (its certificate; on a plaintext server, its address)."""

    def __init__(self, policy: AccessPolicy, tls_on: bool) -> None:
        self.policy = policy
        self.tls_on = tls_on
        self.limiter = RateLimiter(policy.rate, policy.burst) if policy.rate > 0 else None
        self.in_flight = _InFlight(policy.max_in_flight) if policy.max_in_flight > 0 else None

    def _admit(self, context: grpc.ServicerContext, service: str, method: str) -> str:
        """Check the caller; returns the in-flight key to release ("" when none was taken), or aborts."""
        identity = caller(context) if self.tls_on else None
        if self.tls_on and identity is None:  # cannot happen with require_client_auth; refuse if it ever does
            refuse(context, service, "unauthenticated", grpc.StatusCode.UNAUTHENTICATED, "no client certificate")
        allowed = self.policy.roles.get(service)
        if identity is not None and allowed is not None and identity.role not in allowed:
            refuse(
                context,
                service,
                "role",
                grpc.StatusCode.PERMISSION_DENIED,
                f"{service} accepts only {' or '.join(sorted(allowed))} identities; the caller presented "
                f"{identity.describe()}",
            )
        if method not in self.policy.rate_limited:
            return ""
        key = identity.fingerprint if identity is not None else context.peer().rpartition(":")[0]
        if self.limiter is not None and not self.limiter.allow(key):
            refuse(
                context,
                service,
                "rate_limited",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"rate limit: at most {self.policy.rate:g} {method.rpartition('/')[2]} calls a second per caller "
                f"(burst {self.policy.burst}); slow down and retry",
            )
        if self.in_flight is not None:
            if not self.in_flight.enter(key):
                refuse(
                    context,
                    service,
                    "concurrency",
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"at most {self.policy.max_in_flight} {method.rpartition('/')[2]} calls at a time per caller; "
                    "wait for one to finish",
                )
            return key
        return ""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        service = method.lstrip("/").rpartition("/")[0]
        admit = self._admit
        release = self.in_flight.leave if self.in_flight is not None else (lambda _key: None)
        return _guarded(handler, lambda context: admit(context, service, method), release)


def _guarded(
    handler: grpc.RpcMethodHandler,
    admit: Callable[[grpc.ServicerContext], str],
    release: Callable[[str], None],
) -> grpc.RpcMethodHandler:
    """`handler` with `admit(context)` run before its behaviour and `release(key)` after it (streams: when done)."""
    options = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}

    def unary(behavior: Callable[..., Any]) -> Callable[[Any, grpc.ServicerContext], Any]:
        def run(request: Any, context: grpc.ServicerContext) -> Any:
            key = admit(context)
            try:
                return behavior(request, context)
            finally:
                if key:
                    release(key)

        return run

    def streaming(behavior: Callable[..., Iterator[Any]]) -> Callable[[Any, grpc.ServicerContext], Iterator[Any]]:
        def run(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            key = admit(context)
            try:
                yield from behavior(request, context)
            finally:
                if key:
                    release(key)

        return run

    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **options)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **options)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), **options)
    return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), **options)


@dataclass
class RunningServer:
    """A started gRPC server with its health servicer, so owners can flip serving status on shutdown."""

    server: grpc.Server
    port: int
    health: health.HealthServicer
    health_server: grpc.Server | None = None  # plaintext, health only (--health-bind)
    health_port: int = 0

    def set_serving(self, service_names: Iterable[str], serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *service_names]:
            self.health.set(name, status)

    def stop(self, grace: float = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        if self.health_server is not None:
            self.health_server.stop(0).wait()


def start_server(
    bind: str,
    register: Callable[[grpc.Server], Iterable[str]],
    *,
    max_workers: int = 32,
    interceptors: Iterable[grpc.ServerInterceptor] = (),
    security: TransportSecurity | None = None,
    policy: AccessPolicy | None = None,
    health_bind: str = "",
) -> RunningServer:
    """Start a server on `bind` ("host:port"; port 0 picks a free one) with health and reflection.

    `register` adds the service's servicers and returns their full names (e.g. "fairfl.v1.Privacy"). Every server
    counts and times its RPCs for Prometheus (fairfl.telemetry); the metrics are served where the process says. With
    `security` the port speaks mutual TLS only; without it, plaintext (processes choose it explicitly: see
    security_from_args). `policy` says who may call what (roles apply on TLS servers). `health_bind` adds a
    plaintext port serving only grpc.health.v1, for probes that cannot present a certificate.
    """
    tune_allocator()
    guards = [AccessInterceptor(policy, tls_on=security is not None)] if policy is not None else []
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        options=SERVER_OPTIONS,
        # Metrics outermost, so refusals by the access check are counted with their status code too.
        interceptors=[GrpcMetricsInterceptor(), *guards, *interceptors],
    )
    names = list(register(server))
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = _bind(server, bind, security)
    health_server, health_port = None, 0
    if health_bind:
        health_server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="health"), options=SERVER_OPTIONS
        )
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)  # the same serving status
        health_port = _bind(health_server, health_bind, None)
        health_server.start()
    server.start()
    running = RunningServer(server, port, health_servicer, health_server, health_port)
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


_process_security: TransportSecurity | None = None


def use_security(security: TransportSecurity | None) -> None:
    """Make `security` this process's identity for every channel it opens (service and agent entry points call this
    once, after security_from_args), so peers added anywhere in a service dial with the same mTLS material."""
    global _process_security
    _process_security = security


def open_channel(address: str, security: TransportSecurity | None = None) -> grpc.Channel:
    """A channel to `address` with the shared options: mutual TLS with `security` (default: the process's, see
    use_security), plaintext when neither is set."""
    tune_allocator()
    security = security or _process_security
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
