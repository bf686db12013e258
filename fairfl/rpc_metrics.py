"""The gRPC server interceptor that counts and times every RPC of a FairFL server for Prometheus (installed by
fairfl.rpc_server.start_server; the metrics themselves are declared in fairfl.telemetry).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc

from fairfl.telemetry import GRPC_HANDLED, GRPC_LATENCY, GRPC_RECEIVED_BYTES, GRPC_SENT_BYTES


def _code_name(context: grpc.ServicerContext, failed: bool) -> str:
    code = context.code()  # set by abort() or set_code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    return "UNKNOWN" if failed else "OK"


class _MethodSeries:
    """One method's series, looked up once: labels() takes a lock and builds a key on every call otherwise."""

    __slots__ = ("handled", "latency", "method", "received", "sent", "service")

    def __init__(self, service: str, method: str) -> None:
        self.service, self.method = service, method
        self.latency = GRPC_LATENCY.labels(service, method)
        self.received = GRPC_RECEIVED_BYTES.labels(service, method)
        self.sent = GRPC_SENT_BYTES.labels(service, method)
        self.handled: dict[str, Any] = {}  # status code name -> its GRPC_HANDLED child

    def done(self, code: str, started: float) -> None:
        handled = self.handled.get(code)
        if handled is None:
            handled = self.handled[code] = GRPC_HANDLED.labels(self.service, self.method, code)
        handled.inc()
        self.latency.observe(time.perf_counter() - started)

    def count_in(self, messages: Iterator[Any]) -> Iterator[Any]:
        received = self.received
        for message in messages:
            received.inc(message.ByteSize())
            yield message

    def respond(self, context: grpc.ServicerContext, behavior: Callable[..., Any], request: Any) -> Any:
        started = time.perf_counter()
        try:
            response = behavior(request, context)
        except BaseException:
            self.done(_code_name(context, failed=True), started)
            raise
        self.done(_code_name(context, failed=False), started)
        if response is not None:
            self.sent.inc(response.ByteSize())
        return response

    def stream(
        self, context: grpc.ServicerContext, behavior: Callable[..., Iterable[Any]], request: Any
    ) -> Iterator[Any]:
        started = time.perf_counter()
        code = "OK"
        sent = self.sent
        try:
            for response in behavior(request, context):
                sent.inc(response.ByteSize())
                yield response
            code = _code_name(context, failed=False)
        except GeneratorExit:  # the client went away mid-stream
            code = "CANCELLED"
            raise
        except BaseException:
            code = _code_name(context, failed=True)
            raise
        finally:
            self.done(code, started)


def _same_pool(wrapper: Callable[..., Any], behavior: Callable[..., Any]) -> Callable[..., Any]:
    """`wrapper` served by the thread pool `behavior` asked for (grpcio's experimental_thread_pool), if any."""
    pool = getattr(behavior, "experimental_thread_pool", None)
    if pool is not None:
        wrapper.__dict__["experimental_thread_pool"] = pool
    return wrapper


class GrpcMetricsInterceptor(grpc.ServerInterceptor):
    """Counts every RPC by (service, method, code), times it by (service, method) and counts message bytes.

    Label values come from the registered method table and the finite status-code enum, so they stay bounded. The
    wrapped handler of each method is built once and reused while the inner handler stays the same object.
    """

    def __init__(self) -> None:
        self.handlers: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED; its name is caller-chosen, so not a label
            return None
        method = handler_call_details.method
        cached = self.handlers.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        counted = _counted(handler, method)
        self.handlers[method] = (handler, counted)  # bounded: only registered methods have a handler
        return counted


def _counted(handler: grpc.RpcMethodHandler, full_method: str) -> grpc.RpcMethodHandler:
    """`handler` with its calls counted and timed in `full_method`'s series."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    series = _MethodSeries(service, method)
    options = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        behavior_uu = handler.unary_unary

        def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
            series.received.inc(request.ByteSize())
            return series.respond(context, behavior_uu, request)

        return grpc.unary_unary_rpc_method_handler(_same_pool(unary_unary, behavior_uu), **options)
    if handler.unary_stream is not None:
        behavior_us = handler.unary_stream

        def unary_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            series.received.inc(request.ByteSize())
            return series.stream(context, behavior_us, request)

        return grpc.unary_stream_rpc_method_handler(_same_pool(unary_stream, behavior_us), **options)
    if handler.stream_unary is not None:
        behavior_su = handler.stream_unary

        def stream_unary(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            return series.respond(context, behavior_su, series.count_in(requests))

        return grpc.stream_unary_rpc_method_handler(_same_pool(stream_unary, behavior_su), **options)
    behavior_ss = handler.stream_stream

    def stream_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        return series.stream(context, behavior_ss, series.count_in(requests))

    return grpc.stream_stream_rpc_method_handler(_same_pool(stream_stream, behavior_ss), **options)
