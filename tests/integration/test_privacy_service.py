"""The privacy service as a real OS process: the gRPC API, status codes, and recovery after SIGKILL."""

from __future__ import annotations

import os
import selectors
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from fairfl.accounting import EventSpec, epsilon
from fairfl.rpc_channel import open_channel, wait_for_serving
from fairfl.v1 import privacy_pb2 as pb
from fairfl.v1 import privacy_pb2_grpc

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DELTA = 1e-5
CLIENTS = ("c0", "c1", "c2", "c3")
Code = grpc.StatusCode


class Service:
    """A privacy_service child process and a stub connected to it."""

    def __init__(self, db: Path, log: Path) -> None:
        self.log = log
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        with open(log, "a") as stderr:
            self.proc = subprocess.Popen(
                # Plaintext, asked for explicitly: this tests the ledger service; tests/integration/test_security.py
                # covers its mTLS and who may call it.
                [sys.executable, "-m", "privacy_service", "--bind", "127.0.0.1:0", "--db", str(db), "--insecure"],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        self.port = self._read_port(timeout=60.0)
        self.address = f"127.0.0.1:{self.port}"
        wait_for_serving(self.address, timeout=60.0, service="fairfl.v1.Privacy")
        self.channel = open_channel(self.address)
        self.stub = privacy_pb2_grpc.PrivacyStub(self.channel)

    def _read_port(self, timeout: float) -> int:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not sel.select(timeout=deadline - time.monotonic()):
                    break
                line = self.proc.stdout.readline()
                if not line:  # EOF: the process exited
                    break
                if line.startswith("LISTENING "):
                    return int(line.split()[1])
        self.kill()
        raise AssertionError(f"privacy_service did not report its port; stderr:\n{self.log.read_text()}")

    def kill(self, sig: int = signal.SIGKILL) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=10)
        finally:
            if hasattr(self, "channel"):
                self.channel.close()
            if self.proc.stdout is not None:
                self.proc.stdout.close()


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[[Path], Service]]:
    services: list[Service] = []

    def _start(db: Path) -> Service:
        services.append(Service(db, tmp_path / f"service-{len(services)}.log"))
        return services[-1]

    try:
        yield _start
    finally:  # never leave a child behind, whatever failed
        for s in services:
            if s.proc.poll() is None:
                s.proc.kill()
                s.proc.wait(timeout=10)


def round_events(steps: int = 1) -> list[pb.PrivacyEvent]:
    return [
        e
        for c in CLIENTS
        for e in (
            pb.PrivacyEvent(
                principal=c, mechanism=pb.MECHANISM_GRADIENT, sample_rate=0.05, noise_multiplier=2.0, count=steps
            ),
            pb.PrivacyEvent(principal=c, mechanism=pb.MECHANISM_LOSS, sample_rate=0.05, noise_multiplier=5.0, count=1),
        )
    ]


def authorize(stub: privacy_pb2_grpc.PrivacyStub, run_id: str, round_: int, steps: int = 1) -> pb.AuthorizeRoundReply:
    request = pb.AuthorizeRoundRequest(run_id=run_id, round=round_, events=round_events(steps))
    return stub.AuthorizeRound(request, timeout=10)


def code_of(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def uninterrupted_eps(rounds: int) -> float:
    return epsilon([EventSpec(0.05, 2.0, rounds), EventSpec(0.05, 5.0, rounds)], DELTA)[0]


def test_api_and_status_codes(start: Callable[[Path], Service], tmp_path: Path) -> None:
    service = start(tmp_path / "ledger.sqlite")
    stub = service.stub
    budget = pb.RegisterBudgetRequest(
        run_id="api", epsilon=1.0, delta=DELTA, accountant=pb.ACCOUNTANT_RDP, principal_kind=pb.PRINCIPAL_KIND_CLIENT
    )
    assert stub.RegisterBudget(budget, timeout=10).epsilon == 1.0
    assert stub.RegisterBudget(budget, timeout=10).epsilon == 1.0  # identical: no-op

    code, msg = code_of(lambda: authorize(stub, "missing", 0))
    assert code == Code.NOT_FOUND and "RegisterBudget" in msg
    budget.epsilon = 2.0
    code, msg = code_of(lambda: stub.RegisterBudget(budget, timeout=10))
    assert code == Code.ALREADY_EXISTS
    code, msg = code_of(
        lambda: stub.AuthorizeRound(
            pb.AuthorizeRoundRequest(run_id="api", events=[pb.PrivacyEvent(principal="c0", sample_rate=0.05)]),
            timeout=10,
        )
    )
    assert code == Code.INVALID_ARGUMENT and "events[0].mechanism" in msg

    remaining = stub.RemainingRounds(
        pb.RemainingRoundsRequest(run_id="api", per_round=round_events()), timeout=10
    ).rounds
    assert remaining == 58  # seed-fedfdp §2.5: ε ≤ 1 with gradient + loss, σ = 2, σ_l = 5 (default orders)
    for r in range(remaining):
        assert not authorize(stub, "api", r).replayed
    code, msg = code_of(lambda: authorize(stub, "api", remaining))
    assert code == Code.RESOURCE_EXHAUSTED
    assert "'c3'" in msg and f"{uninterrupted_eps(remaining + 1):.6g}" in msg and "budget ε = 1" in msg
    code, msg = code_of(lambda: authorize(stub, "api", 3, steps=2))
    assert code == Code.ALREADY_EXISTS and "different events" in msg

    spend = stub.GetSpend(pb.GetSpendRequest(run_id="api"), timeout=10)
    assert spend.rounds_recorded == remaining and spend.target_epsilon == 1.0
    assert [s.principal for s in spend.spends] == list(CLIENTS)
    assert all(s.epsilon == pytest.approx(uninterrupted_eps(remaining), abs=1e-12) for s in spend.spends)
    assert spend.max_epsilon <= 1.0

    calibrated = stub.CalibrateNoise(
        pb.CalibrateNoiseRequest(target_epsilon=1.0, delta=DELTA, sample_rate=0.05, steps=58), timeout=10
    )
    assert calibrated.epsilon <= 1.0 and 1.5 < calibrated.noise_multiplier < 2.0

    assert service.kill(signal.SIGTERM) == 0  # graceful shutdown drains and exits cleanly


def test_sigkill_mid_run_loses_nothing_and_counts_nothing_twice(
    start: Callable[[Path], Service], tmp_path: Path
) -> None:
    db = tmp_path / "ledger.sqlite"
    service = start(db)
    service.stub.RegisterBudget(
        pb.RegisterBudgetRequest(run_id="crash", epsilon=20.0, delta=DELTA, principal_kind=pb.PRINCIPAL_KIND_CLIENT),
        timeout=10,
    )
    granted_enough = threading.Event()
    state = {"granted": 0, "failed_round": None}

    def drive() -> None:  # an aggregator authorizing round after round until the connection drops
        for r in range(100_000):
            try:
                authorize(service.stub, "crash", r)
            except grpc.RpcError:
                state["failed_round"] = r
                return
            state["granted"] = r + 1
            if r + 1 >= 40:
                granted_enough.set()

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    assert granted_enough.wait(timeout=10), (tmp_path / "service-0.log").read_text()
    service.kill(signal.SIGKILL)
    driver.join(timeout=10)
    failed = state["failed_round"]
    assert failed is not None and failed >= 40 and state["granted"] == failed

    restarted = start(db)
    stub = restarted.stub
    recorded = stub.GetSpend(pb.GetSpendRequest(run_id="crash"), timeout=10).rounds_recorded
    # The round in flight at the kill either committed (its reply was lost) or not at all: never half.
    assert recorded in (failed, failed + 1)
    retry = authorize(stub, "crash", failed)  # the aggregator retries the round it got no answer for
    assert retry.granted and retry.replayed == (recorded == failed + 1)

    spend = stub.GetSpend(pb.GetSpendRequest(run_id="crash"), timeout=10)
    assert spend.rounds_recorded == failed + 1
    expected = uninterrupted_eps(failed + 1)
    assert [s.principal for s in spend.spends] == list(CLIENTS)
    for s in spend.spends:
        assert s.epsilon == pytest.approx(expected, abs=1e-12) and s.events == 2 * (failed + 1)

    replay = authorize(stub, "crash", failed)
    assert replay.granted and replay.replayed and replay.max_epsilon == pytest.approx(expected, abs=1e-12)
    assert stub.GetSpend(pb.GetSpendRequest(run_id="crash"), timeout=10) == spend


# --- the sound range (issue #18) --------------------------------------------------------------------------------------


def hostile_requests() -> list[tuple[str, object, str]]:
    """(method, request, field the refusal must name): the hostile tester's values against every numeric field."""

    def event(**kw: object) -> pb.PrivacyEvent:
        fields = {"principal": "c0", "mechanism": pb.MECHANISM_GRADIENT, "sample_rate": 0.05, "noise_multiplier": 2.0}
        return pb.PrivacyEvent(**{"count": 1, **fields, **kw})  # type: ignore[arg-type]

    def authorize(**kw: object) -> pb.AuthorizeRoundRequest:
        return pb.AuthorizeRoundRequest(run_id="hostile", round=1, events=[event(**kw)])

    def remaining(**kw: object) -> pb.RemainingRoundsRequest:
        return pb.RemainingRoundsRequest(run_id="hostile", principal="c0", per_round=[event(principal="", **kw)])

    def calibrate(**kw: object) -> pb.CalibrateNoiseRequest:
        return pb.CalibrateNoiseRequest(
            **{"target_epsilon": 1.0, "delta": DELTA, "sample_rate": 0.05, "steps": 10, **kw}
        )

    def register(**kw: object) -> pb.RegisterBudgetRequest:
        fields = {"run_id": "other", "epsilon": 1.0, "delta": DELTA, "principal_kind": pb.PRINCIPAL_KIND_CLIENT}
        return pb.RegisterBudgetRequest(**{**fields, **kw})  # type: ignore[arg-type]

    nan, inf = float("nan"), float("inf")
    requests: list[tuple[str, object, str]] = []
    for sigma in (1e-156, 1e-300, 1e300, nan, inf, -inf, 0.0):
        requests += [
            ("AuthorizeRound", authorize(noise_multiplier=sigma), "events[0].noise_multiplier"),
            ("RemainingRounds", remaining(noise_multiplier=sigma), "per_round[0].noise_multiplier"),
        ]
    for q in (1e-300, nan, -inf, 2.0):
        requests += [
            ("AuthorizeRound", authorize(sample_rate=q), "events[0].sample_rate"),
            ("RemainingRounds", remaining(sample_rate=q), "per_round[0].sample_rate"),
            ("CalibrateNoise", calibrate(sample_rate=q), "sample_rate"),
        ]
    requests += [
        ("AuthorizeRound", authorize(count=2**64 - 1), "events[0].count"),
        ("AuthorizeRound", authorize(sample_rate=0.001, noise_multiplier=9000.0, count=11), "ε = 0.0"),
        ("CalibrateNoise", calibrate(steps=2**64 - 1), "steps"),
    ]
    for value in (1e-300, 1e300, nan, inf, -1.0):
        requests += [
            ("RegisterBudget", register(epsilon=value), "epsilon"),
            ("RegisterBudget", register(delta=value), "delta"),
            ("RegisterBudget", register(orders=[2.0, value]), "orders"),
            ("CalibrateNoise", calibrate(target_epsilon=value), "target_epsilon"),
            ("CalibrateNoise", calibrate(delta=value), "delta"),
        ]
    return requests


def test_hostile_numbers_are_refused_and_the_ledger_is_unchanged(
    start: Callable[[Path], Service], tmp_path: Path
) -> None:
    db = tmp_path / "ledger.sqlite"
    service = start(db)
    stub = service.stub
    stub.RegisterBudget(
        pb.RegisterBudgetRequest(run_id="hostile", epsilon=3.52, delta=DELTA, principal_kind=pb.PRINCIPAL_KIND_CLIENT),
        timeout=10,
    )
    authorize(stub, "hostile", 0)
    before = stub.GetSpend(pb.GetSpendRequest(run_id="hostile"), timeout=10)

    def tables() -> list[list[tuple[object, ...]]]:
        with sqlite3.connect(db) as conn:
            return [conn.execute(f"SELECT * FROM {t} ORDER BY 1, 2, 3").fetchall() for t in ("budgets", "events")]

    on_disk = tables()
    for method, request, field in hostile_requests():
        code, msg = code_of(lambda: getattr(stub, method)(request, timeout=30))  # noqa: B023 (called at once)
        assert code == Code.INVALID_ARGUMENT, (method, request, code, msg)
        assert field in msg, (method, request, msg)
    assert stub.GetSpend(pb.GetSpendRequest(run_id="hostile"), timeout=10) == before
    assert tables() == on_disk
    assert code_of(lambda: stub.GetSpend(pb.GetSpendRequest(run_id="other"), timeout=10))[0] == Code.NOT_FOUND
    assert "Traceback" not in (tmp_path / "service-0.log").read_text()  # every refusal was expected, none INTERNAL
    assert service.kill(signal.SIGTERM) == 0
