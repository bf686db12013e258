"""No single caller can stall a service (docs/security.md, "Rate and concurrency limits"): a real aggregator process
speaking mutual TLS.

A hostile agent certificate opens 64 SubmitResult streams that never send a message (as many as the aggregator has
worker threads) and churns 100 Register calls. Meanwhile another agent certificate's Register and a grpc.health.v1
Check on the main port must answer within 1 s. The streams beyond the certificate's share are refused at once with
RESOURCE_EXHAUSTED (`concurrency`), those within it are cancelled by the server after the idle timeout
(DEADLINE_EXCEEDED, `idle`), every refusal is counted, and afterwards no worker is held: every handler ended and the
certificate can hold its full share again. A real run (two agent processes) under such a certificate, which keeps its
stalled streams and registration churn going throughout, ends with the in-process oracle's model bit for bit; and one
certificate's registrations stop at MAX_AGENTS_PER_IDENTITY while they are live.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aggregator_service.federation.state import MAX_AGENTS_PER_IDENTITY
from aggregator_service.reliability import DEFAULT_MAX_WORKERS
from fairfl.compose.launcher import Child, LocalCluster
from fairfl.config import experiment_from_dict
from fairfl.rpc_channel import open_channel
from fairfl.rpc_guard import server_limits
from fairfl.tls import ROLE_AGENT
from fairfl.v1 import control_pb2, control_pb2_grpc, federation_pb2, federation_pb2_grpc
from tests.federation_support import metric, start_aggregator
from tests.integration.test_grpc_equivalence import fetch_model, oracle

pytestmark = pytest.mark.integration

Code = grpc.StatusCode
FEDERATION = "fairfl.v1.Federation"
IDLE_S = 3.0  # the aggregator's --idle-timeout here: long enough to check the others while the streams are held
SHARE = server_limits(DEFAULT_MAX_WORKERS).per_caller  # one certificate's calls at once by default: 30 of 64 workers
FAST_S = 1.0


def _refused(aggregator: Child, reason: str) -> float:
    return metric(aggregator, "fairfl_requests_refused_total", service=FEDERATION, reason=reason)


def _handled(aggregator: Child, code: str) -> float:
    return metric(aggregator, "fairfl_grpc_server_handled_total", service=FEDERATION, method="SubmitResult", code=code)


def _eventually(read: Callable[[], float], expected: float, timeout: float = 10.0) -> float:
    """`read()` once it equals `expected` (handlers end a moment after their callers got the status), or its last value
    after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (value := read()) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def _timed(call: object, request: object) -> tuple[float, object]:
    started = time.monotonic()
    reply = call(request, timeout=10)  # type: ignore[operator]
    return time.monotonic() - started, reply


def _stalled(stub: federation_pb2_grpc.FederationStub, n: int, release: threading.Event) -> list[grpc.Future]:
    """`n` SubmitResult streams that send nothing until `release` is set."""

    def silent() -> Iterator[federation_pb2.ResultChunk]:
        release.wait()
        yield from ()

    return [stub.SubmitResult.future(silent(), timeout=60) for _ in range(n)]


def _co_host(stub: federation_pb2_grpc.FederationStub, name: str, client_id: int) -> tuple[Code, str]:
    """Register a co-hosting agent `name` for `client_id`: the status and details of the answer."""
    request = federation_pb2.RegisterRequest(agent_name=name, client_ids=[client_id], device="cpu", shared=True)
    try:
        stub.Register(request, timeout=10)
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return Code.OK, ""


def _codes(calls: list[grpc.Future], timeout: float) -> list[Code]:
    return [call.exception(timeout=timeout).code() for call in calls]


def test_one_certificate_cannot_stall_the_aggregator(tmp_path) -> None:
    release = threading.Event()
    with LocalCluster(tmp_path / "logs") as cluster:
        aggregator = start_aggregator(cluster, args=["--idle-timeout", str(IDLE_S)])
        hostile_sec = cluster.issue("hostile", ROLE_AGENT, [(0, 9)])
        honest_sec = cluster.issue("honest", ROLE_AGENT, [(10, 11)])
        with (
            open_channel(aggregator.address, hostile_sec) as hostile_channel,
            open_channel(aggregator.address, honest_sec) as honest_channel,
            futures.ThreadPoolExecutor(8) as churn,
        ):
            hostile = federation_pb2_grpc.FederationStub(hostile_channel)
            honest = federation_pb2_grpc.FederationStub(honest_channel)
            health = health_pb2_grpc.HealthStub(honest_channel)
            try:
                # -- 64 silent streams: the share is held, the rest refused at once
                opened = time.monotonic()
                streams = _stalled(hostile, DEFAULT_MAX_WORKERS, release)
                deadline = time.monotonic() + 10
                while sum(s.done() for s in streams) < DEFAULT_MAX_WORKERS - SHARE and time.monotonic() < deadline:
                    time.sleep(0.02)
                refused = [s for s in streams if s.done()]
                held = [s for s in streams if not s.done()]
                assert (len(refused), len(held)) == (DEFAULT_MAX_WORKERS - SHARE, SHARE)
                assert set(_codes(refused, 1)) == {Code.RESOURCE_EXHAUSTED}
                assert all("per caller" in s.exception().details() for s in refused)

                # -- the hostile certificate churns Register while the honest one registers and checks health
                churned = [churn.submit(_co_host, hostile, f"hostile-{i}", i % 10) for i in range(100)]
                latencies: dict[str, list[float]] = {"Register": [], "Check": []}
                for i in range(3):
                    request = federation_pb2.RegisterRequest(
                        agent_name=f"honest-{i}", client_ids=[10, 11], device="cpu"
                    )
                    took, reply = _timed(honest.Register, request)
                    assert reply.agent_id  # type: ignore[attr-defined]
                    latencies["Register"].append(took)
                    took, reply = _timed(health.Check, health_pb2.HealthCheckRequest())
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING  # type: ignore[attr-defined]
                    latencies["Check"].append(took)
                answers = [c.result(timeout=30) for c in churned]
                assert not any(s.done() for s in held), "the checks must run while the hostile share is held"
                assert max(max(v) for v in latencies.values()) < FAST_S, latencies
                stalled = {Code.DEADLINE_EXCEEDED, Code.UNAVAILABLE, Code.INTERNAL, Code.UNKNOWN}
                assert not stalled & {code for code, _ in answers}, answers
                over_share = [why for code, why in answers if code == Code.RESOURCE_EXHAUSTED]
                churn_refused = sum("at a time per caller" in why for why in over_share)

                # -- the held streams are cancelled once idle, and their handlers end
                assert set(_codes(held, IDLE_S + 10)) == {Code.DEADLINE_EXCEEDED}
                assert time.monotonic() - opened >= IDLE_S - 0.1
                assert all("no message from the caller for 3 s" in s.exception().details() for s in held)
                assert _refused(aggregator, "idle") == SHARE
                assert _refused(aggregator, "concurrency") == DEFAULT_MAX_WORKERS - SHARE + churn_refused
                # every handler ended, so its worker is free
                assert _eventually(lambda: _handled(aggregator, "DEADLINE_EXCEEDED"), SHARE) == SHARE
                assert _handled(aggregator, "RESOURCE_EXHAUSTED") == DEFAULT_MAX_WORKERS - SHARE

                # -- no worker is held: the certificate gets its whole share again, and no more
                again = _stalled(hostile, SHARE + 1, release)
                deadline = time.monotonic() + 10
                while not any(s.done() for s in again) and time.monotonic() < deadline:
                    time.sleep(0.02)
                time.sleep(0.2)  # a second refusal, if any, would come as fast
                (extra,) = [s for s in again if s.done()]
                assert extra.exception().code() == Code.RESOURCE_EXHAUSTED
                for stream in again:
                    stream.cancel()
            finally:
                release.set()


class _Hostile:
    """One agent certificate that keeps as many silent SubmitResult streams open as the aggregator has workers (new
    ones as the idle timeout cancels them) and churns co-host registrations under new names, on threads, until
    stopped."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.stub = federation_pb2_grpc.FederationStub(channel)
        self.release = threading.Event()
        self.stopped = threading.Event()
        self.registered = 0
        self.threads = [threading.Thread(target=self._streams), threading.Thread(target=self._churn)]
        for thread in self.threads:
            thread.start()

    def _streams(self) -> None:
        open_now: list[grpc.Future] = []
        while not self.stopped.is_set():
            open_now = [s for s in open_now if not s.done()]
            open_now += _stalled(self.stub, DEFAULT_MAX_WORKERS - len(open_now), self.release)
            self.stopped.wait(0.2)
        for stream in open_now:
            stream.cancel()

    def _churn(self) -> None:
        i = 0
        while not self.stopped.is_set():
            code, _ = _co_host(self.stub, f"churn-{i}", 100 + i % 100)  # over its share or rate: refused, as it should
            self.registered += code == Code.OK
            i += 1

    def stop(self) -> None:
        self.stopped.set()
        self.release.set()
        for thread in self.threads:
            thread.join(30)


RUN_CONFIG = experiment_from_dict(
    {
        "name": "fair-share",
        "seed": 5,
        "rounds": 4,
        "data": {"dataset": "synthetic", "num_clients": 4},
        "model": {"name": "mlp", "params": {"hidden": [16]}},
        "training": {"local_steps": 2, "batch_size": 20, "lr": 0.1},
        "selection": {"method": "random", "clients_per_round": 3},
        "runtime": {"agents": 2, "round_timeout_s": 60, "register_timeout_s": 60, "device": "cpu"},
    }
)


def test_a_run_under_a_hostile_certificate_ends_with_the_undisturbed_model(tmp_path) -> None:
    oracle_params, _ = oracle(RUN_CONFIG)
    with LocalCluster(tmp_path / "logs") as cluster:
        aggregator = start_aggregator(cluster, args=["--idle-timeout", str(IDLE_S)])
        with open_channel(aggregator.address, cluster.issue("hostile", ROLE_AGENT, [(100, 199)])) as channel:
            hostile = _Hostile(channel)
            try:
                cluster.start_agents(aggregator.address, 4, 2, "cpu", 1)
                with cluster.open_channel(aggregator.address) as operator:
                    control = control_pb2_grpc.RunControlStub(operator)
                    control.StartRun(
                        control_pb2.StartRunRequest(experiment_yaml=RUN_CONFIG.to_yaml(), run_id="disturbed"),
                        timeout=30,
                    )
                    events = list(control.WatchRun(control_pb2.WatchRunRequest(run_id="disturbed"), timeout=180))
                    assert events[-1].status.state == control_pb2.RUN_STATE_COMPLETED, events[-1].status.message
                    params = fetch_model(control, "disturbed")
            finally:
                hostile.stop()
        # The hostile certificate was at work all along: its streams refused over its share and cancelled when idle.
        assert _refused(aggregator, "concurrency") > 0 and _refused(aggregator, "idle") > 0
        assert hostile.registered > 0
    assert torch.equal(params, oracle_params), "the disturbed run's model differs from the in-process oracle's"


def test_one_certificate_holds_a_bounded_number_of_registrations(tmp_path) -> None:
    """Registrations under new names from one certificate stop at MAX_AGENTS_PER_IDENTITY while they are live (each
    is, having just registered): the rest are refused, naming the limit, and another certificate still registers."""
    extra = 50
    with LocalCluster(tmp_path / "logs") as cluster:
        aggregator = start_aggregator(cluster, args=["--rate-limit", "0"])
        churner = cluster.issue("churner", ROLE_AGENT, [(0, 9)])
        with (
            open_channel(aggregator.address, churner) as channel,
            open_channel(aggregator.address, cluster.issue("other", ROLE_AGENT, [(10, 10)])) as other_channel,
            futures.ThreadPoolExecutor(8) as pool,
        ):
            stub = federation_pb2_grpc.FederationStub(channel)
            registrations = range(MAX_AGENTS_PER_IDENTITY + extra)
            answers = list(pool.map(lambda i: _co_host(stub, f"churn-{i}", i % 10), registrations))
            other = federation_pb2_grpc.FederationStub(other_channel)
            took, reply = _timed(
                other.Register, federation_pb2.RegisterRequest(agent_name="other", client_ids=[10], device="cpu")
            )
    accepted = [why for code, why in answers if code == Code.OK]
    refused = [why for code, why in answers if code == Code.RESOURCE_EXHAUSTED]
    assert (len(accepted), len(refused)) == (MAX_AGENTS_PER_IDENTITY, extra), {c for c, _ in answers}
    assert all(f"({MAX_AGENTS_PER_IDENTITY})" in why for why in refused), refused[:1]
    assert reply.agent_id and took < FAST_S  # type: ignore[attr-defined]
