"""Refusals of RPCs: how a server refuses a call (counted in fairfl_requests_refused_total by reason, the reason named
to the caller in trailing metadata) and how a client tells a busy refusal (retry after a pause) from any other.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import NoReturn

import grpc

from fairfl import telemetry

# Set in a call's context when its refusal was counted, so the guard does not count its status again. gRPC runs each
# call in a contextvars.Context of its own.
REFUSAL_COUNTED: ContextVar[bool] = ContextVar("fairfl_refusal_counted", default=False)

# Refusals a handler answered without refuse(): counted under their status code, a fixed word.
CODE_REASONS = {code: code.name.lower() for code in grpc.StatusCode if code is not grpc.StatusCode.OK}

# Every refusal tells the caller its reason in this trailing metadata key, so a client can tell "busy, try again"
# (BUSY_REASONS: refused at the door, nothing of the call was read) from a service's own RESOURCE_EXHAUSTED (a
# privacy budget spent), which shares the status code.
REFUSAL_KEY = "fairfl-refusal"
BUSY_REASONS = frozenset({"concurrency", "capacity", "rate_limited"})


def refuse(context: grpc.ServicerContext, service: str, reason: str, code: grpc.StatusCode, message: str) -> NoReturn:
    """Count a refusal under `reason` (a fixed word from the code, never caller input), name it to the caller
    (REFUSAL_KEY) and abort the RPC (raises)."""
    telemetry.REQUESTS_REFUSED.labels(service, reason).inc()
    REFUSAL_COUNTED.set(True)
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


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """Abort the RPC with a status and an actionable message (raises)."""
    context.abort(code, message)
