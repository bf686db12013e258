"""The data signature: what a model factory needs to know about a run's data, known without loading the data.

The aggregator holds no data but builds the initial model, so the signature comes from the dataset plug-in's
declaration (fairfl.data.plugin), never from the arrays; agents check that the data they load matches it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DataSignature"]


@dataclass(frozen=True)
class DataSignature:
    """Shape of one sample (without the batch dimension), number of classes, and optional feature names."""

    input_shape: tuple[int, ...]
    num_classes: int
    feature_names: tuple[str, ...] | None = None  # tabular data: one name per input feature

    def __post_init__(self) -> None:
        shape = tuple(self.input_shape)
        if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape):
            raise ValueError(f"DataSignature: input_shape must be a non-empty tuple of positive integers, got {shape}")
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int) or self.num_classes < 2:
            raise ValueError(f"DataSignature: num_classes must be an integer >= 2, got {self.num_classes!r}")
        names = None if self.feature_names is None else tuple(self.feature_names)
        if names is not None and len(names) != math.prod(shape):
            raise ValueError(f"DataSignature: {len(names)} feature_names for {math.prod(shape)} input features")
        object.__setattr__(self, "input_shape", shape)  # accept lists, store the hashable tuple
        object.__setattr__(self, "feature_names", names)

    @property
    def num_features(self) -> int:
        """Scalars per sample (the flattened input size)."""
        return math.prod(self.input_shape)
