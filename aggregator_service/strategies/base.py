"""The strategy interface: a strategy plans each round's phases and turns the clients' results into a new model.

The round engine owns selection, transport, deadlines, privacy and evaluation; a strategy owns only the algorithm,
so FedAvg, FedEBA+ (two phases per round) and the fairness baselines plug into the same loop and the same
transports. Strategy state (momentum buffers, dual variables) is exposed through state_dict for checkpoints.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from aggregator_service.strategies.fold import ResultFold
from fairfl.protocol import TRAIN, ClientResult
from fairfl.v1 import clustering_pb2, federation_pb2, tensor_pb2


@dataclass
class RoundContext:
    run_id: str
    round: int
    params: torch.Tensor  # global model x_t, flat float32
    selected: list[int]
    train_config: federation_pb2.LocalTrainingConfig  # the run's local config for this round (lr decay applied)
    publish: Callable[[torch.Tensor], tensor_pb2.BlobRef]  # make a flat tensor fetchable by clients
    seed: int = 0  # the run seed; strategies derive their own randomness from it and the round
    num_clients: int = 0  # the run's data.num_clients (0 = unknown)
    true_groups: dict[int, int] | None = None  # ground-truth group per client id (grouped partitions), else None
    # The clustering service's Cluster call (gRPC, or the same code in-process); None when the engine has none.
    cluster: Callable[[clustering_pb2.ClusterRequest], clustering_pb2.ClusterReply] | None = None
    # Streaming aggregation: the folds the engine fed each phase's results into as they arrived (by phase index); a
    # phase without an entry kept its results whole (see Strategy.folds and phase_folds).
    folds: dict[int, list[ResultFold]] = field(default_factory=dict)


@dataclass
class PhasePlan:
    """One exchange with the selected clients."""

    phase: int  # PHASE_TRAIN or PHASE_PROBE
    train: federation_pb2.LocalTrainingConfig | None = None
    probe: federation_pb2.ProbeConfig | None = None
    clients: list[int] | None = None  # default: the round's selected clients


@dataclass
class AggregateOutcome:
    params: torch.Tensor
    weights: dict[int, float] = field(default_factory=dict)  # aggregation weight per client
    metrics: dict[str, float] = field(default_factory=dict)
    clusters: dict[int, int] = field(default_factory=dict)  # found cluster per client, when the strategy clusters


@dataclass
class NoParams:
    pass


def measures_client_losses(strategy: Strategy | type[Strategy], loss_telemetry: bool) -> bool:
    """Whether non-DP TRAIN tasks measure F_i before and after training: the strategy reads them, or
    training.loss_telemetry asks for them anyway."""
    return strategy.reads_client_losses or loss_telemetry


class Strategy(ABC):
    name: ClassVar[str]
    Params: ClassVar[type] = NoParams
    # Whether aggregate() reads the clients' F_i (loss_before, loss_after, accuracy_before). If not, agents skip the two
    # forward passes that measure them unless training.loss_telemetry asks for them; Ψ telemetry is then not reported.
    reads_client_losses: ClassVar[bool] = True

    def __init__(self, params: Any, server_lr: float) -> None:
        self.params = params
        self.server_lr = server_lr

    def configure(self, ctx: RoundContext, phase_index: int, prior: Sequence[list[ClientResult]]) -> PhasePlan | None:
        """The plan of phase `phase_index`, given the results of earlier phases; None ends the round's exchanges."""
        if phase_index == 0:
            return PhasePlan(phase=TRAIN, train=ctx.train_config)
        return None

    def folds(self, ctx: RoundContext, phase_index: int, plan: PhasePlan) -> list[ResultFold]:
        """Folds that take phase `phase_index`'s results as they arrive, so the aggregator holds one accumulator
        instead of every client's tensors (streaming aggregation, aggregator_service/strategies/fold.py). [] (the
        default) keeps the results whole for `aggregate`: strategies whose weights need every update at once."""
        del ctx, phase_index, plan
        return []

    @abstractmethod
    def aggregate(self, ctx: RoundContext, phases: Sequence[list[ClientResult]]) -> AggregateOutcome:
        """New global parameters from the results of every phase (each list sorted by client id)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


def weighted_sum(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Σ w_i v_i folded one vector at a time: memory independent of the client count, and the result does not depend
    on BLAS threading, so every process computes bit-identical aggregates."""
    out = torch.zeros_like(vectors[0], dtype=torch.float32)
    for vector, weight in zip(vectors, weights, strict=True):
        out.add_(vector, alpha=float(weight))
    return out


def train_phase(phases: Sequence[list[ClientResult]]) -> int:
    """Index of the last training phase (-1 if none)."""
    for index in range(len(phases) - 1, -1, -1):
        if phases[index] and phases[index][0].phase == TRAIN:
            return index
    return -1


def train_results(phases: Sequence[list[ClientResult]]) -> list[ClientResult]:
    """The results of the last training phase (their UPDATE may have been folded away already: see phase_folds)."""
    index = train_phase(phases)
    return list(phases[index]) if index >= 0 else []


def phase_folds(
    ctx: RoundContext, phases: Sequence[list[ClientResult]], index: int, make: Callable[[], list[ResultFold]]
) -> list[ResultFold]:
    """The folds of phase `index`: those the engine streamed its results into, or `make()` filled now from the kept
    results. The sums are order-independent, so both give the same bits."""
    folds = ctx.folds.get(index)
    if folds is None:
        folds = make()
        for fold in folds:
            fold.fill(phases[index])
    return folds


def params_from_dict(cls: type, raw: dict[str, Any], path: str) -> Any:
    """Build a strategy's Params dataclass from config, naming unknown or mistyped fields."""
    from fairfl.config import ConfigError

    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        valid = ", ".join(fields) or "none"
        raise ConfigError(f"{path}.params: unknown parameter {unknown[0]!r}; valid parameters: {valid}")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        default = getattr(cls(), key)
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ConfigError(f"{path}.params.{key}: expected true or false, got {value!r}")
        elif isinstance(default, int | float):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{path}.params.{key}: expected a number, got {value!r}")
            value = type(default)(value) if isinstance(default, float) else value
        values[key] = value
    params = cls(**values)
    check = getattr(params, "validate", None)
    if check is not None:
        check(f"{path}.params")
    return params
