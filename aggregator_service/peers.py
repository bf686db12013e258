"""How the engine reaches selection and privacy accounting: over gRPC (the services) or in-process (same code)."""

from __future__ import annotations

import grpc

from clustering_service import SelectionInput, StateStore, select
from fairfl.config import ExperimentConfig
from fairfl.rpc import SHORT_DEADLINE, open_channel
from fairfl.v1 import clustering_pb2, clustering_pb2_grpc, privacy_pb2, privacy_pb2_grpc

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


class RemotePrivacy:
    """The privacy service's ledger. Non-private runs are registered too, so every round leaves an audit record."""

    def __init__(self, address: str) -> None:
        self.channel = open_channel(address)
        self.stub = privacy_pb2_grpc.PrivacyStub(self.channel)

    def start(self, run_id: str, config: ExperimentConfig) -> None:
        self.stub.RegisterBudget(_budget_request(run_id, config), timeout=SHORT_DEADLINE, wait_for_ready=True)

    def authorize_round(self, run_id: str, round_number: int, config: ExperimentConfig) -> float:
        try:
            reply = self.stub.AuthorizeRound(
                privacy_pb2.AuthorizeRoundRequest(run_id=run_id, round=round_number),
                timeout=SHORT_DEADLINE,
                wait_for_ready=True,
            )
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                from aggregator_service.engine import RunStopped

                raise RunStopped(f"privacy budget exhausted: {err.details()}") from err
            raise
        return reply.max_epsilon


class LocalPrivacy:
    """The same ledger code in-process, in memory."""

    def __init__(self) -> None:
        from privacy_service.ledger import SqliteLedger

        self.ledger = SqliteLedger(":memory:")

    def start(self, run_id: str, config: ExperimentConfig) -> None:
        from privacy_service.ledger import Budget

        req = _budget_request(run_id, config)
        self.ledger.register_budget(Budget(run_id=run_id, epsilon=req.epsilon, delta=req.delta, principal_kind="none"))

    def authorize_round(self, run_id: str, round_number: int, config: ExperimentConfig) -> float:
        return self.ledger.authorize_round(run_id, round_number, []).max_epsilon


def _budget_request(run_id: str, config: ExperimentConfig) -> privacy_pb2.RegisterBudgetRequest:
    del config  # DP runs arrive with the privacy issue; until then every run is registered as non-private
    return privacy_pb2.RegisterBudgetRequest(
        run_id=run_id,
        epsilon=0.0,
        delta=0.0,
        accountant=privacy_pb2.ACCOUNTANT_RDP,
        principal_kind=privacy_pb2.PRINCIPAL_KIND_NONE,
    )
