"""How the engine reaches selection and privacy accounting: over gRPC (the services) or in-process (same code)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from aggregator_service.dp import round_events, run_budget
from clustering_service import SelectionInput, StateStore, select
from fairfl.config import ExperimentConfig
from fairfl.rpc import SHORT_DEADLINE, open_channel
from fairfl.v1 import clustering_pb2, clustering_pb2_grpc, privacy_pb2, privacy_pb2_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")

_METHODS = {"random": clustering_pb2.SELECTION_METHOD_RANDOM, "full": clustering_pb2.SELECTION_METHOD_FULL}


class LocalSelector:
    def __init__(self, method: str) -> None:
        self.method = _METHODS[method]
        self.store = StateStore()

    def select(self, run_id: str, round_number: int, candidates: list[int], count: int, seed: int) -> list[int]:
        request = SelectionInput(
            run_id=run_id, round=round_number, num_to_select=count, candidates=candidates, seed=seed
        )
        return list(select(self.method, request, self.store.run(run_id)).selected)


class RemoteSelector:
    def __init__(self, address: str, method: str) -> None:
        self.method = _METHODS[method]
        self.channel = open_channel(address)
        self.stub = clustering_pb2_grpc.ClusteringStub(self.channel)

    def select(self, run_id: str, round_number: int, candidates: list[int], count: int, seed: int) -> list[int]:
        reply = self.stub.Select(
            clustering_pb2.SelectRequest(
                run_id=run_id,
                round=round_number,
                num_to_select=count,
                candidates=candidates,
                method=self.method,
                seed=seed,
            ),
            timeout=SHORT_DEADLINE,
            wait_for_ready=True,
        )
        return list(reply.selected)


_MECHANISM_ENUM = {
    "gradient": privacy_pb2.MECHANISM_GRADIENT,
    "loss": privacy_pb2.MECHANISM_LOSS,
    "joint": privacy_pb2.MECHANISM_JOINT,
    "model": privacy_pb2.MECHANISM_MODEL,
}
_KIND_ENUM = {
    "client": privacy_pb2.PRINCIPAL_KIND_CLIENT,
    "federation": privacy_pb2.PRINCIPAL_KIND_FEDERATION,
    "none": privacy_pb2.PRINCIPAL_KIND_NONE,
}
_ACCOUNTANT_ENUM = {"rdp": privacy_pb2.ACCOUNTANT_RDP, "pld": privacy_pb2.ACCOUNTANT_PLD}
# Ledger calls are idempotent (a budget re-sent identically, a round replayed with the same events), so the gate
# retries through a privacy-service restart for this long before the run fails.
PRIVACY_RETRY_S = 120.0
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _budget_exhausted(details: str) -> Exception:
    from aggregator_service.engine import RunStopped

    return RunStopped(f"privacy budget exhausted: {details}")


class RemotePrivacy:
    """The privacy service's ledger. Non-private runs are registered too, so every round leaves an audit record.

    A round's events are recorded before its tasks are dispatched; RESOURCE_EXHAUSTED stops the run cleanly. Calls
    that fail because the service is down or restarting are retried (they are idempotent) for PRIVACY_RETRY_S.
    """

    def __init__(self, address: str, retry_s: float = PRIVACY_RETRY_S) -> None:
        self.channel = open_channel(address)
        self.stub = privacy_pb2_grpc.PrivacyStub(self.channel)
        self.retry_s = retry_s

    def _call(self, method: Callable[..., T], request: object) -> T:
        deadline = time.monotonic() + self.retry_s
        backoff = 0.2
        while True:
            try:
                return method(request, timeout=SHORT_DEADLINE, wait_for_ready=True)
            except grpc.RpcError as err:
                if err.code() not in _RETRYABLE or time.monotonic() + backoff > deadline:
                    raise
                log.warning("privacy service %s (%s); retrying in %.1fs", err.code().name, err.details(), backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def start(self, run_id: str, config: ExperimentConfig) -> None:
        self._call(self.stub.RegisterBudget, _budget_request(run_id, config))

    def authorize_round(
        self, run_id: str, round_number: int, config: ExperimentConfig, selected: list[int], population: int
    ) -> float:
        events = [
            privacy_pb2.PrivacyEvent(
                principal=e.principal,
                mechanism=_MECHANISM_ENUM[e.mechanism],  # type: ignore[arg-type]
                sample_rate=e.sample_rate,
                noise_multiplier=e.noise_multiplier,
                count=e.count,
            )
            for e in round_events(config, selected, population)
        ]
        request = privacy_pb2.AuthorizeRoundRequest(run_id=run_id, round=round_number, events=events)
        try:
            reply = self._call(self.stub.AuthorizeRound, request)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise _budget_exhausted(err.details()) from err
            raise
        if reply.replayed:
            log.info("round %d of run %s was already recorded (a retried call); nothing added", round_number, run_id)
        return reply.max_epsilon


class LocalPrivacy:
    """The same ledger code in-process, in memory."""

    def __init__(self) -> None:
        from privacy_service.ledger import SqliteLedger

        self.ledger = SqliteLedger(":memory:")

    def start(self, run_id: str, config: ExperimentConfig) -> None:
        self.ledger.register_budget(run_budget(run_id, config))

    def authorize_round(
        self, run_id: str, round_number: int, config: ExperimentConfig, selected: list[int], population: int
    ) -> float:
        from privacy_service.ledger import BudgetExceeded

        try:
            events = round_events(config, selected, population)
            return self.ledger.authorize_round(run_id, round_number, events).max_epsilon
        except BudgetExceeded as err:
            raise _budget_exhausted(str(err)) from err


def _budget_request(run_id: str, config: ExperimentConfig) -> privacy_pb2.RegisterBudgetRequest:
    budget = run_budget(run_id, config)
    return privacy_pb2.RegisterBudgetRequest(
        run_id=run_id,
        epsilon=budget.epsilon,
        delta=budget.delta,
        accountant=_ACCOUNTANT_ENUM[budget.accountant],  # type: ignore[arg-type]
        principal_kind=_KIND_ENUM[budget.principal_kind],  # type: ignore[arg-type]
        orders=list(budget.orders or ()),
    )
