"""The access guard of every FairFL gRPC server: an interceptor enforcing an AccessPolicy (who may call what, how
fast and how much at once one caller may call) before and while a handler runs.

The `AccessPolicy` of a server says which roles (fairfl.tls: service, agent) may call each of its gRPC services and
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
from dataclasses import dataclass, field
from typing import Any, NoReturn

import grpc

from fairfl import telemetry
from fairfl.rpc import MAX_MESSAGE_BYTES
from fairfl.rpc_refusals import CODE_REASONS, REFUSAL_COUNTED, refuse
from fairfl.rpc_security import caller

log = logging.getLogger(__name__)


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
            REFUSAL_COUNTED.set(
                True
            )  # answered by gRPC already (RESOURCE_EXHAUSTED) or the caller left: no refusal of ours
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
        if code is None or code is grpc.StatusCode.OK or reading.expired or REFUSAL_COUNTED.get():
            return
        telemetry.REQUESTS_REFUSED.labels(self.service, CODE_REASONS.get(code, "unknown")).inc()

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
