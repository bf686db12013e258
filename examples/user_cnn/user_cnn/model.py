"""A small CNN model factory: any `factory(signature, **params) -> nn.Module` is a FairFL model."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fairfl.api import ConfigError, DataSignature, model_factory


@dataclass(frozen=True)
class SmallCnnParams:
    """`model.params`: checked against these fields (unknown keys, types, `validate`) when the config loads."""

    channels: int = 16  # width of the first conv; the second has twice as many
    hidden: int = 64  # width of the penultimate layer (HiCS-FL / Equitable-FL signatures come from here)
    dropout: float = 0.0

    def validate(self, path: str) -> None:
        for name in ("channels", "hidden"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{path}.{name}: must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"{path}.dropout: must be in [0, 1), got {self.dropout}")


class SmallCnn(nn.Module):
    """Two padded 3x3 conv + 2x2 max-pool blocks, then hidden -> classes. Its last nn.Linear is the output
    layer, which is how FairFL finds the head (no declared hook needed)."""

    def __init__(self, signature: DataSignature, channels: int, hidden: int, dropout: float) -> None:
        super().__init__()
        if len(signature.input_shape) != 3:
            # A ValueError here becomes a config error naming model.name, before round 1.
            raise ValueError(f"small_cnn needs image data (channels, height, width), got {signature.input_shape}")
        self.input_shape = signature.input_shape
        in_ch, height, width = signature.input_shape
        self.body = nn.Sequential(
            nn.Conv2d(in_ch, channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * channels * (height // 4) * (width // 4), hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
        )
        self.out = nn.Linear(hidden, signature.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Batches may arrive flat or image-shaped; reshape to the declared sample shape.
        return self.out(self.body(x.reshape(x.shape[0], *self.input_shape)))


@model_factory(SmallCnnParams)
def small_cnn(signature: DataSignature, channels: int = 16, hidden: int = 64, dropout: float = 0.0) -> nn.Module:
    """FairFL calls this in every process (aggregator and agents) after seeding torch with the run seed."""
    return SmallCnn(signature, channels, hidden, dropout)
