"""Hostile numbers at a real aggregator process (issue #18): 48 concurrent long polls (every long-poll slot) whose
wait is no duration (NaN, ±inf, < 0) are refused at once with INVALID_ARGUMENT and leave no server thread spinning,
a huge finite wait is cut to the call's deadline, and refusals of unknown runs, blobs, agents and run ids are counted
by reason."""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from fairfl.compose.launcher import Child, LocalCluster
from fairfl.rpc_channel import open_channel
from fairfl.tls import ROLE_AGENT
from fairfl.v1 import control_pb2, control_pb2_grpc, federation_pb2, federation_pb2_grpc, tensor_pb2
from tests.federation_support import call, metric, start_aggregator

pytestmark = pytest.mark.integration

Code = grpc.StatusCode
FEDERATION, CONTROL = "fairfl.v1.Federation", "fairfl.v1.RunControl"
CALLERS = 48  # every long-poll slot of an aggregator with the default 64 workers
CERTIFICATES = 4  # the callers' identities: each stays far below a per-caller limit of calls at once (fairfl.rpc)
WAITS = [math.nan, math.inf, -math.inf, -1.0, 1e300]
CALL_DEADLINE_S = 2.0  # a poll waits at most until one second before its deadline


@dataclass
class Aggregator:
    child: Child
    agents: list[tuple[federation_pb2_grpc.FederationStub, str]]  # (stub over its own certificate, agent id)
    control: control_pb2_grpc.RunControlStub


@pytest.fixture(scope="module")
def aggregator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Aggregator]:
    with LocalCluster(tmp_path_factory.mktemp("hostile-polls") / "logs") as cluster:
        child = start_aggregator(cluster)
        with contextlib.ExitStack() as stack:
            agents = []
            for i in range(CERTIFICATES):
                security = cluster.issue(f"agent-{i}", ROLE_AGENT, [(i, i)])
                stub = federation_pb2_grpc.FederationStub(stack.enter_context(open_channel(child.address, security)))
                request = federation_pb2.RegisterRequest(agent_name=f"agent-{i}", client_ids=[i], device="cpu")
                agents.append((stub, stub.Register(request, timeout=10).agent_id))
            operator = stack.enter_context(cluster.open_channel(child.address))
            yield Aggregator(child, agents, control_pb2_grpc.RunControlStub(operator))


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process (fields 14 and 15 of /proc/<pid>/stat, counted after the command name)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_polls_with_a_wait_that_is_no_duration_answer_at_once_and_nothing_spins(aggregator: Aggregator) -> None:
    refused_before = metric(aggregator.child, "fairfl_requests_refused_total", service=FEDERATION, reason="malformed")
    answers: list[tuple[float, Code, float]] = []
    lock = threading.Lock()

    def poll(caller: int) -> None:
        stub, agent_id = aggregator.agents[caller % CERTIFICATES]
        wait = WAITS[caller % len(WAITS)]
        request = federation_pb2.PollRequest(
            agent_id=agent_id, max_tasks=2**32 - 1, wait_seconds=wait, inline_blob_bytes=2**64 - 1
        )
        started = time.monotonic()
        code = call(lambda r, timeout: stub.PollTasks(r, timeout=CALL_DEADLINE_S), request)[0]
        with lock:
            answers.append((wait, code, time.monotonic() - started))

    callers = [threading.Thread(target=poll, args=(i,)) for i in range(CALLERS)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(30)
    assert len(answers) == CALLERS
    durations = [wait >= 0 and math.isfinite(wait) for wait, _, _ in answers]
    slow = [a for a, duration in zip(answers, durations, strict=True) if a[2] >= (1.8 if duration else 1.0)]
    worst = {repr(wait): (code.name, round(seconds, 2)) for wait, code, seconds in slow}
    assert not slow, f"polls not answered at once, by wait: (status, seconds) {worst}"
    # No thread is left spinning: the aggregator is idle.
    pid = aggregator.child.process.pid
    before = _cpu_seconds(pid)
    time.sleep(2.0)
    used = _cpu_seconds(pid) - before
    assert used < 0.2, f"the idle aggregator used {used:.2f}s of CPU in 2s"
    # 1e300 is cut to the call's deadline less a second and answered empty; the others are refused and counted.
    assert [code for (_, code, _), duration in zip(answers, durations, strict=True) if duration] == [Code.OK] * 9
    refused = [code for (_, code, _), duration in zip(answers, durations, strict=True) if not duration]
    assert refused == [Code.INVALID_ARGUMENT] * 39
    counted = metric(aggregator.child, "fairfl_requests_refused_total", service=FEDERATION, reason="malformed")
    assert counted == refused_before + len(refused)


def test_refusals_of_unknown_runs_blobs_agents_and_run_ids_are_counted(aggregator: Aggregator) -> None:
    def refused(service: str, reason: str) -> float:
        return metric(aggregator.child, "fairfl_requests_refused_total", service=service, reason=reason)

    unknown, identity = refused(FEDERATION, "unknown"), refused(FEDERATION, "identity")
    control_unknown = refused(CONTROL, "unknown")
    stub = aggregator.agents[0][0]
    assert call(stub.GetRunSpec, federation_pb2.RunSpecRequest(run_id="nope"))[0] == Code.NOT_FOUND
    code, details, _ = call(
        lambda r, timeout: list(stub.FetchBlob(r, timeout=timeout)),
        tensor_pb2.BlobRef(sha256="0" * 64, offset=2**64 - 1, length=2**64 - 1),
    )
    assert code == Code.NOT_FOUND and "not held" in details
    poll = federation_pb2.PollRequest(agent_id="forgotten", wait_seconds=1.0)
    code, details, _ = call(stub.PollTasks, poll)
    assert code == Code.UNAUTHENTICATED and "register again" in details
    assert call(aggregator.control.GetRun, control_pb2.GetRunRequest(run_id="nope"))[0] == Code.NOT_FOUND
    assert call(aggregator.control.StopRun, control_pb2.StopRunRequest(run_id="nope"))[0] == Code.NOT_FOUND
    assert refused(FEDERATION, "unknown") == unknown + 2
    assert refused(FEDERATION, "identity") == identity + 1
    assert refused(CONTROL, "unknown") == control_unknown + 2
