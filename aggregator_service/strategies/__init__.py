"""Aggregation strategies, one file each, selected by name in the experiment config."""

from __future__ import annotations

from typing import Any

from aggregator_service.strategies.afl import AFL
from aggregator_service.strategies.base import AggregateOutcome, PhasePlan, RoundContext, Strategy, params_from_dict
from aggregator_service.strategies.cluster2 import Cluster2
from aggregator_service.strategies.equitable import Equitable
from aggregator_service.strategies.fairfed import FairFed
from aggregator_service.strategies.fedavg import FedAvg
from aggregator_service.strategies.fedeba import FedEBA, FedEBAPlus, PracFedEBAPlus
from aggregator_service.strategies.fedfair import FedFair
from aggregator_service.strategies.fedmgda import FedMGDAPlus
from aggregator_service.strategies.fedprox import FedProx
from aggregator_service.strategies.qffl import QFFL
from aggregator_service.strategies.term import TERM

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (
        FedAvg,
        FedEBA,
        FedEBAPlus,
        PracFedEBAPlus,
        FedProx,
        FedFair,
        QFFL,
        AFL,
        FedMGDAPlus,
        TERM,
        Equitable,
        Cluster2,
        FairFed,
    )
}

__all__ = [
    "STRATEGIES",
    "AggregateOutcome",
    "PhasePlan",
    "RoundContext",
    "Strategy",
    "build_strategy",
    "validate_strategy",
]


def validate_strategy(name: str, params: dict[str, Any], path: str) -> Any:
    from fairfl.config import ConfigError

    if name not in STRATEGIES:
        raise ConfigError(f"{path}.name: unknown strategy {name!r}; available: {', '.join(sorted(STRATEGIES))}")
    return params_from_dict(STRATEGIES[name].Params, params, path)


def build_strategy(name: str, params: dict[str, Any], server_lr: float) -> Strategy:
    return STRATEGIES[name](validate_strategy(name, params, "strategy"), server_lr)
