"""gRPC server and channel construction shared by every service: options, health, reflection, deadlines, and
transport security (mutual TLS, who may call what, per-caller rate and concurrency limits).

Security: a process gets its mTLS material from a directory (`--tls-dir`, env FAIRFL_TLS_DIR: ca.crt, tls.crt,
tls.key, as `fairfl certs` writes them) or runs plaintext only when told to (`--insecure`, env FAIRFL_INSECURE=1).
A TLS server requires and verifies a client certificate from the same CA in the handshake, so a caller without one,
or with one from another CA, never reaches a handler (grpcio reports that to the caller as UNAVAILABLE). The
`AccessPolicy` of a server then says which roles (fairfl.tls: service, agent) may call each of its gRPC services and
how fast and how much at once one caller may call; refusals are PERMISSION_DENIED, RESOURCE_EXHAUSTED,
INVALID_ARGUMENT (unreadable messages) or DEADLINE_EXCEEDED (idle calls) with a message, and every refusal, the
guard's and its handlers', is counted in fairfl_requests_refused_total by reason (AccessInterceptor).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent import futures
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fairfl import telemetry, tls
from fairfl.telemetry import GrpcMetricsInterceptor

log = logging.getLogger(__name__)

# Big payloads are streamed in chunks, so gRPC's default per-message limit (4 MiB) is kept: no single message (a chunk,
# a header with its signature vectors) may exceed it. Chunks stay below it. The servers' access guard enforces it
# (RESOURCE_EXHAUSTED, counted as `size`); gRPC core itself refuses only messages over CORE_MESSAGE_BYTES, before any
# handler or counter sees them, so that is what one call can make a server buffer.
CHUNK_BYTES = 2 * 1024 * 1024
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
CORE_MESSAGE_BYTES = 2 * MAX_MESSAGE_BYTES
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
    ("grpc.max_receive_message_length", CORE_MESSAGE_BYTES),
]
# The plaintext health port has no access guard: gRPC core keeps the message limit there.
HEALTH_SERVER_OPTIONS: list[tuple[str, int]] = [
    *(option for option in SERVER_OPTIONS if option[0] != "grpc.max_receive_message_length"),
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
MAX_IN_FLIGHT_ENV = "FAIRFL_MAX_IN_FLIGHT"
IDLE_TIMEOUT_ENV = "FAIRFL_IDLE_TIMEOUT"

# A call whose handler waits this long for the caller's next message (the first included), or for the caller to read
# a response, is cancelled: FairFL's agents send and read without pauses, so only a stalled or hostile caller waits
# that long, and it would hold a worker thread. A message is seen only once it has fully arrived, so the timeout is
# also the slowest link a 2 MiB chunk may take: 120 s is about 17 KB/s per stream.
IDLE_TIMEOUT_S = 120.0
# Health checks on a service's main port run on threads of their own, so no caller's calls can starve them; one caller
# may run at most HEALTH_PER_CALLER of them at once, so a thread always stays free for the others.
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
# A health Watch holds a worker for as long as the caller keeps it open (FairFL itself never watches): one per caller.
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
HEALTH_WORKERS = 4
HEALTH_PER_CALLER = 2
DEFAULT_WORKERS = 32  # a server's worker threads unless it says otherwise (the aggregator does: --max-workers)
CALL_END_GRACE_S = 0.1  # see _Requests._call_ended


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


def add_limit_arguments(parser: argparse.ArgumentParser, rate: bool = True) -> None:
    """Per-caller limits of a server (AccessPolicy): calls at once and idle calls; with `rate`, also how fast one caller
    may call the rate-limited methods."""
    if rate:
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
            help="calls one caller may make at once before the rate applies (env FAIRFL_RATE_BURST, default "
            "%(default)s)",
        )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=int(os.environ.get(MAX_IN_FLIGHT_ENV, "0")),
        help="calls and streams one caller (certificate) may have running at once, health checks aside; at least 1 "
        "and below the worker threads less those kept free (1/16, at least 1); 0 = half of that (env "
        f"{MAX_IN_FLIGHT_ENV}, default %(default)s)",
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=float(os.environ.get(IDLE_TIMEOUT_ENV, str(IDLE_TIMEOUT_S))),
        help="seconds a call may wait for the caller's next message before the server cancels it with "
        f"DEADLINE_EXCEEDED and frees its thread (env {IDLE_TIMEOUT_ENV}, default %(default)s)",
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
    """Who may call a server's gRPC services, how fast and how much at once.

    `roles` maps a full service name (e.g. "fairfl.v1.Privacy") to the certificate roles allowed to call it; services
    not listed (health, reflection) are open to every verified identity. `rate_limited` lists full method names
    ("/fairfl.v1.Federation/SubmitResult") each caller may call at most `rate` times a second on average, `burst` at
    once. Every call but a health check holds a worker thread while it runs: one caller may run `max_in_flight` at once
    (0: half of what the server admits, see server_limits), and a call waiting `idle_timeout` seconds for the caller's
    next message is cancelled.
    """

    roles: Mapping[str, frozenset[str]] = field(default_factory=dict)
    rate_limited: frozenset[str] = frozenset()
    rate: float = 0.0  # 0: no rate limit
    burst: int = 1
    max_in_flight: int = 0  # 0: the default for the server's pool
    idle_timeout: float = IDLE_TIMEOUT_S


@dataclass(frozen=True)
class ServerLimits:
    """Calls a server with `workers` threads runs at once (health checks aside: they have threads of their own).

    `reserved` threads no admitted call may hold, so a call over a limit is refused at once instead of queueing behind
    held ones; `total` calls may run in all and `per_caller` for one identity, always fewer, so the others keep room.
    """

    workers: int
    reserved: int
    total: int
    per_caller: int


def server_limits(workers: int, policy: AccessPolicy | None = None) -> ServerLimits:
    """The limits `policy` sets on a pool of `workers` threads; ValueError naming the option that is out of range."""
    policy = policy or AccessPolicy()
    if not (math.isfinite(policy.idle_timeout) and policy.idle_timeout > 0):
        raise ValueError(f"--idle-timeout must be a positive number of seconds, got {policy.idle_timeout}")
    reserved = max(1, workers // 16)
    total = max(1, workers - reserved)
    per_caller = policy.max_in_flight or max(1, min(total - 1, (total + 1) // 2))
    if policy.max_in_flight and not 0 < per_caller < total:
        raise ValueError(
            f"--max-in-flight must be at least 1 and below {total} (the {workers} worker threads less {reserved} kept "
            f"free for refusals), so that one caller cannot hold every thread; got {policy.max_in_flight}"
        )
    return ServerLimits(workers, reserved, total, per_caller)


def check_limits(parser: argparse.ArgumentParser, policy: AccessPolicy, workers: int) -> ServerLimits:
    """server_limits for an entry point: a usage error (exit 2) naming the option instead of a traceback."""
    try:
        return server_limits(workers, policy)
    except ValueError as err:
        parser.error(str(err))


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


class InFlight:
    """Calls running per caller and in all, each capped. The table holds callers with a call running only."""

    def __init__(self, per_caller: int, total: int) -> None:
        self.per_caller = per_caller
        self.total = total
        self.count: dict[str, int] = {}
        self.running = 0
        self.lock = threading.Lock()

    def enter(self, key: str) -> str:
        """Take a slot for `key`: "" when admitted, else the refusal's reason (`concurrency`: the caller's share is
        taken; `capacity`: every slot is)."""
        with self.lock:
            held = self.count.get(key, 0)
            if held >= self.per_caller:
                return "concurrency"
            if self.running >= self.total:
                return "capacity"
            self.count[key] = held + 1
            self.running += 1
            return ""

    def leave(self, key: str) -> None:
        with self.lock:
            left = self.count.get(key, 0) - 1
            if left > 0:
                self.count[key] = left
            elif self.count.pop(key, None) is None:
                return  # not held: nothing to give back
            self.running -= 1


# Set in a call's context when its refusal was counted, so the guard does not count its status again. gRPC runs each
# call in a contextvars.Context of its own.
_COUNTED: ContextVar[bool] = ContextVar("fairfl_refusal_counted", default=False)
# Refusals a handler answered without refuse(): counted under their status code, a fixed word.
_CODE_REASONS = {code: code.name.lower() for code in grpc.StatusCode if code is not grpc.StatusCode.OK}


# Every refusal tells the caller its reason in this trailing metadata key, so a client can tell "busy, try again"
# (BUSY_REASONS: refused at the door, nothing of the call was read) from a service's own RESOURCE_EXHAUSTED (a
# privacy budget spent), which shares the status code.
REFUSAL_KEY = "fairfl-refusal"
BUSY_REASONS = frozenset({"concurrency", "capacity", "rate_limited"})


def refuse(context: grpc.ServicerContext, service: str, reason: str, code: grpc.StatusCode, message: str) -> NoReturn:
    """Count a refusal under `reason` (a fixed word from the code, never caller input), name it to the caller
    (REFUSAL_KEY) and abort the RPC (raises)."""
    telemetry.REQUESTS_REFUSED.labels(service, reason).inc()
    _COUNTED.set(True)
    context.set_trailing_metadata(((REFUSAL_KEY, reason),))
    context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")


def refused_as_busy(err: grpc.RpcError) -> bool:
    """Whether a call was turned away because its caller or the server was busy (its share of calls, the server's
    capacity, the rate limit): nothing of it was read, and the same call may be made again after a pause."""
    if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    trailing = err.trailing_metadata() or ()  # type: ignore[attr-defined]
    return any(key == REFUSAL_KEY and value in BUSY_REASONS for key, value in trailing)


class _Unreadable:
    """Stands for a request message that could not be read (too big, or not the method's message): the guard
    refuses the call when the handler reaches it, instead of gRPC answering INTERNAL uncounted."""

    __slots__ = ("reason", "size")

    def __init__(self, reason: str, size: int) -> None:
        self.reason, self.size = reason, size

    def ByteSize(self) -> int:  # as protobuf messages have, for the byte counters
        return self.size


def _checked(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    """`deserializer` that returns an _Unreadable instead of raising, and for messages over MAX_MESSAGE_BYTES."""

    def parse(raw: bytes) -> Any:
        if len(raw) > MAX_MESSAGE_BYTES:
            return _Unreadable("size", len(raw))
        try:
            message = raw if deserializer is None else deserializer(raw)
        except Exception:  # whatever the parser raises on hostile bytes: the call is refused as malformed
            return _Unreadable("malformed", len(raw))
        return _Unreadable("malformed", len(raw)) if message is None else message

    return parse


def _cancel(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """End a call from outside its handler, with a status the caller receives. ServicerContext.cancel() sends
    CANCELLED without details; the call under it (grpcio 1.85: context._rpc_event.call) can cancel with a status."""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    if call is not None:
        try:
            call.cancel(code.value[0], details)
            return
        except (TypeError, ValueError):  # another grpcio: plain cancel below
            pass
    context.cancel()


class IdleWatch:
    """Cancels calls whose handler waited `timeout` seconds for the caller's next message, freeing their threads.

    One thread per server. It wakes at the earliest deadline of a waiting call, and otherwise every `timeout` seconds:
    a call that starts waiting after it fell asleep cannot be due before then, so nothing needs to wake it. Handlers
    set and clear their call's deadline without a lock (one float attribute); opening and closing a call take one.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.calls: set[_Requests] = set()
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._run, name="idle-watch", daemon=True)
        self.thread.start()

    def add(self, call: _Requests) -> None:
        with self.lock:
            self.calls.add(call)

    def discard(self, call: _Requests) -> None:
        with self.lock:
            self.calls.discard(call)

    def close(self) -> None:
        self.closed.set()

    def _run(self) -> None:
        sleep = self.timeout
        while not self.closed.wait(sleep):
            now = time.monotonic()
            wake = now + self.timeout
            due = []
            with self.lock:
                for call in self.calls:
                    deadline = call.deadline
                    if call.expired or deadline == 0.0:
                        continue
                    if deadline <= now:
                        due.append(call)
                    elif deadline < wake:
                        wake = deadline
            for call in due:  # outside the lock: cancelling enters grpc
                try:
                    call.expire(now)
                except Exception:  # one call's failure must not end the watch of all the others
                    log.exception("cancelling an idle call failed")
            sleep = max(wake - time.monotonic(), 0.0)


class _Requests:
    """A call's request messages as its handler reads them: each wait for one is watched (IdleWatch), and one that
    could not be read refuses the call. Also carries the call's in-flight slot."""

    __slots__ = ("context", "deadline", "expired", "key", "messages", "route", "sending")

    def __init__(self, messages: Iterator[Any], context: grpc.ServicerContext, route: _Route, key: str) -> None:
        self.messages = messages
        self.context = context
        self.route = route
        self.key = key  # the caller's in-flight slot
        self.deadline = 0.0  # while the handler waits for a message: when the caller must have sent it (monotonic)
        self.expired = False  # cancelled by the idle watch (counted there)
        self.sending = False  # the deadline is for the caller to read a response, not to send a request

    def __iter__(self) -> _Requests:
        return self

    def __next__(self) -> Any:  # on every message's path: kept short
        self.deadline = time.monotonic() + self.route.timeout
        try:
            message = next(self.messages)
        except BaseException:
            self._waited()
            raise
        self.deadline = 0.0
        if self.expired or type(message) is _Unreadable:
            self._waited()
            self.route.refuse_unreadable(self.context, message)
        return message

    def _waited(self) -> None:
        self.deadline = 0.0
        if self.expired:  # whatever the cancelled call's reader saw (end of stream or an error), it ends here
            self.context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, self.route.idle_message())

    def one(self) -> Any:
        """The request of a unary method."""
        for message in self:
            return message
        if self._call_ended():
            _COUNTED.set(True)  # answered by gRPC already (RESOURCE_EXHAUSTED) or the caller left: no refusal of ours
            self.context.abort(grpc.StatusCode.CANCELLED, "the call ended before its request arrived")
        refuse(
            self.context,
            self.route.service,
            "malformed",
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{self.route.method} takes exactly one request message; the call ended without one",
        )

    def _call_ended(self) -> bool:
        """Whether the call is over though its handler has not answered: gRPC core refused the request message (over
        CORE_MESSAGE_BYTES) or the caller cancelled. grpcio reports that just after the end of the requests, so wait
        for it a moment (only a caller that breaks the protocol, closing a unary call without its request, waits)."""
        over = threading.Event()
        return not self.context.add_callback(over.set) or over.wait(CALL_END_GRACE_S) or not self.context.is_active()

    def expire(self, now: float) -> None:
        """Idle too long (called by the IdleWatch thread): count it and end the call; its waiting handler wakes up.
        Nothing happens when the call moved on since the watch looked (its message arrived, or was read)."""
        deadline = self.deadline
        if deadline == 0.0 or deadline > now:
            return
        self.expired = True
        route = self.route
        telemetry.REQUESTS_REFUSED.labels(route.service, "idle").inc()
        message = route.idle_message(self.sending)
        self.context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)  # what the metrics see, whatever the handler does
        self.context.set_details(message)
        _cancel(self.context, grpc.StatusCode.DEADLINE_EXCEEDED, message)


class _Route:
    """One method's guard, resolved once per method: role, rate and in-flight checks, reading the request (served as a
    client stream, so it is read after admission and under the idle watch) and counting how the call ended."""

    def __init__(self, guard: AccessInterceptor, method: str) -> None:
        self.guard = guard
        self.method = method
        self.service, _, self.name = method.lstrip("/").rpartition("/")
        self.roles = guard.policy.roles.get(self.service)
        self.health = method == HEALTH_CHECK
        self.lane = guard.health_calls if self.health else guard.calls
        self.watches = guard.watches if method == HEALTH_WATCH else None  # also in `lane`: a call like any other
        self.limiter = guard.limiter if method in guard.policy.rate_limited else None
        self.idle = guard.idle
        self.timeout = guard.idle.timeout

    def handler(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """`handler` guarded. Unary requests are read as a stream of one: gRPC reads a unary request on a worker thread
        before any interceptor runs, so a caller that never sent it would hold the thread unchecked."""
        options = {
            "request_deserializer": _checked(handler.request_deserializer),
            "response_serializer": handler.response_serializer,
        }
        behavior: Callable[..., Any]
        if handler.unary_unary is not None:
            behavior = self.unary_unary(handler.unary_unary)
            guarded = grpc.stream_unary_rpc_method_handler(behavior, **options)
        elif handler.stream_unary is not None:
            behavior = self.stream_unary(handler.stream_unary)
            guarded = grpc.stream_unary_rpc_method_handler(behavior, **options)
        elif handler.unary_stream is not None:
            behavior = self.unary_stream(handler.unary_stream)
            guarded = grpc.stream_stream_rpc_method_handler(behavior, **options)
        else:
            behavior = self.stream_stream(handler.stream_stream)
            guarded = grpc.stream_stream_rpc_method_handler(behavior, **options)
        if self.health:
            behavior.__dict__["experimental_thread_pool"] = self.guard.health_pool  # grpcio runs it there
        return guarded

    def unary_unary(self, behavior: Callable[..., Any]) -> Callable[[Iterator[Any], grpc.ServicerContext], Any]:
        def run(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            reading = self.enter(requests, context)
            try:
                return behavior(reading.one(), context)
            finally:
                self.leave(reading)

        return run

    def stream_unary(self, behavior: Callable[..., Any]) -> Callable[[Iterator[Any], grpc.ServicerContext], Any]:
        def run(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            reading = self.enter(requests, context)
            try:
                return behavior(reading, context)
            finally:
                self.leave(reading)

        return run

    def unary_stream(
        self, behavior: Callable[..., Iterable[Any]]
    ) -> Callable[[Iterator[Any], grpc.ServicerContext], Iterator[Any]]:
        def run(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            reading = self.enter(requests, context)
            try:
                yield from self.responses(reading, behavior(reading.one(), context))
            finally:
                self.leave(reading)

        return run

    def stream_stream(
        self, behavior: Callable[..., Iterable[Any]]
    ) -> Callable[[Iterator[Any], grpc.ServicerContext], Iterator[Any]]:
        def run(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            reading = self.enter(requests, context)
            try:
                yield from self.responses(reading, behavior(reading, context))
            finally:
                self.leave(reading)

        return run

    def responses(self, reading: _Requests, responses: Iterable[Any]) -> Iterator[Any]:
        """`responses`, watched while each is sent: suspended at its yield, the handler waits for gRPC to send it, and
        gRPC for the caller to read (HTTP/2 flow control), so a caller that stops reading would hold the thread."""
        for response in responses:
            reading.sending = True
            reading.deadline = time.monotonic() + self.timeout
            yield response
            reading.deadline = 0.0
            reading.sending = False

    def enter(self, requests: Iterator[Any], context: grpc.ServicerContext) -> _Requests:
        """Admit the caller (or refuse: raises) and start watching the call."""
        reading = _Requests(requests, context, self, self.admit(context))
        self.idle.add(reading)
        return reading

    def leave(self, reading: _Requests) -> None:
        """The call ended: free its slot, and count it when it ended refused without having been counted."""
        self.idle.discard(reading)
        self.lane.leave(reading.key)
        if self.watches is not None:
            self.watches.leave(reading.key)
        code = reading.context.code()
        if code is None or code is grpc.StatusCode.OK or reading.expired or _COUNTED.get():
            return
        telemetry.REQUESTS_REFUSED.labels(self.service, _CODE_REASONS.get(code, "unknown")).inc()

    def admit(self, context: grpc.ServicerContext) -> str:
        """Check the caller and take its slot; returns the slot's key (its certificate, on a plaintext server its
        address), or refuses (raises)."""
        identity = caller(context) if self.guard.tls_on else None
        if self.guard.tls_on and identity is None:  # cannot happen with require_client_auth; refuse if it ever does
            refuse(context, self.service, "unauthenticated", grpc.StatusCode.UNAUTHENTICATED, "no client certificate")
        if identity is not None and self.roles is not None and identity.role not in self.roles:
            refuse(
                context,
                self.service,
                "role",
                grpc.StatusCode.PERMISSION_DENIED,
                f"{self.service} accepts only {' or '.join(sorted(self.roles))} identities; the caller presented "
                f"{identity.describe()}",
            )
        key = identity.fingerprint if identity is not None else context.peer().rpartition(":")[0]
        if self.limiter is not None and not self.limiter.allow(key):
            policy = self.guard.policy
            refuse(
                context,
                self.service,
                "rate_limited",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"rate limit: at most {policy.rate:g} {self.name} calls a second per caller (burst {policy.burst}); "
                "slow down and retry",
            )
        reason = self.lane.enter(key)
        if reason:
            refuse(context, self.service, reason, grpc.StatusCode.RESOURCE_EXHAUSTED, self.busy_message(reason))
        if self.watches is not None and (reason := self.watches.enter(key)):
            self.lane.leave(key)
            refuse(
                context,
                self.service,
                reason,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"Watch refused: at most {self.watches.per_caller} health watch per caller and "
                f"{self.watches.total} in all (each holds a thread while open); use Check",
            )
        return key

    def busy_message(self, reason: str) -> str:
        what = "health checks" if self.health else "calls (streams included)"
        if reason == "concurrency":
            return (
                f"{self.name} refused: at most {self.lane.per_caller} {what} at a time per caller; wait for one to end"
            )
        return f"{self.name} refused: the server runs at most {self.lane.total} {what} at once; retry shortly"

    def refuse_unreadable(self, context: grpc.ServicerContext, message: _Unreadable) -> NoReturn:
        if message.reason == "size":
            refuse(
                context,
                self.service,
                "size",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.method}: a request message of {message.size} bytes exceeds the limit of {MAX_MESSAGE_BYTES} "
                "bytes; stream large payloads in chunks",
            )
        refuse(
            context,
            self.service,
            "malformed",
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{self.method}: a request message could not be parsed as this method's request",
        )

    def idle_message(self, sending: bool = False) -> str:
        if sending:
            return (
                f"{self.name}: the caller read no response for {self.idle.timeout:g} s, so the server cancelled the "
                "call; read a stream's responses as they come"
            )
        return (
            f"{self.name}: no message from the caller for {self.idle.timeout:g} s, so the server cancelled the call; "
            "send without pauses, or open the call when the data is ready"
        )


class AccessInterceptor(grpc.ServerInterceptor):
    """Enforces an AccessPolicy before a handler runs and while it reads: role per service (TLS servers), rate and
    in-flight limits per caller (its certificate; on a plaintext server, its address) and in all, idle calls, and
    request messages that cannot be read; counts every refusal, its own and its handlers'.

    Health checks run on threads of their own with their own in-flight limits. The guarded handler of each method is
    built once and reused while the inner handler stays the same object.
    """

    def __init__(self, policy: AccessPolicy, tls_on: bool, workers: int = DEFAULT_WORKERS) -> None:
        self.policy = policy
        self.tls_on = tls_on
        self.limits = server_limits(workers, policy)
        self.limiter = RateLimiter(policy.rate, policy.burst) if policy.rate > 0 else None
        self.calls = InFlight(self.limits.per_caller, self.limits.total)
        self.health_calls = InFlight(HEALTH_PER_CALLER, HEALTH_WORKERS - 1)
        self.watches = InFlight(1, self.limits.reserved)
        self.health_pool = futures.ThreadPoolExecutor(HEALTH_WORKERS, thread_name_prefix="grpc-health")
        self.idle = IdleWatch(policy.idle_timeout)
        self.handlers: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        cached = self.handlers.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        guarded = _Route(self, method).handler(handler)
        self.handlers[method] = (handler, guarded)  # bounded: only registered methods have a handler
        return guarded

    def close(self) -> None:
        """Stop the idle watch and the health threads (after the server stopped)."""
        self.idle.close()
        self.health_pool.shutdown(wait=False)


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
