"""Result admission: the checks every result passes before it can reach a strategy, and the refusal it gets otherwise.

The task must be open and assigned to the submitting client on the submitting agent, and given to the submitting
certificate; the payload must match the model layout, be finite and hash to the declared sha256. A refused result
leaves the round and the model untouched. A result for a task another certificate was given is answered as for a
task never issued, and counts nowhere.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import grpc

from fairfl import codec
from fairfl.params import ParamLayout
from fairfl.protocol import ClientResult, ResultAssembler, check_against_task, check_result
from fairfl.v1 import federation_pb2

if TYPE_CHECKING:
    from aggregator_service.federation.state import FederationState


class Rejected(Exception):
    """A result refused with a gRPC status; counted, and the round goes on."""

    def __init__(
        self, code: grpc.StatusCode, message: str, late: bool = False, reason: str = "", cause: str = "malformed"
    ) -> None:
        super().__init__(message)
        self.code = code
        self.late = late
        self.reason = reason or code.name.lower()  # bounded metric label: "late", "duplicate" or the status code
        self.cause = cause  # fairfl_requests_refused_total's reason: a fixed word (see fairfl.telemetry)


def never_issued(task_id: str) -> Rejected:
    """The answer for a task id the caller's certificate was not given: the same as for one never issued, so that it
    tells nothing about other sites' tasks."""
    return Rejected(grpc.StatusCode.NOT_FOUND, f"unknown task {task_id[:200]!r}: it was never issued", cause="unknown")


def addressed_task(state: FederationState, header: federation_pb2.ResultHeader, principal: str) -> federation_pb2.Task:
    """The open task `header` answers, when the caller may answer it; raises Rejected (caller holds the lock)."""
    task = state.open_task(header.task_id)
    if task is None:
        raise refusal_of_closed(state, header.task_id, principal)
    if state.owner(header.task_id) != principal:  # another site's task: answered as if it did not exist
        raise never_issued(header.task_id)
    hosts = state.client_hosts.get(header.client_id)
    if not hosts:
        raise Rejected(
            grpc.StatusCode.NOT_FOUND,
            f"unknown client id {header.client_id}: no agent registered it",
            cause="unknown",
        )
    if header.client_id != task.client_id:
        raise Rejected(
            grpc.StatusCode.PERMISSION_DENIED,
            f"task {task.task_id} belongs to client {task.client_id}, not {header.client_id}",
            cause="identity",
        )
    if header.agent_id not in hosts:  # an empty agent id is no excuse: the certificate may run many agents
        first = next(iter(hosts))
        raise Rejected(
            grpc.StatusCode.PERMISSION_DENIED,
            f"client {header.client_id} is hosted by agent {first[:8]}…"
            f"{f' (and {len(hosts) - 1} more)' if len(hosts) > 1 else ''}, not by the submitting agent "
            f"{header.agent_id[:8] or '(none given)'}",
            cause="identity",
        )
    given = state.assigned.get(header.task_id, "")
    if header.agent_id != given:  # a co-host of the client, but the task went to another agent
        raise Rejected(
            grpc.StatusCode.PERMISSION_DENIED,
            f"task {header.task_id} was given to agent {given[:8]}…, not to the submitting agent "
            f"{header.agent_id[:8]}… (both host client {header.client_id})",
            cause="identity",
        )
    if (header.run_id, header.round, header.phase) != (task.run_id, task.round, task.phase):
        raise Rejected(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"result says run {header.run_id[:200]!r} round {header.round} phase {header.phase}; the task is "
            f"run {task.run_id!r} round {task.round} phase {task.phase}",
            cause="mismatch",
        )
    return task


def refusal_of_closed(state: FederationState, task_id: str, principal: str) -> Rejected:
    """The refusal of a result for a task that is not open: a late result or a replay when the caller was given
    the task (counted with its round), else the answer for a task never issued (caller holds the lock)."""
    closed = state.closed_tasks.get(task_id)
    if closed is None or closed.principal != principal:
        return never_issued(task_id)
    kind = "duplicate" if closed.accepted else "late"
    state.counters[kind] += 1
    state.refused_after_close[(closed.round, kind)] += 1
    if closed.accepted:  # a replay: a result counts once
        return Rejected(
            grpc.StatusCode.PERMISSION_DENIED,
            f"task {task_id} is closed: its result was already accepted; results are accepted once (replay refused)",
            late=True,
            reason=kind,
            cause="replay",
        )
    return Rejected(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"task {task_id} is closed: round {closed.round} closed it at its deadline before the result arrived",
        late=True,
        reason=kind,
        cause="late",
    )


def checked_result(
    header: federation_pb2.ResultHeader,
    data: Iterable[bytes],
    layout: ParamLayout,
    task: federation_pb2.Task,
    sha256_optional: bool = False,
) -> ClientResult:
    """The result `data` carries, decoded against `layout` and checked (finite, what `task` asked for); raises Rejected
    with the status to return. `sha256_optional`: the header may omit the payload's sha256 (ResultAssembler)."""
    try:
        assembler = ResultAssembler(header, layout, sha256_optional)
        for piece in data:
            assembler.add(piece)
        result = assembler.finish()
        check_result(result)
        check_against_task(result, task)
    except codec.CodecError as err:
        code = grpc.StatusCode.DATA_LOSS if err.reason == "integrity" else grpc.StatusCode.INVALID_ARGUMENT
        raise Rejected(code, f"result for task {header.task_id} refused: {err}", cause=err.reason) from err
    return result
