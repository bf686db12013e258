"""A user's model factory: any nn.Module from the data signature and declared parameters."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from fairfl.api import ConfigError, DataSignature, model_factory


@dataclass(frozen=True)
class SmallMlpParams:
    width: int = 16

    def validate(self, path: str) -> None:
        if self.width < 1:
            raise ConfigError(f"{path}.width: must be >= 1, got {self.width}")


@model_factory(SmallMlpParams)
def small_mlp(signature: DataSignature, width: int = 16) -> nn.Module:
    """Flatten, one hidden layer, and the output nn.Linear last (the head found by convention)."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(signature.num_features, width),
        nn.Tanh(),
        nn.Linear(width, signature.num_classes),
    )
