"""How the engine reaches selection and privacy accounting over gRPC (the services). In-process selection runs the
clustering service's code directly and lives in the composition layer (fairfl.compose.local_selection)."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from aggregator_service.dp import round_events, run_budget
from aggregator_service.selection import SelectionContext, select_request
from fairfl.config import ConfigError, ExperimentConfig
from fairfl.rpc import SHORT_DEADLINE
from fairfl.rpc_channel import open_channel
from fairfl.rpc_refusals import refused_as_busy
from fairfl.sampling import SelectionOutput
from fairfl.v1 import clustering_pb2, clustering_pb2_grpc, privacy_pb2, privacy_pb2_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")
# Selection and signature reports are idempotent per round: retried through a clustering-service restart this long.
PEER_RETRY_S = 120.0


class RemoteSelector:
    """The clustering service's samplers. Select and ReportSignatures are idempotent per round, so calls are retried
    through a service restart for PEER_RETRY_S. The service keeps signatures in memory and names its store in every
    reply (instance_id): this peer keeps the latest signature of every client it reported, and when a reply comes
    from a store other than the one it filled (the service restarted), it re-sends them and repeats the call. The
    cache is part of the aggregator's checkpoint."""

    def __init__(self, address: str, method: str, retry_s: float = PEER_RETRY_S) -> None:
        self.method = method  # selection.method: a sampler name or module:attr, resolved by the service
        self.address = address
        self.channel = open_channel(address)
        self.stub = clustering_pb2_grpc.ClusteringStub(self.channel)
        self.retry_s = retry_s
        self.signatures: dict[tuple[str, int], clustering_pb2.ClientSignature] = {}  # (run, client) -> latest
        self._lock = threading.Lock()
        self._synced: dict[str, str] = {}  # run id -> instance_id of the store that holds its signatures

    def _call(self, method: Callable[..., T], request: object) -> T:
        return call_with_retry(method, request, self.retry_s, f"clustering service at {self.address}")

    def _in_sync(self, run_id: str, instance_id: str) -> bool:
        """Whether the store that answered holds this run's signatures; if not, re-send them (False: call again)."""
        with self._lock:
            cached = [sig for (run, _), sig in sorted(self.signatures.items()) if run == run_id]
            if not cached or self._synced.get(run_id) == instance_id:
                self._synced[run_id] = instance_id
                return True
        log.info(
            "clustering service %s restarted: re-reporting %d signatures of run %s", self.address, len(cached), run_id
        )
        request = clustering_pb2.ReportSignaturesRequest(run_id=run_id, signatures=cached)
        reply = self._call(self.stub.ReportSignatures, request)
        with self._lock:
            self._synced[run_id] = reply.instance_id
        return False

    def report_signatures(self, run_id: str, signatures: Sequence[clustering_pb2.ClientSignature]) -> None:
        """Store clients' signatures in the service (and in this peer's cache, newest round per client)."""
        with self._lock:
            fresh = run_id not in self._synced and not any(run == run_id for run, _ in self.signatures)
            for sig in signatures:
                old = self.signatures.get((run_id, sig.client_id))
                if old is None or sig.round >= old.round:
                    self.signatures[(run_id, sig.client_id)] = sig
        request = clustering_pb2.ReportSignaturesRequest(run_id=run_id, signatures=list(signatures))
        reply = self._call(self.stub.ReportSignatures, request)
        if fresh:  # the run's first report: the store that answered holds everything cached for it
            with self._lock:
                self._synced[run_id] = reply.instance_id
        else:
            self._in_sync(run_id, reply.instance_id)  # re-sends the whole cache (these included) to a new store

    def select(self, context: SelectionContext) -> SelectionOutput:
        request = select_request(self.method, context)
        reply = self._call(self.stub.Select, request)
        if not self._in_sync(context.run_id, reply.instance_id):
            reply = self._call(self.stub.Select, request)  # the same request on the refilled store
        return SelectionOutput(
            selected=tuple(reply.selected),
            cluster_of_selected=tuple(reply.cluster_of_selected),
            seconds=reply.selection_seconds,
            needs_losses=reply.needs_losses,
        )

    def state_dict(self) -> dict[str, Any]:
        """The signature cache as (run id, serialised ClientSignature bytes) pairs."""
        with self._lock:
            return {
                "signatures": [
                    [run, np.frombuffer(sig.SerializeToString(), dtype=np.uint8).copy()]
                    for (run, _), sig in sorted(self.signatures.items())
                ]
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A restarted aggregator's cache; re-sent before the next call, as the service may have restarted too."""
        with self._lock:
            for run, raw in state.get("signatures", []):
                sig = clustering_pb2.ClientSignature.FromString(np.asarray(raw, dtype=np.uint8).tobytes())
                self.signatures[(str(run), sig.client_id)] = sig
            self._synced.clear()  # the service may have restarted too: its first reply decides

    def close(self) -> None:
        self.channel.close()


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


def call_with_retry(method: Callable[..., T], request: object, retry_s: float, peer: str) -> T:
    """An idempotent unary call, retried with jittered exponential backoff while the peer is down, restarting or
    busy (fairfl.rpc_refusals.refused_as_busy)."""
    deadline = time.monotonic() + retry_s
    backoff = 0.2
    while True:
        try:
            return method(request, timeout=SHORT_DEADLINE, wait_for_ready=True)
        except grpc.RpcError as err:
            pause = backoff * random.uniform(0.5, 1.0)
            retryable = err.code() in _RETRYABLE or refused_as_busy(err)
            if not retryable or time.monotonic() + pause > deadline:
                raise
            log.warning("%s: %s (%s); retrying in %.1fs", peer, err.code().name, err.details(), pause)
            time.sleep(pause)
            backoff = min(backoff * 2, 5.0)


def budget_exhausted(details: str) -> Exception:
    from aggregator_service.engine import RunStopped

    return RunStopped(f"privacy budget exhausted: {details}")


def _privacy_refusal(err: grpc.RpcError, call: str) -> Exception:
    """What a run makes of the privacy service's refusal: a spent budget stops it; anything else fails it with the
    service's own words (a config the ledger cannot account, say), not a gRPC error's repr."""
    from aggregator_service.engine import RunRefused

    if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not refused_as_busy(err):
        return budget_exhausted(err.details())
    return RunRefused(f"the privacy service refused {call} ({err.code().name}): {err.details()}")


class RemotePrivacy:
    """The privacy service's ledger. Non-private runs are registered too, so every round leaves an audit record.

    A private round's events are recorded before its tasks are dispatched, a non-private round's (no events) while it
    trains and before it is reported (RoundEngine._authorize); RESOURCE_EXHAUSTED stops the run cleanly. Calls
    that fail because the service is down or restarting are retried (they are idempotent) for PRIVACY_RETRY_S.
    """

    def __init__(self, address: str, retry_s: float = PRIVACY_RETRY_S) -> None:
        self.channel = open_channel(address)
        self.stub = privacy_pb2_grpc.PrivacyStub(self.channel)
        self.retry_s = retry_s

    def _call(self, method: Callable[..., T], request: object) -> T:
        return call_with_retry(method, request, self.retry_s, "privacy service")

    def close(self) -> None:
        self.channel.close()

    def start(self, run_id: str, config: ExperimentConfig) -> None:
        try:
            self._call(self.stub.RegisterBudget, _budget_request(run_id, config))
        except grpc.RpcError as err:
            raise _privacy_refusal(err, "the run's budget") from err

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
            raise _privacy_refusal(err, f"round {round_number}") from err
        if reply.replayed:
            log.info("round %d of run %s was already recorded (a retried call); nothing added", round_number, run_id)
        return reply.max_epsilon


class NoLedger:
    """The privacy gate of an aggregator started without a privacy service (no --privacy): it runs non-private runs
    only, with nothing to account, and refuses a DP run before round 1. The in-memory ledger of in-process runs is
    the composition layer's (fairfl.compose.local_privacy), since only it may use the privacy service's code."""

    def start(self, run_id: str, config: ExperimentConfig) -> None:
        del run_id
        if config.privacy.enabled:
            raise ConfigError(
                "privacy.enabled: this aggregator has no privacy service to account the run's spend; start it with "
                "--privacy ADDRESS (FAIRFL_PRIVACY_ADDRESS), as `fairfl run` and deploy/k8s do"
            )

    def authorize_round(
        self, run_id: str, round_number: int, config: ExperimentConfig, selected: list[int], population: int
    ) -> float:
        del run_id, round_number, config, selected, population
        return 0.0


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
