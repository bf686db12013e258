"""The gRPC surface in-process: every refusal maps to a status code with a message that names what to fix."""

from __future__ import annotations

import math
from collections.abc import Iterator

import grpc
import pytest

from fairfl.accounting import EventSpec, epsilon
from fairfl.rpc_channel import open_channel
from fairfl.rpc_server import start_server
from fairfl.v1 import privacy_pb2 as pb
from fairfl.v1 import privacy_pb2_grpc
from privacy_service.ledger import Budget, InMemoryLedger
from privacy_service.servicer import SERVICE_NAME, PrivacyServicer

DELTA = 1e-5
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def stub() -> Iterator[privacy_pb2_grpc.PrivacyStub]:
    ledger = InMemoryLedger()

    def register(server: grpc.Server) -> list[str]:
        privacy_pb2_grpc.add_PrivacyServicer_to_server(PrivacyServicer(ledger), server)
        return [SERVICE_NAME]

    running = start_server("127.0.0.1:0", register, max_workers=4)
    with open_channel(f"127.0.0.1:{running.port}") as channel:
        yield privacy_pb2_grpc.PrivacyStub(channel)
    running.stop(0)
    ledger.close()


def budget(run_id: str, eps: float = 3.52, **kw: object) -> pb.RegisterBudgetRequest:
    kw.setdefault("principal_kind", pb.PRINCIPAL_KIND_CLIENT)
    kw.setdefault("delta", DELTA)
    return pb.RegisterBudgetRequest(run_id=run_id, epsilon=eps, **kw)  # type: ignore[arg-type]


def events(clients: tuple[str, ...] = ("c0", "c1"), steps: int = 1) -> list[pb.PrivacyEvent]:
    return [
        e
        for c in clients
        for e in (
            pb.PrivacyEvent(
                principal=c, mechanism=pb.MECHANISM_GRADIENT, sample_rate=0.05, noise_multiplier=2.0, count=steps
            ),
            pb.PrivacyEvent(principal=c, mechanism=pb.MECHANISM_LOSS, sample_rate=0.05, noise_multiplier=5.0, count=1),
        )
    ]


def refused(call: object, request: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=10)  # type: ignore[operator]
    return err.value


def test_happy_path(stub: privacy_pb2_grpc.PrivacyStub) -> None:
    status = stub.RegisterBudget(budget("happy"), timeout=10)
    assert (status.run_id, status.epsilon, status.accountant) == ("happy", 3.52, pb.ACCOUNTANT_RDP)
    assert stub.RegisterBudget(budget("happy"), timeout=10) == status  # identical re-registration: a no-op
    for r in range(3):
        reply = stub.AuthorizeRound(pb.AuthorizeRoundRequest(run_id="happy", round=r, events=events()), timeout=10)
        assert reply.granted and not reply.replayed
    replay = stub.AuthorizeRound(pb.AuthorizeRoundRequest(run_id="happy", round=2, events=events()), timeout=10)
    assert replay.granted and replay.replayed
    expected, order = epsilon([EventSpec(0.05, 2.0, 3), EventSpec(0.05, 5.0, 3)], DELTA)
    spend = stub.GetSpend(pb.GetSpendRequest(run_id="happy"), timeout=10)
    assert spend.rounds_recorded == 3 and spend.target_epsilon == 3.52 and spend.delta == DELTA
    assert [(s.principal, s.events, s.optimal_order) for s in spend.spends] == [("c0", 6, order), ("c1", 6, order)]
    assert spend.max_epsilon == pytest.approx(expected) == replay.max_epsilon
    one = stub.GetSpend(pb.GetSpendRequest(run_id="happy", principal="c1"), timeout=10)
    assert [s.principal for s in one.spends] == ["c1"]
    rounds = stub.RemainingRounds(
        pb.RemainingRoundsRequest(run_id="happy", principal="c0", per_round=events(("",))), timeout=10
    )
    assert rounds.rounds == 688 - 3  # dp_accounting default orders allow 688 rounds in total


def test_calibrate_noise(stub: privacy_pb2_grpc.PrivacyStub) -> None:
    reply = stub.CalibrateNoise(
        pb.CalibrateNoiseRequest(target_epsilon=8.0, delta=DELTA, sample_rate=0.04, steps=2250), timeout=10
    )
    assert reply.noise_multiplier == pytest.approx(1.416, abs=2e-3)
    assert reply.epsilon <= 8.0


def test_budget_exceeded_names_principal_spend_and_target(stub: privacy_pb2_grpc.PrivacyStub) -> None:
    stub.RegisterBudget(budget("tight", eps=1.0), timeout=10)
    err = refused(stub.AuthorizeRound, pb.AuthorizeRoundRequest(run_id="tight", round=0, events=events(steps=500)))
    assert err.code() == Code.RESOURCE_EXHAUSTED
    assert "'c1'" in err.details() and "budget ε = 1" in err.details() and "nothing was recorded" in err.details()
    spend = stub.GetSpend(pb.GetSpendRequest(run_id="tight"), timeout=10)
    assert spend.rounds_recorded == 0 and list(spend.spends) == []


def test_conflicts(stub: privacy_pb2_grpc.PrivacyStub) -> None:
    stub.RegisterBudget(budget("conflict"), timeout=10)
    err = refused(stub.RegisterBudget, budget("conflict", eps=5.0))
    assert err.code() == Code.ALREADY_EXISTS and "new run_id" in err.details()
    stub.AuthorizeRound(pb.AuthorizeRoundRequest(run_id="conflict", round=0, events=events()), timeout=10)
    err = refused(stub.AuthorizeRound, pb.AuthorizeRoundRequest(run_id="conflict", round=0, events=events(steps=2)))
    assert err.code() == Code.ALREADY_EXISTS and "new round number" in err.details()
    assert stub.GetSpend(pb.GetSpendRequest(run_id="conflict"), timeout=10).spends[0].events == 2


def test_unknown_run(stub: privacy_pb2_grpc.PrivacyStub) -> None:
    for call, request in [
        (stub.AuthorizeRound, pb.AuthorizeRoundRequest(run_id="ghost", round=0, events=events())),
        (stub.GetSpend, pb.GetSpendRequest(run_id="ghost")),
        (stub.RemainingRounds, pb.RemainingRoundsRequest(run_id="ghost", per_round=events())),
    ]:
        err = refused(call, request)
        assert err.code() == Code.NOT_FOUND and "RegisterBudget" in err.details()


def test_non_private_run(stub: privacy_pb2_grpc.PrivacyStub) -> None:
    stub.RegisterBudget(budget("plain", eps=0, principal_kind=pb.PRINCIPAL_KIND_NONE), timeout=10)
    assert not stub.AuthorizeRound(pb.AuthorizeRoundRequest(run_id="plain", round=0), timeout=10).replayed
    assert stub.AuthorizeRound(pb.AuthorizeRoundRequest(run_id="plain", round=0), timeout=10).replayed
    spend = stub.GetSpend(pb.GetSpendRequest(run_id="plain"), timeout=10)
    assert (spend.rounds_recorded, spend.max_epsilon, len(spend.spends)) == (1, 0.0, 0)
    err = refused(stub.AuthorizeRound, pb.AuthorizeRoundRequest(run_id="plain", round=1, events=events()))
    assert err.code() == Code.INVALID_ARGUMENT and "without events" in err.details()
    err = refused(stub.RemainingRounds, pb.RemainingRoundsRequest(run_id="plain", per_round=events()))
    assert err.code() == Code.FAILED_PRECONDITION


def _event(**kw: object) -> pb.PrivacyEvent:
    fields = {
        "principal": "c0",
        "mechanism": pb.MECHANISM_GRADIENT,
        "sample_rate": 0.05,
        "noise_multiplier": 2.0,
        "count": 1,
        **kw,
    }
    return pb.PrivacyEvent(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("method", "request_", "field"),
    [
        ("RegisterBudget", budget(""), "run_id"),
        ("RegisterBudget", budget("b", eps=-1), "epsilon"),
        ("RegisterBudget", budget("b", eps=math.nan), "epsilon"),
        (
            "RegisterBudget",
            pb.RegisterBudgetRequest(run_id="b", epsilon=1, delta=1.5, principal_kind=pb.PRINCIPAL_KIND_CLIENT),
            "delta",
        ),
        ("RegisterBudget", budget("b", principal_kind=pb.PRINCIPAL_KIND_UNSPECIFIED), "principal_kind"),
        ("RegisterBudget", budget("b", accountant=7), "accountant"),
        ("RegisterBudget", budget("b", orders=[1.0]), "orders"),
        ("AuthorizeRound", pb.AuthorizeRoundRequest(run_id="", events=events()), "run_id"),
        ("AuthorizeRound", pb.AuthorizeRoundRequest(run_id="v", events=[_event(principal="")]), "events[0].principal"),
        ("AuthorizeRound", pb.AuthorizeRoundRequest(run_id="v", events=[_event(mechanism=0)]), "events[0].mechanism"),
        ("AuthorizeRound", pb.AuthorizeRoundRequest(run_id="v", events=[_event(sample_rate=0)]), "sample_rate"),
        ("AuthorizeRound", pb.AuthorizeRoundRequest(run_id="v", events=[_event(noise_multiplier=-2)]), "noise_mult"),
        ("AuthorizeRound", pb.AuthorizeRoundRequest(run_id="v", events=[_event(count=2**63)]), "events[0].count"),
        ("AuthorizeRound", pb.AuthorizeRoundRequest(run_id="v", events=[_event(), _event()]), "events[1] repeats"),
        ("GetSpend", pb.GetSpendRequest(run_id=""), "run_id"),
        ("RemainingRounds", pb.RemainingRoundsRequest(run_id="v"), "per_round"),
        ("RemainingRounds", pb.RemainingRoundsRequest(run_id="v", per_round=[_event(principal="")]), "principal"),
        ("CalibrateNoise", pb.CalibrateNoiseRequest(target_epsilon=1, delta=DELTA, sample_rate=2, steps=1), "sample"),
        ("CalibrateNoise", pb.CalibrateNoiseRequest(target_epsilon=1, delta=DELTA, sample_rate=0.1), "steps"),
        ("CalibrateNoise", pb.CalibrateNoiseRequest(target_epsilon=0, delta=DELTA, sample_rate=0.1, steps=1), "eps"),
        ("CalibrateNoise", pb.CalibrateNoiseRequest(target_epsilon=1, sample_rate=0.1, steps=1), "delta"),
    ],
)
def test_invalid_arguments_name_the_field(
    stub: privacy_pb2_grpc.PrivacyStub, method: str, request_: object, field: str
) -> None:
    stub.RegisterBudget(budget("v"), timeout=10)
    err = refused(getattr(stub, method), request_)
    assert err.code() == Code.INVALID_ARGUMENT, err.details()
    assert field in err.details()
    assert stub.GetSpend(pb.GetSpendRequest(run_id="v"), timeout=10).rounds_recorded == 0


# --- the sound range (issue #18): every numeric field, every RPC ------------------------------------------------------

SOUND = "the range the privacy accountant handles soundly"


def _authorize(**kw: object) -> pb.AuthorizeRoundRequest:
    return pb.AuthorizeRoundRequest(run_id="s", round=1, events=[_event(**kw)])


def _remaining(**kw: object) -> pb.RemainingRoundsRequest:
    return pb.RemainingRoundsRequest(run_id="s", principal="c0", per_round=[_event(principal="", **kw)])


def _calibrate(**kw: object) -> pb.CalibrateNoiseRequest:
    return pb.CalibrateNoiseRequest(**{"target_epsilon": 1.0, "delta": DELTA, "sample_rate": 0.05, "steps": 10, **kw})


UNACCOUNTABLE = {"sample_rate": 0.001, "noise_multiplier": 9000, "count": 11}  # in range, but ε = 0


@pytest.mark.parametrize(
    ("method", "request_", "phrase"),
    [
        # σ = 1e-156 used to be granted with ε = 0; 1e-300 and 1e300 ended in INTERNAL (ZeroDivision-, OverflowError).
        ("AuthorizeRound", _authorize(noise_multiplier=1e-156), "events[0].noise_multiplier must be in [0.3, 10000]"),
        ("AuthorizeRound", _authorize(noise_multiplier=1e-300), "events[0].noise_multiplier must be in [0.3, 10000]"),
        ("AuthorizeRound", _authorize(noise_multiplier=1e300), "events[0].noise_multiplier must be in [0.3, 10000]"),
        ("AuthorizeRound", _authorize(noise_multiplier=math.nan), "events[0].noise_multiplier must be finite"),
        ("AuthorizeRound", _authorize(noise_multiplier=-math.inf), "events[0].noise_multiplier must be finite"),
        ("AuthorizeRound", _authorize(sample_rate=1e-300), "events[0].sample_rate must be in [1e-06, 1]"),
        ("AuthorizeRound", _authorize(sample_rate=math.inf), "events[0].sample_rate must be finite"),
        ("AuthorizeRound", _authorize(count=10**6 + 1), "events[0].count must be at most 1000000"),
        ("AuthorizeRound", _authorize(**UNACCOUNTABLE), "gives ε = 0.0"),
        ("RegisterBudget", budget("s2", eps=1e300), "epsilon must be in [0.001, 100]"),
        ("RegisterBudget", budget("s2", eps=-math.inf), "epsilon must be finite"),
        ("RegisterBudget", budget("s2", delta=1e-300), "delta must be in [1e-12, 0.01]"),
        ("RegisterBudget", budget("s2", orders=[2.0, 1e300]), "orders must all be at most 10000"),
        ("RegisterBudget", budget("s2", orders=[math.nan]), "orders must be finite"),
        ("RegisterBudget", budget("s2", orders=[2.0] * 1000), "orders must hold at most 256"),
        ("RegisterBudget", budget("s2", eps=1e300, principal_kind=pb.PRINCIPAL_KIND_NONE), "of a non-private run"),
        ("RemainingRounds", _remaining(noise_multiplier=1e-156), "per_round[0].noise_multiplier must be in [0.3"),
        ("RemainingRounds", _remaining(sample_rate=math.nan), "per_round[0].sample_rate must be finite"),
        ("RemainingRounds", _remaining(count=2**64 - 1), "per_round[0].count must be at most 1000000"),
        ("RemainingRounds", _remaining(**UNACCOUNTABLE), "gives ε = 0.0"),
        ("CalibrateNoise", _calibrate(target_epsilon=1e300), "target_epsilon must be in [0.001, 100]"),
        ("CalibrateNoise", _calibrate(target_epsilon=math.nan), "target_epsilon must be finite"),
        ("CalibrateNoise", _calibrate(delta=math.inf), "delta must be finite"),
        ("CalibrateNoise", _calibrate(sample_rate=1e-300), "sample_rate must be in [1e-06, 1]"),
        ("CalibrateNoise", _calibrate(steps=2**64 - 1), "steps must be at most 1000000"),
        ("CalibrateNoise", _calibrate(target_epsilon=1e-3, sample_rate=1.0, steps=10**6), "no noise multiplier"),
    ],
)
def test_hostile_numbers_are_invalid_arguments_and_change_nothing(
    stub: privacy_pb2_grpc.PrivacyStub, method: str, request_: object, phrase: str
) -> None:
    stub.RegisterBudget(budget("s"), timeout=10)
    stub.AuthorizeRound(pb.AuthorizeRoundRequest(run_id="s", round=0, events=events()), timeout=10)
    before = stub.GetSpend(pb.GetSpendRequest(run_id="s"), timeout=10)
    err = refused(getattr(stub, method), request_)
    assert err.code() == Code.INVALID_ARGUMENT, err.details()
    assert phrase in err.details()
    if "must be in [" in phrase:
        assert SOUND in err.details()
    assert stub.GetSpend(pb.GetSpendRequest(run_id="s"), timeout=10) == before
    assert refused(stub.GetSpend, pb.GetSpendRequest(run_id="s2")).code() == Code.NOT_FOUND  # no budget was stored


def test_unaccountable_recorded_history_is_a_failed_precondition() -> None:
    """A ledger file recorded before the range was enforced: GetSpend says so instead of stating ε = 0 or failing
    with INTERNAL."""
    ledger = InMemoryLedger()
    ledger.register_budget(Budget("old", 1.0, DELTA))
    ledger._db.execute("INSERT INTO totals VALUES ('old', 'c0', 0.05, 1e-156, 1, 1)")

    def register(server: grpc.Server) -> list[str]:
        privacy_pb2_grpc.add_PrivacyServicer_to_server(PrivacyServicer(ledger), server)
        return [SERVICE_NAME]

    running = start_server("127.0.0.1:0", register, max_workers=2)
    try:
        with open_channel(f"127.0.0.1:{running.port}") as channel:
            err = refused(privacy_pb2_grpc.PrivacyStub(channel).GetSpend, pb.GetSpendRequest(run_id="old"))
    finally:
        running.stop(0)
        ledger.close()
    assert err.code() == Code.FAILED_PRECONDITION and "recorded events cannot be accounted" in err.details()
