"""gRPC front of the privacy ledger: translate messages, validate, and map refusals to actionable statuses."""

from __future__ import annotations

import functools
import logging
import math
import sqlite3
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from fairfl import accounting as acc
from fairfl.rpc_refusals import abort
from fairfl.telemetry import DEFAULT_CLIENT_LIMIT
from fairfl.v1 import privacy_pb2 as pb
from fairfl.v1 import privacy_pb2_grpc
from privacy_service.ledger import (
    Budget,
    BudgetConflict,
    BudgetExceeded,
    Event,
    Ledger,
    LedgerError,
    NotPrivateRun,
    RoundConflict,
    UnaccountableRun,
    UnknownRun,
)
from privacy_service.monitoring import PrivacyMetrics

log = logging.getLogger(__name__)

SERVICE_NAME = "fairfl.v1.Privacy"

_ACCOUNTANTS = {pb.ACCOUNTANT_UNSPECIFIED: "rdp", pb.ACCOUNTANT_RDP: "rdp", pb.ACCOUNTANT_PLD: "pld"}
_ACCOUNTANT_ENUM = {"rdp": pb.ACCOUNTANT_RDP, "pld": pb.ACCOUNTANT_PLD}
_KINDS = {
    pb.PRINCIPAL_KIND_CLIENT: "client",
    pb.PRINCIPAL_KIND_FEDERATION: "federation",
    pb.PRINCIPAL_KIND_NONE: "none",
}
_KIND_ENUM = {v: k for k, v in _KINDS.items()}
_MECHANISMS = {
    pb.MECHANISM_GRADIENT: "gradient",
    pb.MECHANISM_LOSS: "loss",
    pb.MECHANISM_JOINT: "joint",
    pb.MECHANISM_MODEL: "model",
}

# Order matters: the first matching class wins.
_STATUS: list[tuple[type[Exception], grpc.StatusCode]] = [
    (UnknownRun, grpc.StatusCode.NOT_FOUND),
    (BudgetExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (BudgetConflict, grpc.StatusCode.ALREADY_EXISTS),
    (RoundConflict, grpc.StatusCode.ALREADY_EXISTS),
    (NotPrivateRun, grpc.StatusCode.FAILED_PRECONDITION),
    (UnaccountableRun, grpc.StatusCode.FAILED_PRECONDITION),
    # Out-of-range fields, and events the accountant cannot account (acc.UnsoundAccounting: its numerics failing, ε = 0,
    # RDP and PLD disagreeing): the request's values are the cause, and nothing was recorded.
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (ArithmeticError, grpc.StatusCode.INVALID_ARGUMENT),
]

F = TypeVar("F", bound=Callable[..., Any])


def _statuses(method: F) -> F:
    """Turn the ledger's refusals into gRPC statuses; anything unexpected becomes INTERNAL, never a crash."""

    @functools.wraps(method)
    def wrapper(self: PrivacyServicer, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except (LedgerError, ValueError, ArithmeticError) as err:
            code = next(c for cls, c in _STATUS if isinstance(err, cls))
            log.info("%s refused (%s): %s", method.__name__, code.name, err)
            message = str(err)
            if isinstance(err, ArithmeticError):  # escaped the accountant's own mapping: still the inputs' fault
                message = (
                    f"privacy accounting failed numerically ({type(err).__name__}: {err}); nothing was recorded: keep "
                    "noise multipliers, sample rates and counts within the accountant's sound range (docs/security.md)"
                )
            abort(context, code, message)
        except sqlite3.OperationalError as err:  # locked or unreachable ledger file: transient, and rolled back
            log.warning("%s: ledger unavailable: %s", method.__name__, err)
            abort(
                context, grpc.StatusCode.UNAVAILABLE, f"privacy ledger unavailable ({err}); nothing was recorded, retry"
            )
        except Exception as err:
            log.exception("%s failed", method.__name__)
            abort(
                context,
                grpc.StatusCode.INTERNAL,
                f"privacy service error ({type(err).__name__}: {err}); "
                "no partial round was recorded and every call is safe to retry",
            )

    return wrapper  # type: ignore[return-value]


def _accountant(value: int, name: str = "accountant") -> str:
    if value not in _ACCOUNTANTS:
        raise ValueError(f"{name} has unknown value {value}; use ACCOUNTANT_RDP or ACCOUNTANT_PLD")
    return _ACCOUNTANTS[value]


def _events(messages: Any, name: str) -> list[Event]:
    events = []
    for i, m in enumerate(messages):
        if m.mechanism not in _MECHANISMS:
            raise ValueError(
                f"{name}[{i}].mechanism must be set (MECHANISM_GRADIENT, MECHANISM_LOSS, MECHANISM_JOINT or "
                f"MECHANISM_MODEL), got {m.mechanism}"
            )
        events.append(Event(m.principal, _MECHANISMS[m.mechanism], m.sample_rate, m.noise_multiplier, m.count))
    return events


def _run_id(run_id: str) -> str:
    if not run_id:
        raise ValueError("run_id must be set")
    return run_id


def _status(budget: Budget) -> pb.BudgetStatus:
    return pb.BudgetStatus(
        run_id=budget.run_id,
        epsilon=budget.epsilon,
        delta=budget.delta,
        accountant=_ACCOUNTANT_ENUM[budget.accountant],
        principal_kind=_KIND_ENUM[budget.principal_kind],
    )


class PrivacyServicer(privacy_pb2_grpc.PrivacyServicer):
    """Thin servicer over a Ledger; all state and enforcement live in the ledger."""

    def __init__(self, ledger: Ledger, client_limit: int = DEFAULT_CLIENT_LIMIT) -> None:
        self.ledger = ledger
        self.metrics = PrivacyMetrics(ledger, client_limit)

    @_statuses
    def RegisterBudget(self, request: pb.RegisterBudgetRequest, context: grpc.ServicerContext) -> pb.BudgetStatus:
        if request.principal_kind not in _KINDS:
            raise ValueError(
                "principal_kind must be set: PRINCIPAL_KIND_CLIENT (record-level DP per client), "
                "PRINCIPAL_KIND_FEDERATION (client-level DP) or PRINCIPAL_KIND_NONE (non-private run)"
            )
        budget = Budget(
            run_id=_run_id(request.run_id),
            epsilon=request.epsilon,
            delta=request.delta,
            accountant=_accountant(request.accountant),
            principal_kind=_KINDS[request.principal_kind],
            orders=tuple(request.orders) or None,
        )
        stored, created = self.ledger.register_budget(budget)
        self.metrics.budget(stored)
        log.info("budget %s for run %r: %s", "registered" if created else "re-sent", stored.run_id, stored)
        return _status(stored)

    @_statuses
    def AuthorizeRound(
        self, request: pb.AuthorizeRoundRequest, context: grpc.ServicerContext
    ) -> pb.AuthorizeRoundReply:
        run_id, events = _run_id(request.run_id), _events(request.events, "events")
        try:
            result = self.ledger.authorize_round(run_id, request.round, events)
        except BudgetExceeded:
            self.metrics.refused()
            raise
        self.metrics.authorized(run_id, result, events)
        return pb.AuthorizeRoundReply(granted=True, replayed=result.replayed, max_epsilon=result.max_epsilon)

    @_statuses
    def GetSpend(self, request: pb.GetSpendRequest, context: grpc.ServicerContext) -> pb.GetSpendReply:
        run_id = _run_id(request.run_id)
        budget = self.ledger.get_budget(run_id)
        spends = self.ledger.spend(run_id, request.principal or None)
        return pb.GetSpendReply(
            run_id=run_id,
            delta=budget.delta,
            target_epsilon=budget.epsilon,
            spends=[
                pb.PrincipalSpend(
                    principal=s.principal, epsilon=s.epsilon, optimal_order=s.optimal_order, events=s.n_events
                )
                for s in spends
            ],
            max_epsilon=max((s.epsilon for s in spends), default=0.0),
            rounds_recorded=self.ledger.rounds_recorded(run_id),
        )

    @_statuses
    def RemainingRounds(
        self, request: pb.RemainingRoundsRequest, context: grpc.ServicerContext
    ) -> pb.RemainingRoundsReply:
        rounds = self.ledger.remaining_rounds(
            _run_id(request.run_id), _events(request.per_round, "per_round"), request.principal or None
        )
        return pb.RemainingRoundsReply(rounds=rounds)

    @_statuses
    def CalibrateNoise(
        self, request: pb.CalibrateNoiseRequest, context: grpc.ServicerContext
    ) -> pb.CalibrateNoiseReply:
        accountant = _accountant(request.accountant)
        sigma = acc.calibrate_noise(
            request.target_epsilon, request.delta, request.sample_rate, request.steps, accountant
        )
        eps, _ = acc.epsilon([acc.EventSpec(request.sample_rate, sigma, request.steps)], request.delta, accountant)
        if not math.isfinite(eps):  # cannot happen for a calibrated σ; guard the reply anyway
            raise ValueError("calibration failed to reach a finite epsilon")
        return pb.CalibrateNoiseReply(noise_multiplier=sigma, epsilon=eps)
