"""A user's strategy with its own client-side procedure: coordinate-wise median of the updates; every client reports
the norm of its update (times a factor the strategy sends) and its step count, which the strategy records."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fairfl.api import (
    UPDATE,
    AggregateOutcome,
    ClientResult,
    ConfigError,
    LocalProcedure,
    LocalState,
    RoundContext,
    Strategy,
    train_results,
)

NORM_METRIC = "testplug_update_norm"
STEPS_METRIC = "testplug_steps"


@dataclass(frozen=True)
class UpdateNormParams:
    scale: float = 1.0

    def validate(self, path: str) -> None:
        if not self.scale > 0:
            raise ConfigError(f"{path}.scale: must be > 0, got {self.scale}")


class UpdateNorm(LocalProcedure):
    """Client side: counts the optimiser steps and reports scale * ||update|| after training."""

    Params = UpdateNormParams

    def begin(self, state: LocalState) -> None:
        self.steps = 0

    def after_step(self, state: LocalState) -> None:
        self.steps += 1

    def finish(self, state: LocalState, result: ClientResult) -> None:
        assert state.update is not None
        result.metrics[NORM_METRIC] = float(torch.linalg.vector_norm(state.update)) * self.params.scale
        result.metrics[STEPS_METRIC] = float(self.steps)


@dataclass(frozen=True)
class CoordinateMedianParams:
    norm_scale: float = 1.0  # sent to every client's UpdateNorm

    def validate(self, path: str) -> None:
        if not self.norm_scale > 0:
            raise ConfigError(f"{path}.norm_scale: must be > 0, got {self.norm_scale}")


class CoordinateMedian(Strategy):
    name = "coordinate_median"
    Params = CoordinateMedianParams
    reads_client_losses = False
    client_procedure = UpdateNorm

    def procedure_params(self, ctx: RoundContext) -> UpdateNormParams:
        return UpdateNormParams(scale=self.params.norm_scale)

    def aggregate(self, ctx: RoundContext, phases: Sequence[list[ClientResult]]) -> AggregateOutcome:
        results = train_results(phases)
        updates = torch.stack([r.payloads[UPDATE] for r in results])
        median = updates.median(dim=0).values  # the lower median for an even count: deterministic
        norms = [r.metrics[NORM_METRIC] for r in results]  # KeyError if a client did not run the procedure
        return AggregateOutcome(
            params=ctx.params + self.server_lr * median,
            weights={r.client_id: 1.0 / len(results) for r in results},
            metrics={
                "testplug_mean_update_norm": sum(norms) / len(norms),
                "testplug_clients_reporting": float(len(norms)),
                "testplug_total_steps": sum(r.metrics[STEPS_METRIC] for r in results),
            },
        )
