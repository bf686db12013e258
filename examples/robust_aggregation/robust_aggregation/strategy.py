"""Coordinate-wise robust aggregation (Yin et al. 2018): the median or trimmed mean of the clients' updates.

Each coordinate of the new model moves by a statistic of that coordinate over the clients that is insensitive to a
few extreme updates, instead of FedAvg's sample-weighted mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from fairfl.api import UPDATE, AggregateOutcome, ClientResult, ConfigError, RoundContext, Strategy, train_results

if TYPE_CHECKING:
    from fairfl.api import ExperimentConfig  # only for the annotation of validate_run


@dataclass(frozen=True)
class RobustParams:
    """`strategy.params`, checked when the config loads (unknown keys, types, then `validate`)."""

    method: Literal["median", "trimmed_mean"] = "trimmed_mean"
    trim: float = 0.1  # trimmed_mean: fraction of the updates dropped at each end of every coordinate

    def validate(self, path: str) -> None:
        if not 0.0 <= self.trim < 0.5:
            raise ConfigError(f"{path}.trim: must be in [0, 0.5), got {self.trim}")


class CoordinateMedian(Strategy):
    """Coordinate-wise median or trimmed mean of the updates; one exchange per round, no client-side procedure."""

    name = "robust"
    Params = RobustParams
    reads_client_losses = False  # the agents skip measuring F_i unless training.loss_telemetry asks for it
    # Under record-level DP-SGD every update is already private: any function of them (this one) is post-processing.
    # Not "federation": the engine's client-level DP replaces the aggregate with its own clipped noisy average.
    privacy_principals = frozenset({"client"})

    @classmethod
    def validate_run(cls, cfg: ExperimentConfig, params: Any) -> None:
        # A rule across sections: a trimmed mean that never trims anything is FedAvg without weights; say so.
        if (
            params.method == "trimmed_mean"
            and params.trim > 0
            and int(params.trim * cfg.selection.clients_per_round) < 1
        ):
            raise ConfigError(
                f"strategy.params.trim: {params.trim} of {cfg.selection.clients_per_round} clients per round trims "
                f"no update; use trim >= {1 / cfg.selection.clients_per_round:.3g} or trim 0"
            )

    def aggregate(self, ctx: RoundContext, phases: Sequence[list[ClientResult]]) -> AggregateOutcome:
        results = train_results(phases)
        n = len(results)
        # One row per client (results come sorted by client id), one column per model coordinate.
        ordered = torch.stack([r.payloads[UPDATE] for r in results]).sort(dim=0).values
        # Drop `cut` updates at each end of every coordinate; the median keeps the middle one (odd n) or two (even n).
        trim = 0.5 if self.params.method == "median" else self.params.trim
        cut = min(int(trim * n), (n - 1) // 2)
        delta = ordered[cut : n - cut].mean(dim=0)
        return AggregateOutcome(
            params=ctx.params + self.server_lr * delta,
            weights={r.client_id: 1.0 / n for r in results},  # every client counts the same
            metrics={"robust_trimmed_per_side": float(cut), "robust_update_norm": float(delta.norm())},
        )
