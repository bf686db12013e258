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

from fairfl.protocol import TRAIN, UPDATE, ClientResult
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


class Strategy(ABC):
    name: ClassVar[str]
    Params: ClassVar[type] = NoParams

    def __init__(self, params: Any, server_lr: float) -> None:
        self.params = params
        self.server_lr = server_lr

    def configure(self, ctx: RoundContext, phase_index: int, prior: Sequence[list[ClientResult]]) -> PhasePlan | None:
        """The plan of phase `phase_index`, given the results of earlier phases; None ends the round's exchanges."""
        if phase_index == 0:
            return PhasePlan(phase=TRAIN, train=ctx.train_config)
        return None

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


def train_results(phases: Sequence[list[ClientResult]]) -> list[ClientResult]:
    """The results of the last training phase, with an UPDATE each."""
    for results in reversed(phases):
        if results and results[0].phase == TRAIN:
            return [r for r in results if UPDATE in r.payloads]
    return []


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
